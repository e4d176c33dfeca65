"""The scaling model's presets (--preset): Validation A, the 2020 V100 runs
on HAL read from results/upstream, and ResNet-50 on H100 nodes with each
knob; with the links and step times they are built from, and their sources.
"""
from __future__ import annotations

import csv
import math
from dataclasses import replace
from pathlib import Path
from typing import List, Tuple

from common.errors import UsageError
from common.tools import plots
from common.tools.scaling.model import (NCCL_RING_NETWORK_LATENCY_US, NCCL_RING_NVLINK_LATENCY_US, Links, Settings,
                                        gbps_to_bytes)

REPO = Path(__file__).resolve().parents[3]  # the repository: the presets read its results/
UPSTREAM = REPO / "results" / "upstream"
UPSTREAM_STORAGE_LOG = UPSTREAM / "IO" / "bandwidth_gpux64_cpu20_feb.csv"
# HAL (NCSA): 16 IBM AC922 nodes (POWER9), 4 V100-SXM2 16 GB each on NVLink 2.0, Mellanox EDR InfiniBand,
# a DDN all-flash array: Kindratenko et al., "HAL: Computer System for Scalable Deep Learning", PEARC 2020,
# https://experts.illinois.edu/en/publications/hal-computer-system-for-scalable-deep-learning
# EDR: 100 Gbit/s a port (one port a node assumed; an AC922 can hold two). AC922's NVLink 2.0 in its 4-GPU
# form: 3 bricks of 25 GB/s (each way) between a socket's two GPUs and its CPU, 75 GB/s (IBM Redpaper
# REDP-5472, "IBM Power System AC922 Introduction and Technical Overview").
HAL_LINKS = Links(4, 75e9, NCCL_RING_NVLINK_LATENCY_US * 1e-6, gbps_to_bytes(100), NCCL_RING_NETWORK_LATENCY_US * 1e-6)
# H100 nodes: 8 GPUs on NVLink 4 / NVSwitch (~450 GB/s all-reduce busbw inside a node, nccl-tests on
# DGX/HGX H100), 8 x 400 Gbit/s InfiniBand NDR a node (DGX H100: one ConnectX-7 per GPU).
H100_LINKS = Links(8, 450e9, NCCL_RING_NVLINK_LATENCY_US * 1e-6, gbps_to_bytes(8 * 400),
                   NCCL_RING_NETWORK_LATENCY_US * 1e-6)
# One H100's ResNet-50 step, 256 images, AMP O2 channels_last, synthetic data: 70 ms, from this project's
# results/bench/gpu_h200_2026-11-26_end-to-end.csv (H200: 66.94 ms; H100 and H200 share the compute,
# the H100 has less memory bandwidth); results/bench/gpu_h100_2026-11-24_2_amp-compile-input.csv
# measured 83.71 ms on an H100 with an older stack.
H100_STEP_MS = 70.0
# That H100 machine's input pipeline alone (torchvision decode, 12 workers): 2907 images/s
# (results/bench/gpu_h100_2026-11-24_2_amp-compile-input.csv, section input): slower than the GPU.
H100_LOADER_12_WORKERS = 2907.26
UPSTREAM_EPOCHS = 90  # the 2020 runs' schedule (results/upstream/README.md)


def upstream_settings() -> Settings:
    """The 2020 runs (results/upstream): ResNet-50, 208 per GPU, Apex O2 (fp16 gradients), Apex
    DistributedDataParallel(delay_allreduce=True): one flat all-reduce after backward, no overlap (read in
    github.com/richardkxu/distributed-pytorch imagenet_ddp_apex.py, every version). The compute time comes
    from the smallest run (2 GPUs): its mean Time/train (data loading included: not logged apart)."""
    runs = [run for run in plots.load([UPSTREAM]).runs if run.epochs["seconds_per_step"].notna().any()]
    smallest = min(runs, key=lambda run: run.replicas)
    return Settings(arch="resnet50", batch_size=208, step_ms=1000.0 * float(smallest.epochs["seconds_per_step"].mean()),
                    measured_gpus=smallest.replicas, measured_hook="fp16", gpus=(2, 4, 8, 16, 32, 64),
                    baseline_gpus=smallest.replicas, bucket_cap_mb=math.inf, overlap=False, links=HAL_LINKS,
                    scenario="HAL as published (EDR 100 Gbit/s, NVLink 2.0), no overlap")


def _storage_peak_gbps() -> float:
    """The highest read rate of the shared file system in the 64-GPU run's storage log, Gbit/s."""
    with open(UPSTREAM_STORAGE_LOG, newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter=";"))
    return max(float(row["Read"]) for row in rows) * 8 / 1e9


def preset(name: str) -> Tuple[List[Settings], List[Path]]:
    """(scenarios, measured log folders) of a preset."""
    if name == "upstream-v100-hal":
        base = upstream_settings()
        storage = _storage_peak_gbps()
        ceiling = replace(base, storage_gbps=storage)
        return [base,
                replace(ceiling, scenario=f"+ storage ceiling {storage / 8:.2f} GB/s (peak read in the 64-GPU run's "
                                          f"own storage log: explains, does not predict)"),
                # Issue 39: the same storage behind shards and a node-local cache (predicted, not measured).
                replace(ceiling, data_layout="shards+cache", epochs=UPSTREAM_EPOCHS,
                        scenario=f"the same storage, shards + node-local cache: epoch 1 every node copies the "
                                 f"dataset from it, {UPSTREAM_EPOCHS - 1} epochs local (predicted)"),
                replace(ceiling, data_layout="warm-cache",
                        scenario="the same storage, a warm node-local cache (a requeued job: every epoch local; "
                                 "predicted)")], [UPSTREAM]
    if name == "h100-8x8":
        base = Settings(arch="resnet50", batch_size=256, step_ms=H100_STEP_MS, links=H100_LINKS,
                        scenario="DDP defaults (bucket 25 MiB)")
        return [base,
                replace(base, bucket_cap_mb=100, scenario="bucket_cap_mb=100"),
                replace(base, accumulation_steps=2, scenario="accumulation 2 steps"),
                replace(base, accumulation_steps=4, scenario="accumulation 4 steps"),
                replace(base, loader_images_per_second=H100_LOADER_12_WORKERS,
                        scenario="real data, 12 loader workers/GPU (2907 images/s measured)"),
                replace(base, loader_images_per_second=H100_LOADER_12_WORKERS * 16 / 12,
                        scenario="real data, 16 loader workers/GPU (scaled from 12)")], [REPO / "results" / "runs"]
    raise UsageError(f"argument --preset: unknown preset {name!r} (choose from upstream-v100-hal, h100-8x8)")


PRESETS = ("upstream-v100-hal", "h100-8x8")
