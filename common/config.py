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
from typing import Optional, Tuple, Union

# The parallelism modes, one per entry script (imagenet_<mode>.py).
MODES = ("nd", "dp", "ddp", "ddp_apex")

# The signals a preemption warning can use: those that every process of the job (data-loading
# workers included) is prepared to receive without dying (see common.process_signals).
PREEMPT_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM")

# --data-backend's choices: who decodes and transforms images (common.pipelines, common.dali).
DATA_BACKENDS = ("torchvision", "pil", "gpu", "dali")

# --data-timeout's default: seconds a step or validation waits for its batch. A cold network file system
# takes seconds, a busy one a minute or two, for a batch of files; ten minutes is a worker or a file
# system that stopped answering.
DATA_TIMEOUT_SECONDS = 600.0
MAX_DATA_TIMEOUT_SECONDS = 7 * 24 * 3600.0  # a week; more would overflow the clocks a wait is timed by (0: for ever)

# --ddp-comm-hook's choices: what DDP sends each step (common.comm installs them, common.tools.scaling models them).
DDP_COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


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
    deterministic: bool = False  # deterministic algorithms (cuDNN, cuBLAS, ...), at a speed cost on GPUs
    max_nonfinite_steps: int = 0  # steps with a NaN/inf loss skipped before the run stops; 0: stop at the first
    data_backend: str = "torchvision"  # torchvision | pil | gpu | dali: who decodes and transforms images (common.pipelines)
    compile: bool = False  # torch.compile the model
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
    # --model-ema (common.ema): an exponential moving average of the weights and buffers, validated beside them
    model_ema: bool = False
    model_ema_steps: int = 32  # optimizer steps between updates of the average, counted over the run
    model_ema_decay: float = 0.99998  # per update, before torchvision's adjustment for batch, steps and epochs

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
