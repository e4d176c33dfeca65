"""A benchmark row and its files: the fields every JSON line and CSV row has
(FIELDS), in order; their rounding; the JSON line each configuration prints;
the CSV the harness writes as it goes, and reads back for RESULTS.md
(common.tools.results). Light on purpose: nothing here runs a measurement.
"""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import List, Optional

from common.provenance import PROVENANCE_FIELDS

# The fields of every JSON line and CSV row, in order (tests check them). images_per_second and
# ms_per_step are the medians of the row's `repeats`; spread_percent is (max - min) / median of its
# images/s. The GPU's state (sm_clock_mhz ... gpu_samples) is over the samples of all its repeats.
FIELDS = ("section", "config", "command", "arch", "batch_size", "image_size", "precision", "memory_format",
          "compile", "data_backend", "workers", "images_per_second", "images_per_second_per_worker", "ms_per_step",
          "repeats", "images_per_second_min", "images_per_second_max", "spread_percent", "gflop_per_image",
          "peak_tflops", "mfu_percent", "peak_memory_mib", "measured_steps", "warmup_steps", "sm_clock_mhz",
          "power_w", "temperature_c", "throttle_reasons", "gpu_samples", "device_name", "cpu_threads", "torch",
          "torchvision", "cuda", "host", "date", "capability", "bf16_native", "fp16_native",
          *PROVENANCE_FIELDS,  # the code that ran: git_commit, git_dirty, git_diff_sha256 (common.provenance)
          "note",
          "seconds", "list_mib", "worker_copied_mib",  # the data-scale section's (data_scale)
          # the comm and scaling sections' (comm_bench): all-reduce times and bandwidths (nccl-tests' algbw,
          # busbw), and a DDP step split into compute, exposed communication and data wait
          "world_size", "backend", "hook", "size_bytes", "time_us", "algbw_gbytes_per_s", "busbw_gbytes_per_s",
          "compute_ms", "exposed_comm_ms", "data_wait_ms",
          # the storage section's (storage_section): the storage profile, and per read-stage row its image bytes
          # read per second, files opened per second, and the megabytes that came from the source and the cache
          "storage", "mb_per_second", "opens_per_second", "source_mb", "cache_mb")

# Decimal places a row keeps of each measured figure (rounded()).
ROUNDED = {"images_per_second": 2, "images_per_second_per_worker": 2, "ms_per_step": 2, "peak_memory_mib": 2,
           "images_per_second_min": 2, "images_per_second_max": 2, "spread_percent": 2, "gflop_per_image": 3,
           "mfu_percent": 2, "seconds": 2, "list_mib": 2, "worker_copied_mib": 3,
           "time_us": 1, "algbw_gbytes_per_s": 4, "busbw_gbytes_per_s": 4, "compute_ms": 2, "exposed_comm_ms": 2,
           "data_wait_ms": 2, "mb_per_second": 2, "opens_per_second": 1, "source_mb": 2, "cache_mb": 2}


def record(**values) -> dict:
    """One row: every field of FIELDS, in order (missing ones empty)."""
    unknown = set(values) - set(FIELDS)
    if unknown:
        raise ValueError(f"not bench fields: {sorted(unknown)}")
    return {field: values.get(field, "") for field in FIELDS}


def rounded(row: dict) -> dict:
    """`row` with its float figures rounded to ROUNDED's places."""
    return {key: round(value, ROUNDED[key]) if key in ROUNDED and isinstance(value, float) else value
            for key, value in row.items()}


def emit(row: dict) -> dict:
    """Print `row` as its JSON line; return it."""
    print(json.dumps(row), flush=True)
    return row


def write_csv(rows: List[dict], path: Path) -> None:
    """All of `rows` to `path`, replacing it whole (a temporary file renamed: never half written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(temporary, path)


def read_csv(path: str) -> List[dict]:
    """The rows of a bench CSV: numbers as numbers, empty cells as '' (not NaN),
    hashes as text (one of digits only, or digits around an e, would read as a
    number). The columns are the file's own: CSVs written before a field existed lack it."""
    import pandas

    hashes = {"git_commit": str, "git_diff_sha256": str}
    return pandas.read_csv(path, keep_default_na=False, dtype=hashes).to_dict("records")


def as_number(value) -> Optional[float]:
    """A CSV or JSON cell as a number; None for an empty one."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def repeats_of(row: dict) -> int:
    """How many measurements a row's figures are the median of (CSVs before issue 19: one)."""
    return int(as_number(row.get("repeats")) or 1)


def size_name(size_bytes: int) -> str:
    """A message size as the comm section's rows name it: '4 KiB', '64 MiB', '100 B'."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size_bytes >= factor and size_bytes % factor == 0:
            return f"{size_bytes // factor} {unit}"
    return f"{size_bytes} B"
