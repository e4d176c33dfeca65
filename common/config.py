"""Config: every resolved option of one run, frozen.

cli.parse builds it from argv; everything after reads it and never edits it
(session.Plan makes one copy with `--opt-level auto` resolved, once the device
and so the precision policy are known).
Its fields keep the flags' names (the argparse destinations), and
`to_dict()` is what config.json's "options" and each checkpoint's "config"
hold: the run directory's format, which common.tools reads back.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence, Tuple, Union

# The parallelism modes, one per entry script (imagenet_<mode>.py).
MODES = ("nd", "dp", "ddp", "ddp_apex")

# The signals a preemption warning can use: those that every process of the job (data-loading
# workers included) is prepared to receive without dying (see common.process_signals).
PREEMPT_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM")

# --data-backend's choices: who decodes and transforms images (common.pipelines, common.dali).
DATA_BACKENDS = ("torchvision", "pil", "gpu", "dali")
DATA_WORKERS = 4  # -j's default (common.flags); the benchmark's GPU rows run with it too (tools/bench/settings.py)

# --data-timeout's default: seconds a step or validation waits for its batch. A cold network file system
# takes seconds, a busy one a minute or two, for a batch of files; ten minutes is a worker or a file
# system that stopped answering.
DATA_TIMEOUT_SECONDS = 600.0
MAX_DATA_TIMEOUT_SECONDS = 7 * 24 * 3600.0  # a week; more would overflow the clocks a wait is timed by (0: for ever)

# A sharded dataset (common.shards, written by python -m common.tools.pack_shards): a folder holding this file,
# or an object store's prefix. Here, torch-free, so the command line tells DATA's kinds apart before torch loads.
MANIFEST_NAME = "manifest.json"
OBJECT_STORE_SCHEMES = ("s3://",)


def is_sharded(data: str) -> bool:
    """Whether DATA is a sharded dataset: s3://bucket/prefix, or a folder holding MANIFEST_NAME."""
    return data.startswith(OBJECT_STORE_SCHEMES) or os.path.isfile(os.path.join(data, MANIFEST_NAME))


# --ddp-comm-hook's choices: what DDP sends each step (common.comm installs them, common.tools.scaling models them).
DDP_COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
# --cuda-graphs: the training step captured in a CUDA graph (common.cuda_graphs). auto stays eager until a GPU
# check (run_scripts/gpu_check.sh) has measured graphs faster and exact.
CUDA_GRAPHS = ("auto", "on", "off")

# --tracker's choices: experiment trackers that also get a run's parameters, per-epoch figures and reports,
# beside its run directory (common.trackers). Optional: each is imported only when chosen.
TRACKERS = ("mlflow", "wandb")
TRACKERS_REQUIREMENTS = "requirements-trackers.txt"

# --auto-augment's choices, torchvision's references' names: TrivialAugmentWide, RandAugment, AugMix and
# AutoAugment's ImageNet policy (torchvision.transforms.v2; common.augment makes them).
AUTO_AUGMENT_POLICIES = ("ta_wide", "ra", "augmix", "imagenet")
# --lr-schedule's choices (common.schedules), and the spellings of torchvision's references' --lr-scheduler
# that name one of them (they lower-case theirs too).
LR_SCHEDULES = ("step", "cosine", "linear")
LR_SCHEDULE_ALIASES = {"steplr": "step", "cosineannealinglr": "cosine"}
# --lr-warmup-method's choices: torchvision's LinearLR and ConstantLR, per step here.
WARMUP_METHODS = ("linear", "constant")
CONSTANT_WARMUP_DECAY = 0.01  # --lr-warmup-decay's default for the constant method: torchvision's


# The options that make up the training recipe (not where the data or logs are, nor how processes meet): a
# resume names those that differ from the checkpoint's run (common.checkpoint).
RECIPE_OPTIONS = ("epochs", "batch_size", "lr", "momentum", "weight_decay", "label_smoothing", "lr_schedule",
                  "lr_steps", "warmup_epochs", "image_size", "val_resize", "crop_scale", "hflip", "dropout",
                  "steps_per_epoch", "opt_level", "amp_dtype", "memory_format", "sync_bn", "data_backend",
                  "accum_steps", "ddp_comm_hook", "powersgd_rank", "powersgd_start_step", "auto_augment",
                  "ra_magnitude", "augmix_severity", "random_erase", "mixup_alpha", "cutmix_alpha", "recipe",
                  "val_crop_size", "progressive_resizing", "progressive_step", "val_flip", "ra_sampler", "ra_reps",
                  "norm_weight_decay", "bias_weight_decay", "nesterov", "clip_grad_norm", "warmup_method",
                  "warmup_decay", "lr_min", "blurpool", "model_ema", "model_ema_steps", "model_ema_decay",
                  "drop_path")


@dataclasses.dataclass(frozen=True)
class Config:
    """Every resolved option of one run. Frozen: code reads it, never edits it."""

    mode: str
    data: Optional[str]
    arch: str
    pretrained: bool
    memory_format: str  # auto | channels_last | contiguous (see common.models.uses_channels_last)
    workers: int
    image_size: int
    val_resize: int
    crop_scale: Tuple[float, float]  # area fraction range of the random training crop
    hflip: float  # probability of a horizontal flip in training
    synthetic: bool
    epochs: int
    start_epoch: int
    batch_size: int  # per process (per device) and micro-batch; the global batch is batch_size x accum_steps x replicas
    lr: float  # for a global batch of 256; scaled linearly to the real global batch
    momentum: float
    weight_decay: float
    label_smoothing: float
    lr_schedule: str
    lr_steps: Tuple[int, ...]
    warmup_epochs: float
    print_freq: int
    resume: Optional[str]
    evaluate: bool
    seed: int
    desired_acc: Optional[float]  # percent, 0 < x <= 100
    logdir: str
    run_name: Optional[str]
    steps_per_epoch: int
    device: str
    io_interval: float = 60.0  # seconds between block-device I/O samples; 0: no sampling
    warmup_steps: int = 10  # first steps of each epoch left out of throughput and data-wait figures
    profile_steps: int = 0  # training steps after the first epoch's warm-up profiled with torch.profiler; 0: none
    report_dir: Optional[str] = None  # --evaluate: where the per-class report goes
    checkpoint_every_steps: int = 0  # mid-epoch checkpoints every N steps; 0: not by steps
    checkpoint_every_minutes: float = 10.0  # ... or every N minutes; 0: not by time
    keep_checkpoints: int = 3
    preempt_signal: str = "SIGUSR1"
    requeue: str = "auto"  # auto | always | never
    opt_level: str = "O0"  # only imagenet_ddp_apex.py changes it; O0 is plain fp32; auto: session.Plan resolves it
    amp_dtype: Optional[str] = None  # fp16 | bf16; None: fp16 on CUDA, bf16 on the CPU
    keep_batchnorm_fp32: Optional[bool] = None  # None: Apex's default for the opt level
    loss_scale: Union[str, float, None] = None  # "dynamic" or a fixed scale; None: Apex's default
    dropout: Optional[float] = None  # None: the architecture's own default
    bad_images: str = "fail"  # fail | skip: what an unreadable image file does
    file_list: Optional[str] = None  # "split/relative/path label" lines naming DATA's images; None: scan (cached)
    data_cache: Optional[str] = None  # a sharded DATA's node-local cache folder (--data-cache); None: read the source
    data_cache_bytes: int = 0  # the cache's cap; 0: what its disk has free, less a margin
    s3_endpoint_url: Optional[str] = None  # an s3:// DATA's endpoint; None: the AWS environment's or profile's
    deterministic: bool = False  # deterministic algorithms (cuDNN, cuBLAS, ...), at a speed cost on GPUs
    max_nonfinite_steps: int = 0  # steps with a NaN/inf loss skipped before the run stops; 0: stop at the first
    data_backend: str = "torchvision"  # torchvision | pil | gpu | dali: who decodes and transforms images (common.pipelines)
    compile: bool = False  # torch.compile the model
    cuda_graphs: str = "auto"  # CUDA_GRAPHS: the training step replayed from a CUDA graph (on), eager (off, auto)
    accum_steps: int = 1  # micro-batches of batch_size per optimizer step (gradient accumulation)
    data_timeout: float = DATA_TIMEOUT_SECONDS  # seconds a batch may take to come; 0: wait for ever
    # imagenet_ddp.py and imagenet_ddp_apex.py only (the other scripts keep these defaults):
    dist_url: Optional[str] = None  # tcp://HOST:PORT of node 0; None: a free local port (one node)
    dist_backend: Optional[str] = None  # None: nccl with GPUs, gloo on the CPU
    world_size: Optional[int] = None  # nodes (pytorch/examples' meaning); None: one
    rank: Optional[int] = None  # this node's rank among them
    nproc_per_node: Optional[int] = None  # None: one per visible GPU, one on the CPU
    local_rank: Optional[int] = None  # set by torch.distributed.launch
    sync_bn: bool = False
    dist_timeout: float = 300.0  # seconds
    ddp_comm_hook: str = "none"  # none | fp16 | bf16 | powersgd: what DDP sends (common.comm)
    powersgd_rank: Optional[int] = None  # None: common.comm.POWERSGD_RANK
    powersgd_start_step: Optional[int] = None  # None: common.comm.POWERSGD_START_STEP
    # DDP's gradient bucket size in MB; None: DDP's default (25 MB, and a first bucket of 1 MiB)
    bucket_cap_mb: Optional[float] = None
    static_graph: bool = False  # DDP's static_graph: the same parameters train every step
    # --recipe NAME: a published recipe (common/recipes/NAME.toml) whose flags were set before the command line's
    recipe: Optional[str] = None
    recipe_overridden: Tuple[str, ...] = ()  # the recipe's flags (its keys) that the command line gave again
    # Augmentation and mixing (common.augment; docs/recipes.md):
    auto_augment: Optional[str] = None  # one of AUTO_AUGMENT_POLICIES, after the training crop and flip; None: none
    ra_magnitude: int = 9  # --auto-augment ra: RandAugment's magnitude, a bin of 0..30
    augmix_severity: int = 3  # --auto-augment augmix: AugMix's severity, 1..10
    random_erase: float = 0.0  # probability of erasing a random box of a training image; 0: never
    mixup_alpha: float = 0.0  # Beta(alpha, alpha) of MixUp's share of each batch's pairs; 0: no MixUp
    cutmix_alpha: float = 0.0  # Beta(alpha, alpha) of CutMix's share; 0: no CutMix (with both: one per batch)
    # Resolution and sampling (docs/recipes.md): FixRes's three sizes, FFCV's progressive resizing and
    # test-time flip, DeiT's repeated augmentation.
    val_crop_size: Optional[int] = None  # pixels: side of the validation centre crop; None: image_size
    # (MIN_PX, MAX_PX, START_EPOCH, END_EPOCH): the training crop grows from MIN to MAX over those epochs
    # (progressive_crop_size); None: image_size every epoch
    progressive_resizing: Optional[Tuple[int, int, int, int]] = None
    progressive_step: int = 32  # pixels: progressive resizing's sizes are multiples of this (FFCV's 32)
    val_flip: bool = False  # validation logits averaged over each image and its mirror image
    ra_sampler: bool = False  # repeated augmentation: each drawn training image ra_reps times an epoch
    ra_reps: int = 3  # copies of each drawn image with --ra-sampler, each augmented on its own
    # The optimiser and the schedule's recipe options (docs/recipes.md, "Optimiser and schedules"):
    norm_weight_decay: Optional[float] = None  # weight decay of normalisation layers' weights and biases; None: --wd
    bias_weight_decay: Optional[float] = None  # weight decay of the other biases; None: --wd
    nesterov: bool = False  # SGD's Nesterov momentum
    clip_grad_norm: Optional[float] = None  # the largest L2 norm of all gradients together, per step; None: no clip
    warmup_method: str = "linear"  # linear | constant: the rate during --warmup-epochs (WARMUP_METHODS)
    warmup_decay: Optional[float] = None  # the warm-up's starting factor of the rate; None: see common.schedules
    lr_min: float = 0.0  # the schedule's floor, for a global batch of 256 (scaled linearly, as --lr)
    blurpool: bool = False  # a fixed blur before every strided convolution of >= 16 input channels (FFCV's BlurPool)
    # --model-ema (common.ema): an exponential moving average of the weights and buffers, validated beside them
    model_ema: bool = False
    model_ema_steps: int = 32  # optimizer steps between updates of the average, counted over the run
    model_ema_decay: float = 0.99998  # per update, before torchvision's adjustment for batch, steps and epochs
    trackers: Tuple[str, ...] = ()  # --tracker: experiment trackers (TRACKERS) beside the run directory, in order
    # Stochastic depth: the probability of skipping a residual block in training (timm's drop_path_rate,
    # torchvision's stochastic_depth_prob); None: the architecture's own default
    drop_path: Optional[float] = None
    pretrained_file: Optional[str] = None  # a timm model's starting weights, read from this local file
    # --evaluate on more labelled sets and labels (common.evaluation; docs/outputs.md):
    eval_sets: Tuple[Tuple[str, str], ...] = ()  # --eval-set NAME=DIR, each (NAME, DIR), in the command line's order
    real_labels: Optional[str] = None  # ImageNet-ReaL's real.json, scored on the validation split; None: not scored

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def crop_sizes(self) -> "CropSizes":
        """The training crop of each epoch and the validation crop, resolved."""
        return CropSizes(self.image_size, self.val_crop_size or self.image_size, self.progressive_resizing,
                         self.progressive_step)


def cuda_graph_blockers(cfg: Config) -> Tuple[str, ...]:
    """What in the run's options keeps --cuda-graphs on's training step eager, each with why; none: it is
    captured (on a GPU, without DataParallel). Decided here once: common.cuda_graphs.choose says them, and
    common.comm makes DDP on a side stream only when the step will be captured, since a DDP made there
    whose steps run eagerly on the default stream has every gradient of every step cross streams."""
    return tuple(reason for applies, reason in (
        (cfg.accum_steps > 1, f"--accum-steps {cfg.accum_steps} (micro-batches, the first under DDP's no_sync)"),
        (bool(cfg.mixup_alpha or cfg.cutmix_alpha), "MixUp/CutMix (drawn on the host each step)"),
        (cfg.model_ema, "--model-ema (its update asks the host whether the step was skipped)"),
        (cfg.max_nonfinite_steps > 0, f"--max-nonfinite-steps {cfg.max_nonfinite_steps} (the host reads each "
                                      f"loss before the update)"),
        (cfg.compile, "--compile (torch.compile makes graphs of its own)"),
        (cfg.ddp_comm_hook != "none", f"--ddp-comm-hook {cfg.ddp_comm_hook} (the hook keeps state on the host)"),
        (cfg.sync_bn, "--sync-bn (not captured yet)"),
    ) if applies)


def report_files(eval_set_names: Sequence[str]) -> Tuple[str, ...]:
    """The files --evaluate writes into --report-dir, none of which may exist
    before (nothing is overwritten): DATA's validation split's per-class report,
    evaluation.csv (a row per set and weights), predictions.csv (the validation
    split's per image) and each --eval-set NAME's per-class report."""
    per_set = [f"{name}_{kind}" for name in eval_set_names for kind in ("report.csv", "confusion_matrix.npy")]
    return ("val_report.csv", "confusion_matrix.npy", "evaluation.csv", "predictions.csv", *per_set)


def progressive_crop_size(epoch: int, min_px: int, max_px: int, start_epoch: int, end_epoch: int,
                          step_px: int) -> int:
    """FFCV's progressive resizing (ffcv-imagenet's train_imagenet.py,
    get_resolution): MIN_PX up to START_EPOCH, MAX_PX from END_EPOCH on, and
    in between the linear interpolation rounded to the nearest multiple of
    step_px (halves to even, as NumPy's round, which FFCV uses, does), kept
    within [MIN_PX, MAX_PX] where MIN or MAX is not such a multiple. A pure
    function of the epoch: a resumed run trains at the sizes an uninterrupted
    one does."""
    if epoch <= start_epoch:
        return min_px
    if epoch >= end_epoch:
        return max_px
    interpolated = min_px + (max_px - min_px) * (epoch - start_epoch) / (end_epoch - start_epoch)
    return min(max_px, max(min_px, round(interpolated / step_px) * step_px))


@dataclasses.dataclass(frozen=True)
class CropSizes:
    """The sides, in pixels, of the square training crop of each epoch and
    of the validation centre crop (Config.crop_sizes): --image-size, or
    --progressive-resizing's size of the epoch, and --val-crop-size."""

    image_size: int  # --image-size: the training crop without progressive resizing
    val: int  # the validation centre crop
    progressive: Optional[Tuple[int, int, int, int]] = None  # --progressive-resizing MIN MAX START END
    step: int = 32  # --progressive-step

    def train(self, epoch: int) -> int:
        """The training crop of epoch `epoch`."""
        if self.progressive is None:
            return self.image_size
        return progressive_crop_size(epoch, *self.progressive, self.step)

    @property
    def train_range(self) -> Tuple[int, int]:
        """The smallest and the largest training crop of any epoch."""
        return (self.progressive[0], self.progressive[1]) if self.progressive else (self.image_size,) * 2

    def model_inputs(self) -> Tuple[Tuple[str, int], ...]:
        """(flag, side) of each input size the model must take besides
        --image-size: the smallest and largest training crops and the
        validation crop (a convolutional network that takes both ends of
        a range takes the sizes between)."""
        sizes = [("--progressive-resizing", side) for side in self.train_range] if self.progressive else []
        flags = {}  # side -> the first flag that asks for it
        for flag, side in sizes + [("--val-crop-size", self.val)]:
            if side != self.image_size:
                flags.setdefault(side, flag)
        return tuple((flag, side) for side, flag in flags.items())
