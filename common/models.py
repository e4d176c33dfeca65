"""Model builders over torchvision.models and timm (`-a timm/NAME`, optional:
requirements-timm.txt): any classification architecture, from scratch or
from published weights, with FFCV's BlurPool when asked, and the helper that
finds the plain model inside DataParallel / DDP / torch.compile wrappers."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Sequence, Tuple
from urllib.parse import urlparse

import torch
import torchvision
from torch import nn
from torch.nn import functional

from common.architectures import TIMM_PREFIX, available_architectures, check_architecture, is_timm
from common.errors import UsageError, error_summary

__all__ = ["available_architectures", "build_model", "input_size_kwargs", "sync_batchnorm", "unwrap"]

# Models whose auxiliary heads torchvision turns on by default: the training
# loop expects one logits tensor, so the auxiliary classifiers are switched off.
# init_weights=True keeps their documented initialisation explicit (torchvision
# warns that its implicit default will change, and refuses the flag with weights).
_AUX_LOGITS_ARCHS = ("googlenet", "inception_v3")

# The flag behind each builder setting, for the line that refuses a setting a model does not take (a TypeError).
_SETTING_FLAGS = {"dropout": "--dropout", "drop_rate": "--dropout", "stochastic_depth_prob": "--drop-path",
                  "drop_path_rate": "--drop-path"}


def input_size_kwargs(arch: str, image_size: int) -> dict:
    """Transformers fix their input size at construction (torchvision's default: 224; timm's: its
    pretrained configuration's, fixed_input_size)."""
    if is_timm(arch):
        config = _timm().models.get_pretrained_cfg(arch[len(TIMM_PREFIX):])
        return {"img_size": image_size} if config is not None and config.fixed_input_size else {}
    if arch.startswith("vit_"):
        return {"image_size": image_size}
    if arch.startswith("maxvit_"):
        return {"input_size": (image_size, image_size)}
    return {}


def _regularisation_kwargs(arch: str, dropout: Optional[float], drop_path: Optional[float]) -> dict:
    """--dropout and --drop-path in the builder's words: timm's drop_rate and drop_path_rate,
    torchvision's dropout and stochastic_depth_prob; unset, the architecture's own defaults."""
    names = ("drop_rate", "drop_path_rate") if is_timm(arch) else ("dropout", "stochastic_depth_prob")
    return {name: value for name, value in zip(names, (dropout, drop_path)) if value is not None}


def _timm():
    """timm, imported only for a timm/ model (check_architecture said it is installed)."""
    import timm

    return timm


def _construct(arch: str, num_classes: int, **kwargs) -> nn.Module:
    """The architecture with random weights: torchvision's builder or timm.create_model."""
    if is_timm(arch):
        return _timm().create_model(arch[len(TIMM_PREFIX):], pretrained=False, num_classes=num_classes, **kwargs)
    return torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **kwargs)


# FFCV's BlurPool: only strided convolutions of at least this many input channels are blurred first (their
# rule: a network's stem, on the three colours, keeps its own).
BLURPOOL_MIN_CHANNELS = 16


class Blur(nn.Module):
    """A fixed [1, 2, 1] x [1, 2, 1] / 16 low-pass filter on each channel
    (stride 1, reflect padding: a constant image stays that constant), the
    anti-aliasing BlurPool puts before a strided convolution (Zhang, "Making
    convolutional networks shift-invariant again", 2019; FFCV pads with
    zeros). Its kernel is a buffer, not a parameter: nothing to train, decay
    or save (not in state_dict), derived from the channel count."""

    def __init__(self, channels: int):
        super().__init__()
        taps = torch.tensor([1.0, 2.0, 1.0])
        kernel = torch.outer(taps, taps) / 16.0
        self.register_buffer("kernel", kernel.expand(channels, 1, 3, 3).clone(), persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # a depthwise (grouped) convolution
        padded = functional.pad(images, (1, 1, 1, 1), mode="reflect")
        return functional.conv2d(padded, self.kernel, groups=self.kernel.shape[0])


def add_blurpool(model: nn.Module, arch: str) -> nn.Module:
    """--blurpool: `model` with every nn.Conv2d of stride above 1 and at
    least BLURPOOL_MIN_CHANNELS input channels replaced by Sequential(Blur,
    that convolution) (its weights then named <conv>.1.weight). An
    architecture without one is the user's mistake, in one line."""
    def blur(module: nn.Module) -> int:
        count = 0
        for name, child in module.named_children():
            if (isinstance(child, nn.Conv2d) and max(child.stride) > 1
                    and child.in_channels >= BLURPOOL_MIN_CHANNELS):
                setattr(module, name, nn.Sequential(Blur(child.in_channels), child))
                count += 1
            else:
                count += blur(child)
        return count

    if not blur(model):
        raise UsageError(f"argument --blurpool: {arch} has no convolution with a stride above 1 and "
                         f"{BLURPOOL_MIN_CHANNELS} or more input channels to blur before; leave --blurpool out")
    return model


def _check_input_sizes(arch: str, num_classes: int, sizes: Sequence[Tuple[str, int]], kwargs: dict,
                       blurpool: bool = False) -> None:
    """Run the architecture on the meta device (shapes only: no memory, no
    compute) at each (flag, side) of `sizes`, so an image size the model
    cannot take is one line at start-up naming the flag that asks for it,
    not a traceback at the first step (or at the first validation);
    --blurpool's too (a blur needs maps of 2 pixels or more), and an
    architecture it cannot apply to; a --dropout or --drop-path the
    builder does not take."""
    try:
        with torch.device("meta"):
            twin = _construct(arch, num_classes, **kwargs)
            twin = (add_blurpool(twin, arch) if blurpool else twin).eval()
    except UsageError:  # --blurpool on an architecture without a strided convolution
        raise
    except NotImplementedError:  # an op without a meta implementation: the check cannot run, training will tell
        return
    except Exception as error:  # a setting it lacks (TypeError), a size it refuses (ViT's patches: AssertionError)
        setting = next((name for name in _SETTING_FLAGS if name in kwargs and f"'{name}'" in str(error)), None)
        if isinstance(error, TypeError) and setting:
            raise UsageError(f"argument {_SETTING_FLAGS[setting]}: {arch} has no {setting} setting "
                             f"(leave {_SETTING_FLAGS[setting]} out)") from None
        raise UsageError(f"argument --image-size: {arch} cannot take {sizes[0][1]}-pixel images "
                         f"({error_summary(error)})") from None
    with_blurpool = " with --blurpool" if blurpool else ""
    for flag, image_size in sizes:
        try:
            with torch.device("meta"):
                twin(torch.empty(2, 3, image_size, image_size))
        except NotImplementedError:
            return
        except Exception as error:  # shape errors: RuntimeError, AssertionError, ValueError, ...
            raise UsageError(f"argument {flag}: {arch}{with_blurpool} cannot take {image_size}-pixel images "
                             f"({error_summary(error)})") from None


def check_one_image_per_step(arch: str, image_size: int) -> None:
    """-b 1 in training: BatchNorm cannot normalise a feature map of one
    value per channel (a 1x1 map of one image), which small images reach in
    most architectures. Checked on the meta device, in training mode."""
    try:
        with torch.device("meta"):
            twin = _construct(arch, 1000, **input_size_kwargs(arch, image_size))
            twin.train()(torch.empty(1, 3, image_size, image_size))
    except ValueError as error:  # "Expected more than 1 value per channel when training"
        if "value per channel" in str(error):
            raise UsageError(f"argument -b/--batch-size: one image per step is too few for {arch} at {image_size}-"
                             f"pixel images ({error_summary(error)}); use -b 2 or more, or a larger --image-size"
                             ) from None
    except Exception:  # an image size it cannot take at all, or an op without a meta version: told elsewhere
        return


def build_model(arch: str, num_classes: int, pretrained: bool = False, image_size: int = 224,
                dropout: Optional[float] = None, other_sizes: Sequence[Tuple[str, int]] = (),
                blurpool: bool = False, drop_path: Optional[float] = None,
                pretrained_file: Optional[str] = None) -> nn.Module:
    """A classifier with `num_classes` outputs for square `image_size`
    inputs (and classifier `dropout`, stochastic depth `drop_path`, when
    given; `blurpool`: add_blurpool, after any pretrained weights are
    loaded); checked to take the `other_sizes` too, (flag, side) pairs
    (config.CropSizes.model_inputs: the validation crop, progressive
    resizing's smallest and largest crops). torchvision's, or timm's for
    `timm/NAME` (_timm_pretrained: its weights from `pretrained_file` or
    Hugging Face's local cache).

    With `pretrained`, torchvision's default ImageNet weights are loaded from
    the torch hub cache (downloaded when the machine can); if the class count
    is not 1000 the last linear layer is replaced by a new, randomly
    initialised one, so the weights serve as a start for fine-tuning.
    """
    check_architecture(arch)
    settings = _regularisation_kwargs(arch, dropout, drop_path)
    if is_timm(arch):
        kwargs = {**input_size_kwargs(arch, image_size), **settings}
        _check_input_sizes(arch, num_classes, [("--image-size", image_size), *other_sizes], kwargs, blurpool)
        model = (_timm_pretrained(arch, num_classes, kwargs, pretrained_file) if pretrained or pretrained_file
                 else _construct(arch, num_classes, **kwargs))
        return add_blurpool(model, arch) if blurpool else model
    aux_off = {"aux_logits": False} if arch in _AUX_LOGITS_ARCHS else {}
    scratch = {**aux_off, "init_weights": True} if arch in _AUX_LOGITS_ARCHS else {}
    weights = torchvision.models.get_model_weights(arch).DEFAULT if pretrained else None
    built_size = weights.meta["min_size"][0] if pretrained else image_size  # pretrained weights fix the size
    kwargs = {**scratch, **input_size_kwargs(arch, built_size), **settings}
    _check_input_sizes(arch, num_classes, [("--image-size", image_size), *other_sizes], kwargs, blurpool)
    if not pretrained:
        model = _construct(arch, num_classes, **kwargs)
        return add_blurpool(model, arch) if blurpool else model

    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(weights.url).path).name
    if cached.is_file():
        _refuse_code(cached)
    try:
        model = torchvision.models.get_model(arch, weights=weights, **aux_off, **settings)
    except Exception as error:  # no network, proxy refusal, partial download: all end the same way
        raise UsageError(
            f"argument --pretrained: the {arch} weights are not in {cached} and could not be downloaded "
            f"({error_summary(error)}); copy {weights.url} there from a machine with internet access"
        ) from None
    if num_classes != len(weights.meta["categories"]):
        _replace_last_linear(model, num_classes)
    return add_blurpool(model, arch) if blurpool else model


def _timm_pretrained(arch: str, num_classes: int, kwargs: dict, pretrained_file: Optional[str]) -> nn.Module:
    """A timm model built with timm's weights for it, read from
    `pretrained_file` or Hugging Face's local cache (_timm_cached_weights):
    timm's own loader, tensors only (weights_only), handed to create_model as
    a state dict, so that timm adapts it (a ViT's position embedding to the
    image size) and never looks at the network. A classifier of another class
    count than the file's is left out, and made anew."""
    timm, name = _timm(), arch[len(TIMM_PREFIX):]
    flag, path = ("--pretrained-file", Path(pretrained_file)) if pretrained_file else (
        "--pretrained", _timm_cached_weights(name))
    try:
        state = timm.models.load_state_dict(str(path), use_ema=False, weights_only=True)
    except Exception as error:  # a pickle naming code, not a weights file, unreadable
        raise UsageError(f"argument {flag}: {path} is not a plain weights file timm can read "
                         f"({error_summary(error)})") from None
    config = timm.models.get_pretrained_cfg(name)
    classifier = config.classifier if config is not None else None
    classifier = classifier[0] if isinstance(classifier, (tuple, list)) else classifier
    head = state.get(f"{classifier}.weight") if classifier else None
    overlay = {"state_dict": state, "num_classes": head.shape[0] if head is not None else num_classes}
    try:
        return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, num_classes=num_classes,
                                 **kwargs)
    except Exception as error:  # names or shapes that are another model's
        raise UsageError(f"argument {flag}: the weights in {path} do not fit {arch} "
                         f"({error_summary(error)})") from None


def _timm_cached_weights(name: str) -> Path:
    """Where timm's weights for `name` (NAME or NAME.TAG) lie on this
    machine: Hugging Face's cache (HF_HUB_CACHE, or HF_HOME/hub), then the
    torch hub cache of its older URL. Never downloaded: a run must not wait
    on the network, and the tests have none; missing, one line saying where
    they were looked for and how to put them there."""
    from huggingface_hub import constants, try_to_load_from_cache  # timm's own dependency

    config = _timm().models.get_pretrained_cfg(name)
    if config is None or not (config.hf_hub_id or config.url):
        raise UsageError(f"argument --pretrained: timm publishes no weights for {name}; "
                         f"give --pretrained-file PATH or leave --pretrained out")
    looked = []
    if config.hf_hub_id:
        for filename in ([config.hf_hub_filename] if config.hf_hub_filename else
                         ["model.safetensors", "open_clip_model.safetensors", "pytorch_model.bin"]):
            found = try_to_load_from_cache(config.hf_hub_id, filename, cache_dir=constants.HF_HUB_CACHE)
            if isinstance(found, str):  # else None, or a marker that the hub has no such file
                return Path(found)
        looked.append(str(Path(constants.HF_HUB_CACHE) / f"models--{config.hf_hub_id.replace('/', '--')}"))
    if config.url:
        cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(config.url).path).name
        if cached.is_file():
            return cached
        looked.append(str(cached))
    fetch = f"{_hub_download_command()} {config.hf_hub_id}" if config.hf_hub_id else f"copy {config.url}"
    raise UsageError(f"argument --pretrained: timm's weights for {name} are not in {' nor '.join(looked)} "
                     f"(a run never downloads them); {fetch} on a machine with internet access, "
                     f"or give --pretrained-file PATH")


def _hub_download_command() -> str:
    """The installed huggingface_hub's download command: `hf download` since 0.34; huggingface_hub 1.0
    removed `huggingface-cli`, which older ones alone have."""
    import huggingface_hub

    major_minor = tuple(int(part) for part in re.findall(r"\d+", huggingface_hub.__version__)[:2])
    return "hf download" if major_minor >= (0, 34) else "huggingface-cli download"


def _refuse_code(path: Path) -> None:
    """torch.hub loads the cached weights file with the full unpickler, which
    runs whatever code a pickle names; a file copied in from elsewhere is read
    here first with weights_only=True, which allows only tensors and plain
    containers. A file that passes holds nothing else, so the full load that
    follows runs no code either. (A file torchvision downloads itself comes
    from its own URL, checked against the hash in its name.)"""
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise UsageError(f"argument --pretrained: {path} is not a plain weights file ({error_summary(error)}); "
                         f"delete it (it is downloaded again) or copy in the file torchvision publishes") from None


def _replace_last_linear(model: nn.Module, num_classes: int) -> None:
    """Swap the final nn.Linear (the classifier head in torchvision's models)
    for a fresh one with `num_classes` outputs."""
    linear_names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not linear_names:
        raise UsageError(
            f"argument --pretrained: {type(model).__name__} has no linear classifier layer to resize to "
            f"{num_classes} classes; train it from scratch instead"
        )
    parent_name, _, child_name = linear_names[-1].rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child_name)
    setattr(parent, child_name, nn.Linear(old.in_features, num_classes, bias=old.bias is not None))


def uses_channels_last(memory_format: str, device: torch.device, policy) -> bool:
    """--memory-format resolved. auto: channels-last on the CPU (oneDNN's
    convolutions run NHWC natively; ResNet-18 fp32 trains about 1.2x faster
    on the Xeon of RESULTS.md) and where the precision policy asks for it
    (O2/O3 on GPUs: tensor cores want NHWC); plain NCHW for fp32 on GPUs."""
    if memory_format != "auto":
        return memory_format == "channels_last"
    return device.type == "cpu" or policy.channels_last


def sync_batchnorm(model: nn.Module, arch: str) -> nn.Module:
    """--sync-bn: every BatchNorm a SyncBatchNorm. timm's own conversion for
    its models: theirs fuse the activation into the norm (BatchNormAct2d),
    which torch's conversion would drop."""
    if is_timm(arch):
        return _timm().layers.convert_sync_batchnorm(model)
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def compiled(model: nn.Module, enabled: bool) -> nn.Module:
    """--compile: torch.compile's module (compiled at its first steps), or
    the model unchanged. Compiled before any DDP wrapper, so the wrapper's
    own module (what validation runs) is the compiled one."""
    return torch.compile(model) if enabled else model


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DataParallel, DistributedDataParallel and
    torch.compile wrappers: what checkpoints save, so any script can load them."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model
