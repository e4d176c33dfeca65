"""The command line of every entry script: `build_parser(mode)`, the one
argparse parser, its flags in groups (model, data, optimisation, schedule,
run, checkpoints, measurement, distributed, precision) and their value types.
common/cli.py parses with it and checks the values across flags.

Torch-free, as cli.py is: the architecture names come from
common.architectures' cache, the choices from common.config.
"""
from __future__ import annotations

import argparse
import re
import signal
import textwrap
from typing import Tuple, Union

from common.architectures import available_architectures
from common.config import (AUTO_AUGMENT_POLICIES, CONSTANT_WARMUP_DECAY, DATA_BACKENDS, DATA_TIMEOUT_SECONDS,
                           DDP_COMM_HOOKS, LR_SCHEDULE_ALIASES, LR_SCHEDULES, MAX_DATA_TIMEOUT_SECONDS, MODES,
                           PREEMPT_SIGNALS, WARMUP_METHODS)
from common.arguments import (Parser, byte_size, float_in, int_at_least, non_negative_float, non_negative_int, percent,
                              positive_float, positive_int, seed_int, unit_interval)
from common.config import CUDA_GRAPHS, DATA_WORKERS, TRACKERS, TRACKERS_REQUIREMENTS
from common.errors import STOPPED_EXIT_STATUS, program
from common import recipes

_DESCRIPTIONS = {
    "nd": "Train and validate an ImageNet classifier on one device (a GPU, or the CPU).",
    "dp": "Train and validate an ImageNet classifier with nn.DataParallel over the visible GPUs.",
    "ddp": "Train and validate an ImageNet classifier with DistributedDataParallel.",
    "ddp_apex": "DistributedDataParallel training with mixed precision (Apex-style --opt-level).",
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except empty ones (None, False) that the help text explains."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)

    def _split_lines(self, text, width):
        # Wrapped at spaces only: a name such as ffcv-rn18-16, or a flag, stays whole on one line.
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser(mode: str) -> argparse.ArgumentParser:
    """The parser of entry script imagenet_<mode>.py: the flags every script
    shares, in groups, and those of its mode (distributed, mixed precision)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    parser = Parser(
        prog=program() or f"imagenet_{mode}.py",
        description=_DESCRIPTIONS[mode],
        formatter_class=_HelpFormatter,
        allow_abbrev=False,  # abbreviations turn ambiguous as flags are added
    )
    parser.add_argument(
        "data", metavar="DATA", nargs="?", default=None,
        help="dataset folder holding train/<class>/<images> and val/<class>/<images>; or the shards of one "
             "(a folder holding manifest.json, written by python -m common.tools.pack_shards DATA OUT; or "
             "s3://bucket/prefix, credentials from the AWS environment or profile, never in the URL); "
             "may be omitted with --synthetic",
    )
    _add_recipe_flag(parser.add_argument_group("recipe"))
    _add_model_flags(parser.add_argument_group("model"), mode)
    _add_data_flags(parser.add_argument_group("data"))
    _add_augmentation_flags(parser.add_argument_group("augmentation and mixing (docs/recipes.md)"))
    _add_resolution_flags(parser.add_argument_group(
        "resolution and sampling", "FixRes's training and validation sizes, FFCV's progressive resizing and "
                                   "test-time flip, DeiT's repeated augmentation (docs/recipes.md)"))
    _add_optimisation_flags(parser.add_argument_group("optimisation"))
    _add_schedule_flags(parser.add_argument_group("learning-rate schedule"))
    _add_ema_flags(parser.add_argument_group("model EMA (torchvision's references)"))
    _add_run_flags(parser.add_argument_group("run"))
    _add_checkpoint_flags(parser.add_argument_group("checkpoints and preemption"))
    _add_measurement_flags(parser.add_argument_group("measurement"))
    if mode in ("ddp", "ddp_apex"):
        _add_distributed_flags(parser)
    if mode == "ddp_apex":
        _add_precision_flags(parser)
    return parser


def _add_recipe_flag(group) -> None:
    group.add_argument("--recipe", default=None, metavar="NAME",
                       help="a published training recipe's flags, set as if typed before this command line, so that "
                            "any flag given here overrides its value; config.json records the recipe, what it set "
                            "and what was overridden. Each is a file, common/recipes/NAME.toml, with its source, "
                            "its published top-1, hardware and time (docs/recipes.md has the table): "
                            + ", ".join(recipes.names()))


def _add_model_flags(group, mode: str) -> None:
    group.add_argument(
        "-a", "--arch", metavar="ARCH", default="resnet50",
        help="any torchvision classification model: " + ", ".join(available_architectures()) + ", or timm/NAME, "
             "any of timm's models (timm.list_models(): timm/resnet50d, timm/convnext_tiny, timm/efficientnet_b0, "
             "timm/vit_base_patch16_224, ...; NAME.TAG picks its pretrained weights), with timm installed "
             "(pip install -r requirements-timm.txt)",
    )
    group.add_argument("--pretrained", action="store_true",
                       help="start from torchvision's ImageNet weights (from the local torch hub cache, "
                            "or downloaded; the last linear layer is replaced when the class count differs), or a "
                            "timm/ model's (from Hugging Face's local cache only: see --pretrained-file)")
    group.add_argument("--dropout", type=float_in(0.0, 1.0, False, True, "a probability in [0, 1)"), default=None,
                       metavar="P", help="dropout probability of the classifier, for architectures that have one "
                                         "(AlexNet, VGG, SqueezeNet, MobileNet, EfficientNet, ...); default: "
                                         "the architecture's own")
    group.add_argument("--memory-format", choices=("auto", "channels_last", "contiguous"), default="auto",
                       help="memory layout of the model and the input batches. auto: channels_last on the CPU "
                            "(oneDNN's faster layout) and with --opt-level O2/O3 on GPUs (tensor cores), contiguous "
                            "(NCHW) otherwise")
    group.add_argument("--channels-last", dest="memory_format", action="store_const", const="channels_last",
                       help="the same as --memory-format channels_last")
    group.add_argument("--blurpool", action=argparse.BooleanOptionalAction, default=False,
                       help="anti-aliased downsampling (FFCV's BlurPool): a fixed [1,2,1]x[1,2,1]/16 blur per channel "
                            "(reflect padding) before every convolution with a stride above 1 and 16 or more input "
                            "channels; no parameters added. Refused for an architecture that has no such convolution "
                            "(VGG, AlexNet, SqueezeNet, DenseNet, GoogLeNet, ViT, Swin)")
    if mode != "dp":  # nn.DataParallel copies the model to every GPU at each step: torch.compile does not follow
        group.add_argument("--compile", action="store_true",
                           help="compile the model with torch.compile (the first steps take minutes while it "
                                "compiles; throughput figures leave out --throughput-warmup-steps)")
    group.add_argument("--cuda-graphs", choices=CUDA_GRAPHS, default="auto",
                       help="on: capture the training step (forward, loss, backward, loss scaling, SGD) in one CUDA "
                            "graph after a few eager steps and replay it each step; what cannot be captured runs "
                            "eagerly, said once at the start. auto: eager for now, until run_scripts/gpu_check.sh "
                            "has measured graphs on a GPU. off: eager. on needs a CUDA GPU")
    group.add_argument("--drop-path", type=float_in(0.0, 1.0, False, True, "a probability in [0, 1)"), default=None,
                       metavar="P", help="stochastic depth: the probability of skipping a residual block in training "
                                         "(timm's drop_path_rate; torchvision's stochastic_depth_prob: ConvNeXt, "
                                         "EfficientNet, Swin, MaxViT); refused for a model without it; default: the "
                                         "architecture's own")
    group.add_argument("--pretrained-file", default=None, metavar="PATH",
                       help="start a timm/ model from the weights in this local file (.safetensors, or a .pth/.bin "
                            "state dict: plain tensors only; a classifier of another class count is replaced). "
                            "--pretrained alone reads timm's weights from Hugging Face's local cache, never the "
                            "network")


def _add_data_flags(group) -> None:
    group.add_argument("-j", "--workers", type=non_negative_int, default=DATA_WORKERS, metavar="N",
                       help="data-loading worker processes per training process; more on a node than its cores is "
                            "a warning (they take turns), more than its memory holds (each with its own pages and "
                            "two prefetched batches) an error")
    group.add_argument("--image-size", "--train-crop-size", dest="image_size", type=positive_int, default=224,
                       metavar="PIXELS",
                       help="side of the square training crop and, unless --val-crop-size says otherwise, of the "
                            "validation centre crop (a batch of them as float32 input must fit in this machine's "
                            "memory); --train-crop-size is torchvision's name for it")
    group.add_argument("--val-resize", "--val-resize-size", dest="val_resize", type=positive_int, default=256,
                       metavar="PIXELS",
                       help="validation images are resized so their short side is this, then centre-cropped (one "
                            "such image must fit in this machine's memory); --val-resize-size is torchvision's name")
    group.add_argument("--crop-scale", type=float_in(0.0, 1.0, True, False, "a fraction in (0, 1]"), nargs=2,
                       default=[0.08, 1.0], metavar=("MIN", "MAX"),
                       help="range of the image-area fraction the random training crop covers (the ImageNet "
                            "recipe's 0.08 1; small images such as the demo's digits want a milder range)")
    group.add_argument("--hflip", type=float_in(0.0, 1.0, False, False, "a probability in [0, 1]"), default=0.5,
                       metavar="PROB", help="probability of flipping a training image horizontally "
                                            "(0 where mirror images mean something else, as with digits)")
    group.add_argument("--data-backend", choices=DATA_BACKENDS, default="torchvision",
                       help="who decodes and transforms images. torchvision: decode_jpeg (at reduced size when the "
                            "crop shrinks anyway) and uint8 tensor transforms in the workers, normalisation on the "
                            "device; pil: Pillow and float32 transforms in the workers (the plain reference); gpu: "
                            "JPEGs decoded on the GPU by nvJPEG; dali: NVIDIA DALI decodes each crop's region on the "
                            "GPU (its hardware JPEG decoder where it has one), or on the CPU without one (pip install "
                            "-r requirements-dali.txt). All draw the same crops for a seed")
    group.add_argument("--synthetic", action="store_true",
                       help="random tensors instead of images (no disk I/O), for benchmarking; DATA may be "
                            "omitted. Validation then covers 10 batches per process")
    group.add_argument("--file-list", default=None, metavar="PATH",
                       help="train from a prepared list instead of scanning DATA: one 'train/<class>/<file> LABEL' or "
                            "'val/<class>/<file> LABEL' line per image, relative to DATA (DALI's file-list format; "
                            "python -m common.tools.filelist DATA PATH writes one). A val/ path listed twice is "
                            "refused; a train/ path listed again is trained on as often as listed. Without it the "
                            "primary process scans DATA once per job, and a later run reuses that scan (cached in "
                            "~/.cache/imagenet-reference/, or under an absolute XDG_CACHE_HOME) while no folder of "
                            "DATA has changed")
    group.add_argument("--bad-images", choices=("fail", "skip"), default="fail",
                       help="an image file that cannot be decoded (truncated, empty, not an image, unreadable): "
                            "fail stops the run at once, naming it; skip replaces it with the next readable image "
                            "of the dataset (the same on every process and in every epoch), counts it per epoch "
                            "(metrics.csv, bad_images) and lists it in the run directory's bad_images.csv")
    group.add_argument("--data-timeout", type=float_in(0.0, MAX_DATA_TIMEOUT_SECONDS, False, False,
                                                       f"seconds from 0 to {MAX_DATA_TIMEOUT_SECONDS:.0f} (a week)"),
                       default=DATA_TIMEOUT_SECONDS, metavar="SECONDS",
                       help="how long a training step or validation waits for its batch: past it the run stops "
                            "(exit status 5) with one line naming the data-loading worker and the file it is "
                            "reading (a worker that was stopped, a network file system that stopped answering), "
                            "after a checkpoint when it trains in one process with --workers 1 or more. 0: wait "
                            "for ever")
    _add_shard_flags(group)


def _add_shard_flags(group) -> None:
    """A sharded DATA's (python -m common.tools.pack_shards; docs/launching.md#shards)."""
    group.add_argument("--data-cache", default=None, metavar="DIR",
                       help="sharded DATA only: a node-local folder (local disk) where each node copies each shard "
                            "whole on its first read; later reads, epochs and requeued jobs read it there, and the "
                            "processes of a node share it. Every epoch reads from every shard, so size it for the "
                            "whole dataset")
    group.add_argument("--data-cache-size", dest="data_cache_bytes", type=byte_size, default=0, metavar="SIZE",
                       help="--data-cache's cap (200M, 500G, 1T, 256GiB): past it the least recently used shards "
                            "are evicted. Default: what its disk has free, less a margin")
    group.add_argument("--s3-endpoint-url", default=None, metavar="URL",
                       help="s3:// DATA only: the S3-compatible server (http(s)://HOST[:PORT]). Default: the AWS "
                            "environment's or profile's (AWS_ENDPOINT_URL), else AWS itself")


# MixUp's and CutMix's alpha: below 0.01 torch's Beta sampler (float32) returns 0.5 for many draws instead of
# shares near 0 and 1; above 1e6 every share is 0.5 to within 0.0005, and larger values reach float32's infinity.
MIN_MIXING_ALPHA, MAX_MIXING_ALPHA = 0.01, 1e6


def _mixing_alpha(text: str) -> float:
    value = non_negative_float(text)
    if value and not MIN_MIXING_ALPHA <= value <= MAX_MIXING_ALPHA:
        raise argparse.ArgumentTypeError(f"expected 0 (off) or from {MIN_MIXING_ALPHA:g} to {MAX_MIXING_ALPHA:g}, "
                                         f"got {text}")
    return value


def _add_augmentation_flags(group) -> None:
    group.add_argument("--auto-augment", choices=AUTO_AUGMENT_POLICIES, default=None,
                       help="an augmentation policy of torchvision.transforms.v2 on each training image after its "
                            "crop and flip: ta_wide (TrivialAugmentWide), ra (RandAugment, --ra-magnitude), augmix "
                            "(AugMix, --augmix-severity), imagenet (AutoAugment's ImageNet policy); the same draws "
                            "on the pil, torchvision and gpu backends (not with dali)")
    group.add_argument("--ra-magnitude", type=int_at_least(0, "a magnitude bin from 0 to 30", maximum=30), default=9,
                       metavar="N", help="with --auto-augment ra: RandAugment's magnitude, a bin of its 31")
    group.add_argument("--augmix-severity", type=int_at_least(1, "a severity from 1 to 10", maximum=10), default=3,
                       metavar="N", help="with --auto-augment augmix: AugMix's severity")
    group.add_argument("--random-erase", type=float_in(0.0, 1.0, False, False, "a probability in [0, 1]"),
                       default=0.0, metavar="P",
                       help="erase a random box of each training image with probability P (torchvision's "
                            "RandomErasing: 0 on the normalised image); not with --data-backend dali")
    for name, what in (("mixup", "MixUp: each image blended with the next of its batch"),
                       ("cutmix", "CutMix: a box of the next image of its batch pasted into each")):
        group.add_argument(f"--{name}-alpha", type=_mixing_alpha, default=0.0, metavar="A",
                           help=f"{what}, the share drawn from Beta(A, A), the targets mixed alike (soft targets); "
                                f"0: off. With both, one of the two per batch (as torchvision's references). "
                                f"Training top-1/top-5 then count the label with the larger share")
def _add_resolution_flags(group) -> None:
    group.add_argument("--val-crop-size", type=positive_int, default=None, metavar="PIXELS",
                       help="side of the validation centre crop, cut from the image resized to --val-resize (at "
                            "most that); default: --image-size. Larger than the training crop evaluates at the "
                            "resolution the training crops' objects had (FixRes: train 176, test 224 of 232)")
    group.add_argument("--progressive-resizing", type=non_negative_int, nargs=4, default=None,
                       metavar=("MIN_PX", "MAX_PX", "START_EPOCH", "END_EPOCH"),
                       help="FFCV's progressive resizing: the training crop is MIN_PX up to START_EPOCH, MAX_PX from "
                            "END_EPOCH on, linear in between rounded to a multiple of --progressive-step (FFCV's "
                            "ResNet-50: 160 192 11 13 of 16 epochs); replaces --image-size in training, which stays "
                            "the validation crop's default. Each new size is said once; --compile compiles for it")
    group.add_argument("--progressive-step", type=positive_int, default=32, metavar="PX",
                       help="with --progressive-resizing: the sizes between MIN_PX and MAX_PX are multiples of this")
    group.add_argument("--val-flip", action=argparse.BooleanOptionalAction, default=False,
                       help="test-time flip: validation (and --evaluate) averages the logits of each image and of "
                            "its mirror image, and counts loss, top-1 and top-5 from the average (FFCV's; one more "
                            "forward pass per batch)")
    group.add_argument("--ra-sampler", action=argparse.BooleanOptionalAction, default=False,
                       help="repeated augmentation (DeiT's, torchvision's --ra-sampler): each epoch draws len/K images "
                            "and trains on each K times (--ra-reps), each copy cropped and flipped on its own and, "
                            "with K or more processes, on another process; the epoch keeps the training set's length")
    group.add_argument("--ra-reps", type=positive_int, default=3, metavar="K",
                       help="with --ra-sampler: copies of each drawn image per epoch")


def _add_optimisation_flags(group) -> None:
    group.add_argument("--epochs", type=positive_int, default=90, metavar="N", help="total epochs to run")
    group.add_argument("--start-epoch", type=non_negative_int, default=0, metavar="N",
                       help="epoch number to start at (0-based; --resume sets it from the checkpoint)")
    group.add_argument("-b", "--batch-size", "--b", dest="batch_size", type=positive_int, default=128, metavar="N",
                       help="images per step per GPU (or CPU process); the global batch is this x GPUs. "
                            "--b is the spelling of the Apex tutorial's commands")
    group.add_argument("--lr", "--learning-rate", dest="lr", type=positive_float, default=0.1, metavar="LR",
                       help="learning rate for a global batch of 256, scaled linearly to the real global "
                            "batch (use 0.01 for AlexNet and VGG)")
    group.add_argument("--momentum", type=unit_interval, default=0.9, metavar="M", help="SGD momentum")
    group.add_argument("--wd", "--weight-decay", dest="weight_decay", type=non_negative_float, default=1e-4,
                       metavar="W", help="weight decay")
    group.add_argument("--norm-weight-decay", type=non_negative_float, default=None, metavar="W",
                       help="weight decay of normalisation layers' weights and biases (BatchNorm, GroupNorm, "
                            "LayerNorm, InstanceNorm: torchvision's references' set_weight_decay); default: --wd")
    group.add_argument("--bias-weight-decay", type=non_negative_float, default=None, metavar="W",
                       help="weight decay of the other biases (all biases when --norm-weight-decay is not given); "
                            "default: --wd")
    group.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=False, help="Nesterov momentum (needs --momentum above 0)")
    group.add_argument("--clip-grad-norm", type=positive_float, default=None, metavar="MAX",
                       help="scale the gradients down to this L2 norm (of all of them together) when above it, each "
                            "step: after DDP's exchange, --accum-steps' last micro-batch and fp16's unscaling")
    group.add_argument("--label-smoothing", type=unit_interval, default=0.0, metavar="EPS",
                       help="label smoothing of the cross-entropy loss")
    group.add_argument("--accum-steps", type=positive_int, default=1, metavar="N",
                       help="micro-batches of -b per optimizer step (gradient accumulation): the global batch, "
                            "and so the lr, the schedule and --steps-per-epoch, count -b x N x GPUs; DDP "
                            "exchanges gradients once per step. A 64-GPU run's batch on 8 GPUs: N = 8")


def _add_schedule_flags(group) -> None:
    group.add_argument("--lr-schedule", "--lr-scheduler", dest="lr_schedule", type=_schedule_name,
                       choices=LR_SCHEDULES, default="step",
                       help="step: x0.1 at each of --lr-steps; cosine: half-cosine to --lr-min over the epochs "
                            "after warm-up; linear: FFCV's per-step ramp, from the peak at the end of warm-up "
                            "straight down to --lr-min at the last step. --lr-scheduler also takes torchvision's "
                            "spellings: " + ", ".join(f"{alias} ({name})"
                                                      for alias, name in LR_SCHEDULE_ALIASES.items()))
    group.add_argument("--lr-steps", type=positive_int, nargs="+", default=[30, 60, 80], metavar="EPOCH",
                       help="epochs at which the step schedule multiplies the rate by 0.1")
    group.add_argument("--warmup-epochs", "--lr-warmup-epochs", dest="warmup_epochs", type=non_negative_float,
                       default=0.0, metavar="E",
                       help="warm-up over this many epochs, per step (5 is usual for global batches above 1024)")
    group.add_argument("--lr-warmup-method", dest="warmup_method", choices=WARMUP_METHODS, default="linear",
                       help="linear: the rate climbs per step to the peak (from lr/warm-up steps, or from "
                            "--lr-warmup-decay x lr); constant: --lr-warmup-decay x the rate until warm-up ends "
                            "(torchvision's LinearLR and ConstantLR)")
    group.add_argument("--lr-warmup-decay", dest="warmup_decay", default=None, metavar="F",
                       type=float_in(0.0, 1.0, True, False, "a factor in (0, 1]"),
                       help=f"the warm-up's starting factor of the rate, as torchvision's (default: linear from "
                            f"1/warm-up steps; constant {CONSTANT_WARMUP_DECAY:g})")
    group.add_argument("--lr-min", type=non_negative_float, default=0.0, metavar="LR",
                       help="the schedule's floor, for a global batch of 256 and scaled as --lr: cosine decays to it, "
                            "step never goes below it, linear ends at it; warm-up may start below it")


def _schedule_name(text: str) -> str:
    """--lr-scheduler's spellings: torchvision's (steplr, cosineannealinglr), any case, as the project's names."""
    name = text.strip().lower()
    return LR_SCHEDULE_ALIASES.get(name, name)


def _add_ema_flags(group) -> None:
    group.add_argument("--model-ema", action=argparse.BooleanOptionalAction, default=False,
                       help="keep an exponential moving average of the weights and buffers (torch.optim.swa_utils, "
                            "as torchvision's references), validated beside the model after each epoch (metrics.csv "
                            "split val_ema); the better top-1 of the two makes the best checkpoint and the per-class "
                            "report; kept in checkpoints")
    group.add_argument("--model-ema-steps", type=positive_int, default=32, metavar="N",
                       help="update the average after the run's first optimizer step and every N-th after it "
                            "(counted over the run, not per epoch); during the lr warm-up each update copies the "
                            "weights")
    group.add_argument("--model-ema-decay", type=float_in(0.0, 1.0, False, False, "a decay in [0, 1]"),
                       default=0.99998, metavar="D",
                       help="decay per update, adjusted as torchvision does: the update applies "
                            "1 - min(1, (1 - D) x global batch x N / --epochs)")


def _add_run_flags(group) -> None:
    group.add_argument("-p", "--print-freq", type=positive_int, default=10, metavar="N",
                       help="print a progress line every N steps")
    group.add_argument("--resume", default=None, metavar="PATH|auto",
                       help="continue from a checkpoint (model, optimizer, loss scaler, position within the epoch, "
                            "best accuracy), exactly where it stopped; logs continue in its run directory. auto: the "
                            "newest readable checkpoint of this run's directory (--run-name, else the Slurm job id), "
                            "or a fresh start when there is none yet: the same command serves every restart")
    group.add_argument("-e", "--evaluate", action="store_true",
                       help="only validate (the --resume checkpoint or the --pretrained weights) and exit")
    group.add_argument("--seed", type=seed_int, default=0, metavar="S",
                       help="seed of initialisation, data order and augmentation")
    group.add_argument("--deterministic", action="store_true",
                       help="also make the GPU's arithmetic repeatable: deterministic cuDNN and cuBLAS "
                            "algorithms, no cuDNN autotuning (slower; the CPU needs nothing more than --seed)")
    group.add_argument("--max-nonfinite-steps", type=non_negative_int, default=0, metavar="N",
                       help="a NaN or inf training loss stops the run (the last good checkpoint is kept); with "
                            "N > 0 the first N such steps are skipped instead (no update), at the cost of one "
                            "host-device synchronisation per step")
    group.add_argument("--desired-acc", type=percent, default=None, metavar="ACC",
                       help="stop once validation top-1 reaches this (0.75 and 75 both mean 75%%)")
    group.add_argument("--logdir", default="runs", metavar="DIR",
                       help="run directories (config.json, metrics.csv, TensorBoard, checkpoints) go here")
    group.add_argument("--run-name", default=None, metavar="NAME",
                       help="name of the run directory (default: <Mon><DD>_<HH-MM-SS>_<host>_<arch>_"
                            "<gpu|cpu>x<world>_b<batch>_cpu<workers>_opt<level>)")
    group.add_argument("--steps-per-epoch", type=non_negative_int, default=0, metavar="N",
                       help="stop each epoch's training after N steps (0 = the whole epoch); "
                            "validation still covers the whole val set")
    group.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                       help="auto: CUDA when a GPU is visible, else the CPU")


def _add_checkpoint_flags(group) -> None:
    group.add_argument("--checkpoint-every", type=_checkpoint_interval, default="10min", metavar="Nmin|Nsteps",
                       help="also write a checkpoint every N minutes (10min) or training steps (500steps) within "
                            "epochs, not only at their ends; 0: at epoch ends only")
    group.add_argument("--keep-checkpoints", type=positive_int, default=3, metavar="K",
                       help="keep the newest K checkpoint files of the run (checkpoint.pth.tar is the newest)")
    group.add_argument("--preempt-signal", type=_signal_name, default="SIGUSR1", metavar="SIG",
                       help="the signal Slurm's --signal sends before the time limit: every process stops at the "
                            "same step, a checkpoint is written, and under Slurm the job is requeued. SIGTERM "
                            f"(scancel, preemption) also stops with a checkpoint, without requeue. Exit status "
                            f"after such a stop: {STOPPED_EXIT_STATUS}")
    group.add_argument("--requeue", choices=("auto", "always", "never"), default="auto",
                       help="after a stop on --preempt-signal, run `scontrol requeue $SLURM_JOB_ID`; auto: when "
                            "SLURM_JOB_ID is set")


def _add_measurement_flags(group) -> None:
    group.add_argument("--throughput-warmup-steps", dest="warmup_steps", type=non_negative_int, default=10,
                       metavar="N", help="leave each epoch's first N steps (start-up, cuDNN autotuning, workers "
                                         "filling their queues) out of images/s, s/step and data wait; a split "
                                         "of at most 2N steps is timed whole")
    group.add_argument("--profile-steps", type=non_negative_int, default=0, metavar="N",
                       help="profile N training steps with torch.profiler, after the first epoch's warm-up steps, "
                            "on the primary process: a Chrome trace and a summary (ms per step, the GPU's idle "
                            "share, operators and kernels by time) in the run directory's profile-*/ folder")
    group.add_argument("--io-interval", type=_io_interval, default=60.0, metavar="SECONDS",
                       help=f"sample the dataset's block device (read/write bytes and operations per second) "
                            f"every SECONDS (at least {MIN_IO_INTERVAL_SECONDS:g}) into io.csv, on one process per "
                            f"node; 0: off")
    group.add_argument("--report-dir", default=None, metavar="DIR",
                       help="with --evaluate: write the per-class report (val_report.csv, confusion_matrix.npy), "
                            "evaluation.csv (every set's figures), predictions.csv (each validation image's guess) "
                            "and each --eval-set's report into DIR; training runs write theirs into the run directory")
    group.add_argument("--eval-set", dest="eval_sets", type=_eval_set, action="append", default=None,
                       metavar="NAME=DIR",
                       help="with --evaluate: also score the labelled set DIR in the ImageFolder layout "
                            "(DIR/<class>/<images>: class folders named as the training classes, or all named by "
                            "class index, as ImageNet-V2's 0..999), as NAME; repeatable (docs/outputs.md)")
    group.add_argument("--real-labels", default=None, metavar="REAL_JSON",
                       help="with --evaluate: also score the validation split's top-1 against ImageNet-ReaL's "
                            "labels (real.json; its files named ILSVRC2012_val_<8 digits>.JPEG): right if the "
                            "prediction is any real label; images without one are left out and counted")
    group.add_argument("--tracker", dest="trackers", action="append", choices=TRACKERS, default=None,
                       help=f"also send the run's parameters (config.json's), per-epoch figures (metrics.csv's "
                            f"columns as <split>_<column>, step: the epoch) and, at the end, its reports to an "
                            f"experiment tracker, beside the run directory; give it twice for both. mlflow: "
                            f"MLFLOW_TRACKING_URI, else a store in the run directory's mlflow/; wandb: W&B's own "
                            f"settings (WANDB_MODE, WANDB_PROJECT, ...). A resume continues the same tracked run; "
                            f"a failing tracker is one warning and training goes on (docs/outputs.md#trackers; "
                            f"pip install -r {TRACKERS_REQUIREMENTS})")


# Sampled faster, io.csv's rows (kept until the epoch ends) would grow by megabytes a second: a value such as
# 1e-9 would take the machine's memory within an epoch.
MIN_IO_INTERVAL_SECONDS = 0.1
# A year; timedelta stops at 10**9 days, and torch's collectives count milliseconds in 64 bits.
MAX_DIST_TIMEOUT_SECONDS = 365 * 24 * 3600
MAX_BUCKET_CAP_MIB = 2 ** 20  # 1 TiB: DDP takes the bucket's bytes as a 64-bit integer (1e300 was a traceback)


def _io_interval(text: str) -> float:
    value = non_negative_float(text)
    if 0 < value < MIN_IO_INTERVAL_SECONDS:
        raise argparse.ArgumentTypeError(f"expected 0 (off) or at least {MIN_IO_INTERVAL_SECONDS:g} seconds, "
                                         f"got {text}")
    return value


def _eval_set(text: str) -> Tuple[str, str]:
    """NAME=DIR: NAME names the set's lines and report files (NAME_report.csv), so it is a plain file name."""
    name, equals, folder = text.partition("=")
    if not equals or not folder:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    if not EVAL_SET_NAME.fullmatch(name) or name == "val":
        raise argparse.ArgumentTypeError(f"NAME {name!r}: letters, digits, '.', '_' and '-', starting with a letter "
                                         f"or digit, and not 'val' (DATA's validation split)")
    return name, folder


# --eval-set's NAME: a file name's start (NAME_report.csv), no path, no option.
EVAL_SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _checkpoint_interval(text: str) -> Tuple[int, float]:
    """'10min' -> (0, 10.0); '500steps' -> (500, 0.0); '0' -> (0, 0.0): (steps, minutes)."""
    value = text.strip().lower()
    try:
        if value == "0":
            return 0, 0.0
        if value.endswith("min") and 0 < float(value[:-3]) < float("inf"):
            return 0, float(value[:-3])
        if value.endswith("steps") and int(value[:-5]) > 0:
            return int(value[:-5]), 0.0
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected minutes like 10min, steps like 500steps, or 0, got {text!r}")


def _signal_name(text: str) -> str:
    """USR1, SIGUSR1 or 10 -> 'SIGUSR1'; one of PREEMPT_SIGNALS."""
    value = text.strip().upper()
    try:
        name = signal.Signals(int(value)).name if value.isdigit() else (
            value if value.startswith("SIG") else f"SIG{value}")
    except ValueError:
        name = value
    if name not in PREEMPT_SIGNALS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of USR1, USR2, TERM (what Slurm's --signal "
                                         f"should send)")
    return name


def _true_false(text: str) -> bool:
    if text not in ("True", "False"):
        raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")
    return text == "True"


def _loss_scale(text: str) -> Union[str, float]:
    if text == "dynamic":
        return text
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected dynamic or a positive number, got {text!r}") from None


def _add_precision_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "mixed precision", "NVIDIA Apex's flags, implemented with native PyTorch AMP (torch.autocast, "
                           "torch.amp.GradScaler): Apex is not needed.")
    group.add_argument("--opt-level", choices=("auto", "O0", "O1", "O2", "O3"), default="auto",
                       help="O0: fp32. O1: autocast, fp32 weights. O2: O1 + channels-last on GPUs. O3: the whole "
                            "model in half precision (may diverge). auto (default): the fastest level whose half type "
                            "is native here: O2 on GPUs, O1 on CPUs with native bf16 (AVX512/AMX), O0 elsewhere")
    group.add_argument("--amp-dtype", choices=("fp16", "bf16"), default=None,
                       help="half type (default: fp16 on CUDA GPUs, bf16 on the CPU); bf16 needs no loss scaling")
    group.add_argument("--keep-batchnorm-fp32", type=_true_false, default=None, metavar="True|False",
                       help="O3: keep BatchNorm in fp32 (default False); O1 and O2 always do")
    group.add_argument("--loss-scale", type=_loss_scale, default=None, metavar="dynamic|SCALE",
                       help="fp16 loss scaling for O1 and O2: dynamic (the default), or a fixed starting scale that "
                            "never grows (halved when a step overflows, which is then skipped); O3 trains unscaled")


def _add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "distributed", "Plain `python SCRIPT DATA` trains on every visible GPU of this machine (one process "
                       "each). On N nodes run, on every node: --dist-url tcp://NODE0:PORT --world-size N "
                       "--rank NODE_RANK. Under torchrun, torch.distributed.launch or srun, the launcher's "
                       "variables say all this and these flags stay unset.")
    group.add_argument("--dist-url", default=None, metavar="URL",
                       help="tcp://HOST:PORT of node 0, where the processes meet (default: a free local port, "
                            "for one node); no user name or password: one is refused, and never printed")
    group.add_argument("--dist-backend", choices=("nccl", "gloo"), default=None,
                       help="process-group backend (default: nccl with GPUs, gloo on the CPU)")
    group.add_argument("--world-size", type=positive_int, default=None, metavar="NODES",
                       help="number of nodes; each starts one process per GPU, so the processes in the job "
                            "are NODES x GPUs per node (default: 1)")
    group.add_argument("--rank", type=non_negative_int, default=None, metavar="NODE_RANK",
                       help="this node's rank, 0 to NODES-1; node 0 hosts the rendezvous at --dist-url")
    group.add_argument("--nproc-per-node", type=positive_int, default=None, metavar="N",
                       help="processes on this node (default: one per visible GPU; 1 on the CPU, where each "
                            "process is a CPU replica with the gloo backend, at most one per core the job may use)")
    group.add_argument("--local-rank", "--local_rank", dest="local_rank", type=non_negative_int, default=None,
                       metavar="N", help="set by torch.distributed.launch; not for direct use")
    group.add_argument("--sync-bn", action="store_true",
                       help="BatchNorm statistics over the global batch instead of each GPU's share "
                            "(SyncBatchNorm; GPUs only)")
    group.add_argument("--dist-timeout", default=300.0, metavar="SECONDS",
                       type=float_in(0.0, MAX_DIST_TIMEOUT_SECONDS, True, False,
                                     f"a positive number of seconds, at most a year ({MAX_DIST_TIMEOUT_SECONDS})"),
                       help="how long a process waits for its peers: at start-up (a node that never comes "
                            "up ends the job with an error after this) and at any collective operation; at most a "
                            "year")
    group.add_argument("--ddp-comm-hook", choices=DDP_COMM_HOOKS, default="none",
                       help="what DDP sends each step: fp32 gradients (none), gradients cast to fp16 or bf16 "
                            "(half the bytes), or PowerSGD's low-rank factors with error feedback (far fewer); "
                            "README: Scaling")
    group.add_argument("--powersgd-rank", type=positive_int, default=None, metavar="R",
                       help="rank of PowerSGD's factors: more is closer to the full gradient, and more bytes "
                            "(default: 1)")
    group.add_argument("--powersgd-start-step", type=positive_int, default=None, metavar="N",
                       help="optimizer steps with plain all-reduces before PowerSGD compresses (default: 1000)")
    group.add_argument("--bucket-cap-mb", default=None, metavar="MiB",
                       type=float_in(0.0, MAX_BUCKET_CAP_MIB, True, False,
                                     f"a positive size in MiB, at most {MAX_BUCKET_CAP_MIB} (1 TiB)"),
                       help="DDP's gradient bucket size, in MiB as DDP counts it: larger buckets, fewer all-reduces "
                            "with less overlap (default: DDP's, 25 with a first bucket of 1; a size given caps every "
                            "bucket; one above the model's gradients makes one bucket)")
    group.add_argument("--static-graph", action="store_true",
                       help="tell DDP the same parameters get gradients every step (lets it skip per-step checks)")
    group.add_argument("--multiprocessing-distributed", action="store_true",
                       help="accepted for pytorch/examples command lines: this script always runs one process "
                            "per GPU")
