"""The README's targets, and the lines that hold a run's rows against them:
printed at the end of a run (command_line) and under each table of RESULTS.md
(common.tools.results). Speed-ups over the plain reference on the CPU, a
GPU's images/s and the spread of its repeats, real JPEGs over synthetic
data end to end, the data-scale section's costs, and summaries of the comm
and scaling sections. Reads rows only: nothing here runs a measurement.
"""
from __future__ import annotations

from typing import List, Optional

from common.tools.bench.report import as_number, repeats_of, size_name

# The train configuration the end-to-end section runs, keyed by whether it runs on a GPU: the fastest of each
# (its synthetic figure is what the input and end-to-end lines are held against).
END_TO_END_CONFIG = {False: "nd", True: "ddp_apex O2 channels_last"}

# Targets of the README, as (name, numerator config, denominator config, section, at least).
CPU_TARGETS = (
    ("train: fp32 (imagenet_nd.py) over the reference loop", "nd", "reference", "train", 1.0),
    ("train: imagenet_ddp_apex.py's own choice of precision over the reference loop", "ddp_apex auto", "reference",
     "train", 1.0),
    # Where bf16 is native (AVX512-BF16/AMX); elsewhere its row says emulated and skipped, and so does this line.
    ("train: bf16 autocast + channels-last over the reference loop", "ddp_apex O2 channels_last", "reference",
     "train", 2.2),
    ("input: images/s per worker, torchvision backend over the reference pipeline", "torchvision", "reference",
     "input", 2.0),
)
# On one H100 (issue 19): the best default --opt-level O2 configuration on synthetic data, as
# (what, config); its median images/s at least GPU_IMAGES_PER_SECOND (the aim beyond it: GPU_AIM),
# the spread of its repeats within GPU_SPREAD_PERCENT; real JPEGs end to end with a backend of
# END_TO_END_TARGETS at least that fraction of the same configuration's synthetic figure.
GPU_SYNTHETIC = (("ResNet-50 AMP + channels-last", "ddp_apex O2 channels_last"),
                 ("the same with --compile", "ddp_apex O2 channels_last compile"))
GPU_IMAGES_PER_SECOND, GPU_AIM, GPU_SPREAD_PERCENT = 4000.0, 5000.0, 5.0
END_TO_END_TARGETS = {"dali": 0.95}

MIB = 2 ** 20
IMAGENET_TRAIN = 1_281_000  # the data-scale targets' tree: 1,000 classes x 1,281


def measured_row(rows: List[dict], section: str, config: str, backend: Optional[str] = None) -> Optional[dict]:
    """The last row of a configuration (with that data backend) that has a figure."""
    return next((row for row in reversed(rows) if row["section"] == section and row["config"] == config
                 and backend in (None, row.get("data_backend")) and as_number(row["images_per_second"]) is not None),
                None)


def compared_figure(rows: List[dict], section: str, config: str) -> Optional[float]:
    """The figure of a configuration a target compares: its images/s; in the
    input section, its best per-worker figure over the worker counts tried."""
    if section == "input":
        return max((as_number(row["images_per_second_per_worker"]) for row in rows if row["section"] == "input"
                    and row["config"] == config and as_number(row["images_per_second_per_worker"]) is not None),
                   default=None)
    row = measured_row(rows, section, config)
    return None if row is None else float(row["images_per_second"])


def ratios(rows: List[dict]) -> List[str]:
    """The comparisons the README's targets are stated in, one line each."""
    def find(section, config, backend=None):
        return measured_row(rows, section, config, backend)

    def value(section, config):
        return compared_figure(rows, section, config)

    def skipped(section, config):
        return next((row["note"] for row in rows if row["section"] == section and row["config"] == config
                     and row.get("note") and row["images_per_second"] in ("", None)), None)

    lines = []
    on_gpu = any(row.get("cuda") for row in rows)
    for name, numerator, denominator, section, target in () if on_gpu else CPU_TARGETS:
        top, bottom = value(section, numerator), value(section, denominator)
        if top is None and skipped(section, numerator):
            lines.append(f"{name}: not measured ({skipped(section, numerator)}); not a speed-up on this machine")
        if top is not None and bottom is not None:
            lines.append(f"{name}: {top / bottom:.2f}x (target >= {target:g}x on the 2-core CPU: "
                         f"{_met(top / bottom >= target)})")
    for what, config in GPU_SYNTHETIC if on_gpu else ():
        row = find("train", config)
        if row is not None:
            lines += _gpu_synthetic_lines(what, row)
    reference = value("train", "reference")
    for row in rows:  # configurations timed in a half type this device emulates (--measure-emulated)
        if row["section"] == "train" and "emulated" in (row.get("note") or "") and \
                row["images_per_second"] not in ("", None) and reference:
            lines.append(f"train: {row['config']} over the reference loop: "
                         f"{float(row['images_per_second']) / reference:.2f}x ({row['note']}: a slowdown to avoid, "
                         f"not a speed-up)")
    same_layout = value("train", "nd contiguous")
    if same_layout is not None and reference is not None:
        lines.append(f"train: imagenet_nd.py in the reference's NCHW layout over the reference loop: "
                     f"{same_layout / reference:.2f}x (the training loop's own cost; 1.00 = none)")
    config = END_TO_END_CONFIG[on_gpu]
    synthetic = value("train", config)
    for backend in ("torchvision", "gpu") if on_gpu and synthetic else ():
        fastest = max((float(row["images_per_second"]) for row in rows
                       if row["section"] == "input" and row["config"] == backend), default=None)
        if fastest is not None:
            lines.append(f"input alone: the {backend} backend's best images/s over {config}'s synthetic training: "
                         f"{fastest / synthetic:.2f} (what it could feed; the end-to-end row measures both at once)")
    for row in rows:
        if row["section"] == "end-to-end" and row.get("data_backend") != "synthetic":
            lines += _end_to_end_lines(row, find("end-to-end", row["config"], "synthetic") or
                                       find("train", row["config"]), on_gpu)  # CSVs before issue 19: the train row
    return lines


def _gpu_synthetic_lines(what: str, row: dict) -> List[str]:
    """The GPU targets of a synthetic configuration: its median images/s, and the spread of its repeats."""
    speed, repeats, spread = float(row["images_per_second"]), repeats_of(row), as_number(row.get("spread_percent"))
    mfu = as_number(row.get("mfu_percent"))
    measured = (f"median of {repeats}" if repeats > 1 else "one run") + (f", MFU {mfu:.1f}%" if mfu is not None else "")
    lines = [f"train: {what}, images/s on synthetic data (one H100): {speed:.0f} ({measured}; target >= "
             f"{GPU_IMAGES_PER_SECOND:g}, aim {GPU_AIM:g}: {_met(speed >= GPU_IMAGES_PER_SECOND)}"
             f"{', aim reached' if speed >= GPU_AIM else ''})"]
    if repeats > 1 and spread is not None:
        lines.append(f"train: {what}, spread of its {repeats} repeats: {spread:.1f}% (target <= "
                     f"{GPU_SPREAD_PERCENT:g}%: {_met(spread <= GPU_SPREAD_PERCENT)})")
    else:
        lines.append(f"train: {what}, spread: not measured (one run; the target is for repeats)")
    return lines


def _end_to_end_lines(row: dict, synthetic: Optional[dict], on_gpu: bool) -> List[str]:
    """An end-to-end row over its configuration's synthetic figure; or why it has no figure."""
    backend, real = row.get("data_backend"), as_number(row["images_per_second"])
    if real is None:
        return [f"end-to-end: {row['config']} with --data-backend {backend}: not measured ({row['note']})"] \
            if row.get("note") else []
    if synthetic is None:
        return []
    ratio = real / float(synthetic["images_per_second"])
    target = END_TO_END_TARGETS.get(backend) if on_gpu else None
    said = f" (target >= {target:.2f} on the GPU: {_met(ratio >= target)})" if target else ""
    return [f"end-to-end: real JPEGs with --data-backend {backend} over synthetic data, {row['config']}: "
            f"{ratio:.2f} (1.00 = not input-bound){said}"]


def _met(met: bool) -> str:
    return "met" if met else "NOT met"


def data_scale_lines(rows: List[dict]) -> List[str]:
    """The data-scale section's targets, against the rows: the cached restart
    on the large tree over one on the small tree, the list's memory, a
    worker's copy. They are stated for ImageNet's size; on a smaller tree the
    figures are given without a verdict."""
    full_size = any(row["section"] == "data-scale" and row["config"].startswith(f"{IMAGENET_TRAIN:,} images")
                    for row in rows)
    timed = [row for row in rows if row["section"] == "data-scale" and str(row.get("seconds", "")) not in ("", "nan")]
    small = min((int(row["config"].split(" ")[0].replace(",", "")) for row in timed), default=0)
    seconds = {("small " if int(row["config"].split(" ")[0].replace(",", "")) == small else "")
               + row["config"].split(", ", 1)[1]: float(row["seconds"]) for row in timed}
    lists = [row for row in rows if row["section"] == "data-scale" and "as FileList" in row["config"]]
    lines = []

    def verdict(good: bool) -> str:
        return ("met" if good else "NOT met") if full_size else f"target at {IMAGENET_TRAIN:,} images"

    if "restart (cached scan)" in seconds and "small restart (cached scan)" in seconds:
        extra = seconds["restart (cached scan)"] - seconds["small restart (cached scan)"]
        lines.append(f"data-scale: a cached restart on the large tree over one on the small tree: {extra:+.2f} s "
                     f"(the large tree's first start, which scans it: "
                     f"{seconds.get('first start (scans DATA)', float('nan')):.1f} s; target <= +0.5 s: "
                     f"{verdict(extra <= 0.5)})")
    for row in lists:
        if row["worker_copied_mib"] in ("", None):
            continue
        lines.append(f"data-scale: the training list per process: {float(row['list_mib']):.1f} MiB (target <= 50 MB: "
                     f"{verdict(float(row['list_mib']) * MIB <= 50e6)}); a forked worker's copy over an epoch: "
                     f"{float(row['worker_copied_mib']):.2f} MiB (target <= 10 MB: "
                     f"{verdict(float(row['worker_copied_mib']) * MIB <= 10e6)})")
    return lines


def comm_lines(rows: List[dict]) -> List[str]:
    """The comm section's summary (its smallest size's time is the latency, its largest
    size's busbw the bandwidth) and the scaling section's split, one line each."""
    lines = []
    comm = [row for row in rows if row["section"] == "comm" and as_number(row.get("time_us")) is not None]
    if comm:
        small, large = min(comm, key=lambda row: int(row["size_bytes"])), max(comm, key=lambda row: int(row["size_bytes"]))
        lines.append(f"comm: all-reduce among {large['world_size']} processes ({large['backend']}): latency "
                     f"{float(small['time_us']):.1f} us at {size_name(int(small['size_bytes']))}, busbw "
                     f"{float(large['busbw_gbytes_per_s']):.3f} GB/s at {size_name(int(large['size_bytes']))} "
                     f"(python -m common.tools.scaling --comm-csv reads these rows as the link)")
    for row in rows:
        if row["section"] == "scaling" and as_number(row.get("ms_per_step")) is not None:
            lines.append(f"scaling: {row['config']}: {float(row['ms_per_step']):.1f} ms/step = compute "
                         f"{float(row['compute_ms']):.1f} + exposed communication {float(row['exposed_comm_ms']):.1f} "
                         f"+ data wait {float(row['data_wait_ms']):.1f} ms")
    return lines


# The issue's storage targets (issue 39): on the throttled profile the shards' read stage at least
# STORAGE_SHARDS_OVER_TREE times the folder tree's images/s; on local disk a warm node-local cache's at least
# STORAGE_CACHE_OVER_TREE of the folder tree's (within 10%).
STORAGE_SHARDS_OVER_TREE, STORAGE_CACHE_OVER_TREE = 5.0, 0.9


def storage_lines(rows: List[dict]) -> List[str]:
    """The storage section's targets, against its rows (none without them: another section's CSV)."""
    if not any(row["section"] == "storage" for row in rows):
        return []
    found = {(row["config"], row.get("storage")): row for row in rows if row["section"] == "storage"}
    speed = {key: as_number(row["images_per_second"]) for key, row in found.items()}
    profiles = list(dict.fromkeys(row.get("storage") for row in found.values() if row.get("storage")))
    lines = []
    for (numerator, denominator, target, wanted) in (
            ("shards", "folder tree", STORAGE_SHARDS_OVER_TREE, "throttled"),
            ("shards, warm node-local cache", "folder tree", STORAGE_CACHE_OVER_TREE, "local disk")):
        profile = next((name for name in profiles if name.startswith(wanted)), None)
        top, bottom = speed.get((numerator, profile)), speed.get((denominator, profile))
        what = f"storage: {numerator} over the {denominator}, read stage, {profile or wanted}"
        if top is None or not bottom:
            why = found.get((numerator, profile), found.get((denominator, profile), {})).get("note") or "no row"
            lines.append(f"{what}: {why if why.startswith('not measured') else f'not measured ({why})'}")
            continue
        lines.append(f"{what}: {top / bottom:.2f}x (target >= {target:g}x: {_met(top / bottom >= target)})")
    return lines
