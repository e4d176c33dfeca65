"""The GPU's state beside each row: its SM clock, power draw, temperature,
load and clock event (throttle) reasons, read from nvidia-smi in a background
thread while a measured process runs (GpuMonitor), and summarised over a
row's repeats (gpu_state). Where nvidia-smi does not answer, nothing is
sampled and nothing fails.
"""
from __future__ import annotations

import contextlib
import functools
import os
import statistics
import subprocess
import threading
from typing import List, NamedTuple, Optional, Sequence, Tuple

from common.errors import error_summary

# What is asked of nvidia-smi, in its --query-gpu names (nvidia-smi --help-query-gpu), then the
# clock event reasons: `clocks_event_reasons.active` since driver 535, `clocks_throttle_reasons.active`
# before (the first that the driver knows is used).
GPU_STATE_QUERY = ("clocks.sm", "power.draw", "temperature.gpu", "utilization.gpu")
CLOCK_REASON_QUERIES = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
# The bits of that mask (NVML's nvmlClocksEventReason* constants), named as nvidia-smi's per-reason
# fields are (clocks_event_reasons.sw_power_cap, ...).
CLOCK_EVENT_REASONS = ((0x1, "gpu_idle"), (0x2, "applications_clocks_setting"), (0x4, "sw_power_cap"),
                       (0x8, "hw_slowdown"), (0x10, "sync_boost"), (0x20, "sw_thermal_slowdown"),
                       (0x40, "hw_thermal_slowdown"), (0x80, "hw_power_brake_slowdown"),
                       (0x100, "display_clock_setting"))
GPU_IDLE = 0x1


class GpuSample(NamedTuple):
    """One nvidia-smi reading; None where it said [N/A] or [Not Supported]."""
    sm_clock_mhz: Optional[float]
    power_w: Optional[float]
    temperature_c: Optional[float]
    utilization_percent: Optional[float]
    reasons: Optional[int]  # CLOCK_EVENT_REASONS bits

    @property
    def busy(self) -> bool:
        """Whether a kernel ran in the sample's period: the clocks of an idle
        GPU (a process starting, loading data) are not what the work ran at."""
        if self.utilization_percent is not None:
            return self.utilization_percent > 0
        return self.reasons is None or not self.reasons & GPU_IDLE


def parse_gpu_sample(line: str) -> Optional[GpuSample]:
    """A GpuSample from one line of `--format=csv,noheader,nounits`; None if it is not one."""
    values = [value.strip() for value in line.split(",")]
    if len(values) != len(GPU_STATE_QUERY) + 1:
        return None

    def number(text: str, base: int = 0) -> Optional[float]:
        try:
            return int(text, 16) if base == 16 else float(text)
        except ValueError:
            return None

    return GpuSample(*(number(value) for value in values[:-1]), number(values[-1], 16))


class GpuMonitor:
    """The GPU's SM clock, power draw, temperature, load and clock event
    reasons as nvidia-smi reports them, read every `interval` seconds in a
    background thread while a measured process runs (sampling()). Made with
    the GPUs to try (nvidia-smi's -i: an index or a UUID), it asks each once
    and keeps the first that answers; where none does (no nvidia-smi, no
    driver) `gpu` is None, `problem` says why, and nothing is sampled."""

    def __init__(self, candidates: Sequence[str], interval: float = 0.5):
        self.interval = interval
        self.gpu: Optional[str] = None
        self.query = ""
        self.problem = "no GPU named"
        for gpu in candidates:
            for reasons in CLOCK_REASON_QUERIES:
                query = ",".join((*GPU_STATE_QUERY, reasons))
                sample, problem = self._read(gpu, query)
                if sample is not None:
                    self.gpu, self.query, self.problem = gpu, query, ""
                    return
                self.problem = problem

    @staticmethod
    def _read(gpu: str, query: str) -> Tuple[Optional[GpuSample], str]:
        try:
            done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", gpu],
                                  capture_output=True, text=True, timeout=10)
        except FileNotFoundError:
            return None, "nvidia-smi not found"
        except (OSError, subprocess.TimeoutExpired) as error:
            return None, f"nvidia-smi: {error_summary(error)}"
        sample = parse_gpu_sample(done.stdout.strip().splitlines()[0]) if done.stdout.strip() else None
        if done.returncode != 0 or sample is None:
            return None, f"nvidia-smi -i {gpu} (exit {done.returncode}): " + error_summary(
                RuntimeError(done.stdout + done.stderr))
        return sample, ""

    @contextlib.contextmanager
    def sampling(self):
        """The list the samples go into until the block ends; None when there is no GPU to sample."""
        if self.gpu is None:
            yield None
            return
        samples: List[GpuSample] = []
        stop = threading.Event()

        def read_until_stopped():
            while True:
                sample, _ = self._read(self.gpu, self.query)
                if sample is not None:
                    samples.append(sample)
                if stop.wait(self.interval):
                    return

        thread = threading.Thread(target=read_until_stopped, name="nvidia-smi", daemon=True)
        thread.start()
        try:
            yield samples
        finally:
            stop.set()
            thread.join()


def gpu_state(samples: Optional[Sequence[GpuSample]]) -> dict:
    """A row's GPU fields from the samples of its repeats, the busy ones only
    (GpuSample.busy): median SM clock and power, highest temperature, every
    clock event reason seen but gpu_idle ('none' if none), and how many samples
    that is. {} when the GPU was not sampled (the CPU; no nvidia-smi)."""
    if samples is None:
        return {}
    busy = [sample for sample in samples if sample.busy]

    def known(name):
        return [getattr(sample, name) for sample in busy if getattr(sample, name) is not None]

    state = {"gpu_samples": len(busy)}
    if known("sm_clock_mhz"):
        state["sm_clock_mhz"] = round(statistics.median(known("sm_clock_mhz")))
    if known("power_w"):
        state["power_w"] = round(statistics.median(known("power_w")), 1)
    if known("temperature_c"):
        state["temperature_c"] = round(max(known("temperature_c")))
    if known("reasons"):
        seen = functools.reduce(int.__or__, known("reasons"), 0)
        state["throttle_reasons"] = " ".join(name for bit, name in CLOCK_EVENT_REASONS
                                             if seen & bit and bit != GPU_IDLE) or "none"
    return state


def gpus_to_sample(device: str, asked: Optional[str]) -> List[str]:
    """nvidia-smi's names (-i) for the GPU the runs use, most exact first: its
    UUID as torch reports it, CUDA_VISIBLE_DEVICES's first entry, index 0.
    [asked] when --gpu-index names one; [] on the CPU."""
    if asked is not None:
        return [asked]
    if device != "cuda":
        return []
    import torch

    candidates = []
    uuid = getattr(torch.cuda.get_device_properties(0), "uuid", None)
    if uuid is not None:
        candidates.append(f"GPU-{uuid}" if not str(uuid).startswith(("GPU-", "MIG-")) else str(uuid))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return [*candidates, *([visible] if visible else []), "0"]
