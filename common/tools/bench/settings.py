"""The settings one run of the benchmark measures with (Settings): what the
command line resolved, with the device's defaults, read by every section.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

from common import config, provenance
from common.tools.bench.gpu_monitor import GpuMonitor


@dataclasses.dataclass(frozen=True)
class Settings:
    device: str
    arch: str
    batch_size: int
    image_size: int
    warmup_steps: int
    steps: int
    workers: Sequence[int]
    data: Optional[str]
    input_batches: int
    repeats: int = 1  # measurements of each train and end-to-end configuration, each in a fresh process
    input_repeats: int = 1  # the same for the input section
    backends: Sequence[str] = ("torchvision",)  # the end-to-end section's data backends
    measure_emulated: bool = False  # time half-precision configurations this device only emulates (slowly)
    peak_tflops: Optional[float] = None  # the device's peak for MFU, instead of flops.GPU_PEAK_TFLOPS's
    gpu: Optional[GpuMonitor] = None  # samples the GPU's state while each measured process runs
    comm_world_size: int = 2  # processes of the comm and scaling sections
    comm_sizes: Sequence[int] = ()  # all-reduce sizes (bytes) of the comm section
    # The code every row's processes ran (common.provenance.code_version(), asked once per run: it runs git).
    code: Mapping = dataclasses.field(default_factory=provenance.unknown)

    @property
    def synthetic_workers(self) -> int:
        """-j of the scripts' synthetic-data runs: on a GPU the scripts'
        default (data_workers). The loop is launch-bound there, so a batch
        assembled in the training process (-j 0: 256 copies and a stack)
        lengthens every step: on an H200 (2026-11-26, ResNet-50 O2 b256) -j 0
        gave 3,793 images/s (median of 3), one run with the scripts' default
        -j 4 4,213 with the profiler on for 10 of its 16 measured steps. On
        the CPU workers would take the cores the step computes on."""
        return self.data_workers if self.device == "cuda" else 0

    @property
    def data_workers(self) -> int:
        """-j of every row that trains on or reads the JPEGs (end-to-end,
        storage, decode's DALI threads): on a GPU the scripts' default
        (config.DATA_WORKERS, their -j's default), which the synthetic rows
        use too, so real over synthetic compares runs alike and says what a
        run with the default flags gets (issue 41); on the CPU, whose cores
        the step computes on, the largest of --workers (1 2 by default)."""
        return config.DATA_WORKERS if self.device == "cuda" else max(self.workers)
