"""Each configuration of a section measured N times, round-robin, then one
row each: the configurations to measure (Planned), the rounds over them
(measure_section), a row's medians, spread and GPU state from its repeats
(summarize), and the finished row with the machine, FLOPs and MFU (finish).
"""
from __future__ import annotations

import statistics
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

from common.tools.bench import flops
from common.tools.bench.gpu_monitor import gpu_state
from common.tools.bench.machine import with_machine
from common.tools.bench.processes import ChildFailed
from common.tools.bench.report import FIELDS, emit, record, rounded
from common.tools.bench.settings import Settings


class Planned(NamedTuple):
    label: str  # how the progress lines name it
    fields: dict  # what its row says about the configuration (section, config, ...)
    measure: Optional[Callable[[], dict]]  # one measurement in a fresh process; None: not timed (its note says why)


def measure_section(planned: Sequence[Planned], repeats: int, settings: Settings,
                    save: Optional[Callable[[List[dict]], None]] = None) -> List[dict]:
    """Every timed configuration `repeats` times: round after round, each
    round over all of them in turn (a drift of the machine's speed spreads
    over all alike, not onto one), then one row each (summarize). A
    configuration whose process fails is not measured again; its row says
    why. After each round the rows so far go to `save` (the CSV), so a harness
    stopped mid-section keeps what it measured, with the repeats it had."""
    done: List[List[dict]] = [[] for _ in planned]
    failed: Dict[int, str] = {}
    for round_ in range(1, repeats + 1):
        for index, configuration in enumerate(planned):
            if configuration.measure is None or index in failed:
                continue
            section = configuration.fields["section"]
            try:
                measured = configuration.measure()
            except ChildFailed as error:
                failed[index] = f"failed in repeat {round_}: {error.reason}"
                print(f"{section} {configuration.label}: {error}", flush=True)
                continue
            done[index].append(measured)
            print(f"{section} {configuration.label}: {measured['images_per_second']:.1f} images/s, "
                  f"{measured['ms_per_step']:.1f} ms/step (repeat {round_} of {repeats}, process "
                  f"{measured.get('process', '?')})", flush=True)
        if save is not None and round_ < repeats:
            save([finish(configuration.fields, done[index], failed.get(index), settings)
                  for index, configuration in enumerate(planned)])
    return [emit(finish(configuration.fields, done[index], failed.get(index), settings))
            for index, configuration in enumerate(planned)]


SPLIT_FIELDS = ("compute_ms", "exposed_comm_ms", "data_wait_ms")
STORAGE_FIELDS = ("mb_per_second", "opens_per_second", "source_mb", "cache_mb")


def summarize(measurements: Sequence[dict]) -> dict:
    """One row's figures from its repeats: the median images/s and ms/step,
    the lowest and highest images/s and their spread ((max - min) / median,
    from two repeats on),
    the largest peak memory, and the GPU's state over all their samples."""
    if not measurements:
        return {}
    speeds = [measured["images_per_second"] for measured in measurements]
    median = statistics.median(speeds)
    summary = {key: value for key, value in measurements[0].items() if key in FIELDS}  # what ran: alike in each
    summary.update(repeats=len(measurements), images_per_second=median, images_per_second_min=min(speeds),
                   images_per_second_max=max(speeds),
                   spread_percent=100.0 * (max(speeds) - min(speeds)) / median if median > 0 and len(speeds) > 1
                   else "",  # none of one measurement, nor around 0
                   ms_per_step=statistics.median(measured["ms_per_step"] for measured in measurements),
                   peak_memory_mib=max(measured["peak_memory_mib"] for measured in measurements))
    for key in SPLIT_FIELDS + STORAGE_FIELDS:  # the scaling section's split, the storage section's rates: medians
        if all(key in measured for measured in measurements):
            summary[key] = statistics.median(measured[key] for measured in measurements)
    if "images_per_second_per_worker" in summary:
        summary["images_per_second_per_worker"] = statistics.median(
            measured["images_per_second_per_worker"] for measured in measurements)
    sampled = [measured.get("gpu_readings") for measured in measurements]
    summary.update(gpu_state(None if all(samples is None for samples in sampled) else
                             [sample for samples in sampled for sample in samples or ()]))
    return summary


def finish(fields: dict, measurements: Sequence[dict], failure: Optional[str], settings: Settings) -> dict:
    """The row of one configuration: what it is, its repeats' summary (none
    when it failed: the note says where), the machine, and for a training row
    its FLOPs per image and MFU."""
    row = record(**{**fields, **({} if failure else summarize(measurements))})
    if failure:
        row["note"] = "; ".join(filter(None, (row["note"], failure)))
    with_machine(row, settings.code)
    if row["section"] not in ("input", "storage", "decode") and isinstance(row["images_per_second"], (int, float)):
        gflop = flops.training_gflop_per_image(row["arch"], int(row["image_size"]))
        peak = settings.peak_tflops or (flops.gpu_peak_tflops(str(row["device_name"]), row["precision"])
                                        if settings.device == "cuda" else None)
        row["gflop_per_image"] = "" if gflop is None else gflop
        if gflop is not None and peak:
            row.update(peak_tflops=peak, mfu_percent=flops.mfu_percent(row["images_per_second"], gflop, peak))
    return rounded(row)
