"""argparse pieces shared by the entry scripts' parser (common.cli) and the
tools (common.tools): value types whose messages argparse prefixes with the
flag's name, and a parser whose mistakes are UsageErrors (one line, exit
status 2), and this machine's cores and memory, which bound the counts and
sizes a flag may ask for. Bottom layer: imports nothing of common/ but
errors and files.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import resource
from typing import Callable, Optional, Sequence

from common.errors import UsageError
from common.files import format_bytes


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose every parse error is a UsageError: one line
    and exit status 2 under errors.run_main (argparse would print usage)."""

    def error(self, message: str):  # argparse calls this for every parse error
        raise UsageError(f"{message} (see --help)")

    def _get_values(self, action, arg_strings):
        # `--epochs=--`: argparse (3.11) drops the "--" as the end-of-options marker and hands the flag an
        # empty list instead of a value, which no check downstream expects. Found by tests/unit/test_cli_fuzz.py.
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            self.error(f"argument {'/'.join(action.option_strings)}: expected one argument, got '--'")
        return super()._get_values(action, arg_strings)


def did_you_mean(name: str, known: Sequence[str]) -> str:
    """'; did you mean resnet50?' for the closest of `known` to a mistyped
    `name` (an architecture, a recipe, a recipe file's key), '' when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean {close[0]}?" if close else ""


def int_at_least(minimum: int, what: str, maximum: Optional[int] = None) -> Callable[[str], int]:
    def parse_int(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse_int


positive_int = int_at_least(1, "a positive integer")
non_negative_int = int_at_least(0, "an integer >= 0")
# NumPy's global seed (seeded with the others) takes 32 bits.
seed_int = int_at_least(0, "an integer from 0 to 2**32 - 1 (4294967295)", maximum=2**32 - 1)


def float_in(low: float, high: float, low_open: bool, high_open: bool, what: str) -> Callable[[str], float]:
    def parse_float(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        too_high = value >= high if high_open else value > high
        if value != value or too_low or too_high:  # value != value: NaN
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    return parse_float


positive_float = float_in(0.0, float("inf"), True, True, "a positive number")
non_negative_float = float_in(0.0, float("inf"), False, True, "a number >= 0")
unit_interval = float_in(0.0, 1.0, False, True, "a number in [0, 1)")


def percent(text: str) -> float:
    """--desired-acc: 0.75 and 75 both mean 75% (values <= 1 are fractions)."""
    value = float_in(0.0, 100.0, True, False, "an accuracy in (0, 1] or (1, 100]")(text)
    return value * 100.0 if value <= 1.0 else value


# --- what this machine can hold: the bounds of counts and sizes a flag asks for ---

_SIZE_UNITS = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12,
               "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]I?)?B?", re.IGNORECASE)


def byte_size(text: str) -> int:
    """'500G', '200M', '256MiB', '1.5T' or plain bytes -> bytes: K, M, G, T
    decimal (as format_bytes and df -H count), KiB, MiB, GiB, TiB binary."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size such as 200M, 500G or 256MiB, got {text!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").upper()])


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity (what taskset, a
    Slurm allocation or a container's cpuset gives it), not every core of
    the machine that os.cpu_count() counts."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


def memory_bytes() -> int:
    """The memory this process's job may use: the machine's physical memory,
    or less where a cgroup (a Slurm job, a container) or an address-space
    limit (ulimit -v) caps it."""
    limits = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    try:
        with open("/proc/self/cgroup") as handle:  # cgroup v2: "0::/the/group"
            group = next((line.strip()[3:] for line in handle if line.startswith("0::")), None)
        if group is not None:
            with open(f"/sys/fs/cgroup{group}/memory.max") as handle:
                text = handle.read().strip()
            if text.isdigit():  # "max": no limit
                limits.append(int(text))
    except OSError:
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(soft)
    return min(limits)


# What one data-loading process holds at the least: its own pages (9 MiB each measured for ResNet-18 on the
# CPU, just started; they grow as it touches the trainer's memory) and DataLoader's prefetched batches.
DATA_WORKER_OWN_BYTES = 8 * 2**20
PREFETCHED_BATCHES = 2  # DataLoader's prefetch_factor


def check_batch_fits(batch_size: int, image_size: int, memory: int, batch_flag: str = "-b/--batch-size",
                     size_flag: str = "--image-size") -> None:
    """One image, and one process's batch of them, as the float32 input a
    model takes, within `memory`: a UsageError naming `size_flag` (the flag
    that asks for that size) or `batch_flag` otherwise."""
    side, image_bytes = image_size, 3 * image_size ** 2 * 4
    check_fits_in_memory(size_flag, image_bytes, f"one {side}x{side} image as float32 input", memory)
    check_fits_in_memory(batch_flag, batch_size * image_bytes, f"a batch of {batch_size} {side}x{side} images as "
                         f"float32 input (-b {batch_size} at {size_flag} {side})", memory)


def data_workers_bytes(workers: int, batch_size: int, image_size: int) -> int:
    """The least memory `workers` data-loading processes take, each with its
    own pages and its prefetched batches of uint8 crops."""
    return workers * (DATA_WORKER_OWN_BYTES + PREFETCHED_BATCHES * batch_size * 3 * image_size ** 2)


def check_fits_in_memory(flag: str, needed_bytes: int, what: str, memory: int) -> None:
    """A UsageError naming `flag` when `what` (`needed_bytes` of it) could
    never fit in `memory` bytes (memory_bytes()): one line before anything
    is allocated, instead of the kernel's out-of-memory killer. Plain integer
    arithmetic, so as fast for a value of 10**15 as for 10."""
    if needed_bytes > memory:
        raise UsageError(f"argument {flag}: {what} would take {format_bytes(needed_bytes)}, more than the "
                         f"{format_bytes(memory)} of memory this machine gives the job")
