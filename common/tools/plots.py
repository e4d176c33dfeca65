"""Figures from run directories and TensorBoard logs.

    python -m common.tools.plots RUN_OR_LOG_DIRS... --out figures/ [--smooth 0.6]

Reads, walking every directory given:
  - this project's run directories (config.json, metrics.csv, io.csv, resumes.jsonl);
  - TensorBoard event directories (events.out.tfevents.*) without a metrics.csv;
  - TensorBoard CSV exports `run-<run name>-tag-<Tag_split>.csv` (as in results/upstream/);
  - storage-monitor CSVs `bandwidth_<key>.csv` / `iops_<key>.csv` (`"Time";"Read";"Write"`).

The derived numbers (mean throughput, training time, scaling efficiency, time to
accuracy) are defined once, here, and common.tools.results and the tests use these
same functions, so a figure and RESULTS.md can never disagree.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import matplotlib
import numpy as np
import pandas as pd

matplotlib.use("Agg")  # files only: plotting must work on headless cluster nodes
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import matplotlib.ticker  # noqa: E402

from common.arguments import Parser  # noqa: E402
from common.errors import UsageError, run_main  # noqa: E402
from common.files import read_whole_rows  # noqa: E402
from common.tools import plots_scaling  # noqa: E402
from common.tools.plots_io import IO_COLUMNS, IOTrace, io_figure  # noqa: E402,F401  (plots.IOTrace)

# metrics.csv columns in order; older run directories lack those after skipped_steps (read as NaN).
METRIC_COLUMNS = ["epoch", "split", "loss", "top1", "top5", "images", "steps", "seconds", "images_per_second",
                  "seconds_per_step", "data_wait_fraction", "lr", "wall_time", "loss_scale", "skipped_steps",
                  "images_per_second_per_gpu", "warmup_steps", "peak_memory_mib", "dataset_bytes", "macro_f1",
                  "bad_images", "host_memory_mib"]
# TensorBoard tag -> column of Run.epochs. A CSV export names the tag with "_" for "/".
TAG_COLUMNS = {"Top1/train": "train_top1", "Top1/val": "val_top1", "Top5/train": "train_top5",
               "Top5/val": "val_top5", "Loss/train": "train_loss", "Loss/val": "val_loss",
               "Throughput/train": "images_per_second", "Time/train": "seconds_per_step",
               "Data/wait_fraction": "data_wait_fraction"}
EPOCH_COLUMNS = ["train_loss", "train_top1", "train_top5", "val_loss", "val_top1", "val_top5", "images_per_second",
                 "seconds_per_step", "data_wait_fraction", "lr", "train_start", "end_time"]
TB_CSV = re.compile(r"run-(?P<run>.+)-tag-(?P<tag>.+)\.csv$")
MONITOR_CSV = re.compile(r"(?P<kind>bandwidth|iops)_(?P<key>.+)\.csv$")
REPLICAS_IN_NAME = re.compile(r"(?:^|_)(?P<kind>gpu|cpu)x(?P<count>\d+)(?:_|$)")
ACCURACY_FIGURES = {"top1_train": ("train_top1", "training top-1 accuracy (%)"),
                    "top1_val": ("val_top1", "validation top-1 accuracy (%)"),
                    "top5_train": ("train_top5", "training top-5 accuracy (%)"),
                    "top5_val": ("val_top5", "validation top-5 accuracy (%)")}


@dataclass
class Run:
    """One training run, whatever log it came from."""

    name: str  # run directory or TensorBoard run name
    path: str  # where it was read
    replicas: int  # GPUs (or CPU processes) in the job: runs are grouped by this count
    device_kind: str  # "gpu" or "cpu"
    series: str  # hardware and source: runs of different series are never on one scaling line
    hardware: str  # one line on hardware and versions, for figure notes and RESULTS.md
    epochs: pd.DataFrame  # one row per epoch (0-based index), EPOCH_COLUMNS; NaN where the log lacks one
    config: Optional[dict] = None  # config.json of this project's runs
    resumes: List[dict] = field(default_factory=list)  # resumes.jsonl records


@dataclass
class Logs:
    runs: List[Run]
    io: List[IOTrace]


# --- derived numbers: the one definition of each --------------------------------------------------------

def mean_images_per_second(run: Run) -> float:
    """Mean over epochs of the global training throughput (images/s)."""
    return float(run.epochs["images_per_second"].mean()) if len(run.epochs) else math.nan


def training_seconds(run: Run, through_epoch: Optional[int] = None) -> float:
    """Training time, from the start of the first epoch to the end of epoch
    `through_epoch` (default: the last), from logged wall-clock times only.

    This project's runs log each epoch's train start and val end: the sum of
    those spans, so the gap of a preempted and resumed run is no training time.
    TensorBoard logs hold only each epoch's end: (that end - the first epoch's
    end) + one mean epoch of the run ((last - first) / (epochs - 1)), so the
    first epoch counts too."""
    epochs = run.epochs if through_epoch is None else run.epochs.loc[:through_epoch]
    if epochs["train_start"].notna().any():
        return float((epochs["end_time"] - epochs["train_start"]).sum(min_count=1))
    ends, all_ends = epochs["end_time"].dropna(), run.epochs["end_time"].dropna()
    if len(ends) < 1 or len(all_ends) < 2:
        return math.nan  # one epoch's end says nothing of its start
    mean_epoch = (all_ends.iloc[-1] - all_ends.iloc[0]) / (len(all_ends) - 1)
    return float(ends.iloc[-1] - ends.iloc[0] + mean_epoch)


def time_to_accuracy(run: Run, top1_percent: Optional[float] = None) -> Optional[Tuple[int, float]]:
    """(first epoch whose val top-1 >= the target, training_seconds through
    that epoch), or None when no epoch reached it. The target defaults to the
    run's --desired-acc (options.desired_acc, percent)."""
    if top1_percent is None:
        top1_percent = ((run.config or {}).get("options") or {}).get("desired_acc")
    if top1_percent is None:
        return None
    reached = run.epochs.index[run.epochs["val_top1"] >= top1_percent]
    return (int(reached[0]), training_seconds(run, int(reached[0]))) if len(reached) else None


def last_validation(run: Run) -> Tuple[Optional[int], float, float]:
    """(epoch, val top-1, val top-5) of the last validated epoch; (None, NaN, NaN) before any."""
    last = run.epochs.dropna(subset=["val_top1"]).tail(1)
    if not len(last):
        return None, math.nan, math.nan
    return int(last.index[0]), float(last["val_top1"].iloc[0]), float(last["val_top5"].iloc[0])


def summarize(runs: Sequence[Run]) -> pd.DataFrame:
    """One row per (series, GPU count): runs of the same count are averaged
    (`runs` says how many). Scaling efficiency = per-GPU throughput at N over
    per-GPU throughput at the smallest count of the same series, in percent."""
    rows = []
    for run in runs:
        _, top1, top5 = last_validation(run)
        rows.append({"series": run.series, "gpus": run.replicas, "device_kind": run.device_kind,
                     "epochs": len(run.epochs), "training_seconds": training_seconds(run),
                     "images_per_second": mean_images_per_second(run), "last_val_top1": top1, "last_val_top5": top5})
    columns = ["series", "gpus", "device_kind", "runs", "epochs", "training_seconds", "images_per_second",
               "images_per_second_per_gpu", "scaling_efficiency_percent", "last_val_top1", "last_val_top5"]
    if not rows:
        return pd.DataFrame(columns=columns)
    table = pd.DataFrame(rows).groupby(["series", "gpus"], sort=True).agg(
        device_kind=("device_kind", "first"), runs=("epochs", "size"),
        epochs=("epochs", lambda counts: "/".join(map(str, sorted(set(counts))))),
        training_seconds=("training_seconds", "mean"), images_per_second=("images_per_second", "mean"),
        last_val_top1=("last_val_top1", "mean"), last_val_top5=("last_val_top5", "mean")).reset_index()
    table["images_per_second_per_gpu"] = table["images_per_second"] / table["gpus"]
    baseline = table.groupby("series")["images_per_second_per_gpu"].transform("first")  # smallest count: sorted
    table["scaling_efficiency_percent"] = 100.0 * table["images_per_second_per_gpu"] / baseline
    return table[columns]


# --- readers --------------------------------------------------------------------------------------------

def _replicas_from_name(name: str) -> Tuple[Optional[int], str]:
    match = REPLICAS_IN_NAME.search(name)
    return (int(match["count"]), match["kind"]) if match else (None, "gpu")


def _arch_and_opt(name: str) -> str:
    """'resnet50 optO2' from <Mon><DD>_<HH-MM-SS>_<host>_<arch>_gpux8_b208_cpu20_optO2 (arch may hold '_')."""
    parts = name.split("_")
    ends = [i for i, part in enumerate(parts) if REPLICAS_IN_NAME.search("_" + part + "_")]
    if not ends or ends[0] < 4:
        return name
    return " ".join(["_".join(parts[3:ends[0]])] + [part for part in parts if part.startswith("opt")])


def _describe(name: str, source: str, what: str, config: Optional[dict]) -> Tuple[int, str, str, str]:
    """(replicas, device kind, series, hardware line) of a run: from its
    config.json, else from its name (gpux8, cpux2) and where it was found."""
    environment = (config or {}).get("environment") or {}
    options = (config or {}).get("options") or {}
    count, kind = _replicas_from_name(name)
    replicas = int(environment.get("replicas") or count or 1)
    if not environment:
        return replicas, kind, f"{source}: {_arch_and_opt(name)}", f"{what}, hardware not recorded in them"
    # imagenet_dp.py names its devices "4 x <GPU>": the count is the run's, the hardware is the GPU.
    device = re.sub(r"^\d+ x ", "", environment.get("device") or kind)
    kind = "cpu" if device == "cpu" else "gpu"
    where = f"CPU ({environment.get('cpu_model') or 'model unknown'})" if kind == "cpu" else device
    series = f"{where}: {options.get('arch', '?')} opt{options.get('opt_level', 'O0')}"
    hardware = (f"{what}, host {environment.get('host')}, torch {environment.get('torch')}, "
                f"torchvision {environment.get('torchvision')}, CUDA {environment.get('cuda')}, "
                f"Python {environment.get('python')}")
    return replicas, kind, series, hardware


def _read_config(path: Path) -> Optional[dict]:
    return json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else None


def _number_or_empty(value: Optional[str]) -> bool:
    try:
        float(value or "nan")
        return True
    except ValueError:
        return False


def read_rows(path: Path, numeric: Sequence[str], whole=lambda row: True) -> pd.DataFrame:
    """A CSV file a run grows by rows (metrics.csv, io.csv): its whole rows
    (files.read_whole_rows: also those with a number in each `numeric`
    column, or nothing, and that `whole` accepts), `numeric` columns as
    numbers (empty: NaN); the rows not read named in one warning on stderr."""
    read = read_whole_rows(path, lambda row: all(_number_or_empty(row.get(column)) for column in numeric)
                           and whole(row))
    if read.warning():
        print(read.warning(), file=sys.stderr, flush=True)
    frame = pd.DataFrame(read.rows, columns=read.columns)
    for column in set(numeric) & set(frame.columns):
        frame[column] = pd.to_numeric(frame[column], errors="coerce")
    return frame


def read_run_dir(path: Path) -> Optional[Run]:
    """A run directory of this project; None when it has no metrics.csv yet."""
    if not (path / "metrics.csv").is_file():
        return None
    config = _read_config(path)
    # val_ema rows (--model-ema) are whole rows too: read, not warned about, and left out below.
    rows = read_rows(path / "metrics.csv", METRIC_COLUMNS[2:], lambda row: row.get("split") in ("train", "val",
                     "val_ema") and (row.get("epoch") or "").isdigit()).reindex(columns=METRIC_COLUMNS)
    rows["epoch"] = rows["epoch"].astype(int)
    rows = rows.drop_duplicates(["epoch", "split"], keep="last")  # an edited, repeated epoch: the last row
    train = rows[rows["split"] == "train"].set_index("epoch")
    val = rows[rows["split"] == "val"].set_index("epoch")
    epochs = pd.DataFrame({
        "train_loss": train["loss"], "train_top1": train["top1"], "train_top5": train["top5"],
        "val_loss": val["loss"], "val_top1": val["top1"], "val_top5": val["top5"],
        "images_per_second": train["images_per_second"], "seconds_per_step": train["seconds_per_step"],
        "data_wait_fraction": train["data_wait_fraction"], "lr": train["lr"],
        "train_start": train["wall_time"] - train["seconds"], "end_time": val["wall_time"],
    }).sort_index().astype(float)
    epochs.index = epochs.index.astype(int)
    # A run still in an epoch's validation has that epoch's train row only: its epochs end at the last validated.
    validated = epochs.index[epochs["end_time"].notna()]
    epochs = epochs.loc[:validated.max()] if len(validated) else epochs.iloc[:0]
    replicas, kind, series, hardware = _describe(path.name, path.parent.name, "run directory", config)
    resumes = []
    if (path / "resumes.jsonl").is_file():
        resumes = [json.loads(line) for line in (path / "resumes.jsonl").read_text().splitlines() if line.strip()]
    return Run(path.name, str(path), replicas, kind, series, hardware, epochs, config, resumes)


def _run_from_scalars(name: str, path: str, scalars: Dict[str, pd.DataFrame], source: str, what: str,
                      config: Optional[dict] = None) -> Run:
    """A Run from per-tag frames (step, wall_time, value): TensorBoard steps
    are 1-based epochs; an epoch ends at its latest wall time (validation)."""
    columns, ends = {}, []
    for tag, frame in scalars.items():
        frame = frame.drop_duplicates("step", keep="last")  # a purged, redone epoch: the last value
        frame.index = frame["step"].astype(int) - 1
        columns[TAG_COLUMNS[tag]] = frame["value"]
        ends.append(frame["wall_time"])
    epochs = pd.DataFrame(columns).reindex(columns=EPOCH_COLUMNS).astype(float)
    epochs["end_time"] = pd.concat(ends, axis=1).max(axis=1) if ends else np.nan
    replicas, kind, series, hardware = _describe(name, source, what, config)
    return Run(name, path, replicas, kind, series, hardware, epochs.sort_index(), config)


def read_event_dir(path: Path) -> Run:
    """A TensorBoard event directory (a config.json beside it names the hardware)."""
    from tensorboard.backend.event_processing import event_accumulator  # slow import: only when needed

    accumulator = event_accumulator.EventAccumulator(str(path), size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    scalars = {tag: pd.DataFrame([(e.step, e.wall_time, e.value) for e in accumulator.Scalars(tag)],
                                 columns=["step", "wall_time", "value"])
               for tag in accumulator.Tags()["scalars"] if tag in TAG_COLUMNS}
    return _run_from_scalars(path.name, str(path), scalars, path.parent.name, "TensorBoard events",
                             _read_config(path))


def read_tb_csvs(files: Sequence[Path], source: str) -> List[Run]:
    """TensorBoard CSV exports (`Wall time,Step,Value`), one Run per run name."""
    by_run: Dict[str, Dict[str, pd.DataFrame]] = {}
    for path in sorted(files):
        match = TB_CSV.match(path.name)
        tag = next((t for t in TAG_COLUMNS if t.replace("/", "_") == match["tag"]), None)
        if tag is None:
            continue  # a tag no figure uses
        frame = pd.read_csv(path).rename(columns={"Wall time": "wall_time", "Step": "step", "Value": "value"})
        by_run.setdefault(match["run"], {})[tag] = frame
    return [_run_from_scalars(name, source, scalars, source, "TensorBoard CSV logs")
            for name, scalars in sorted(by_run.items())]


def read_io_csv(path: Path, label: str) -> Optional[IOTrace]:
    """io.csv of a run: one row per node (and block device) per sample. Nodes
    sample on their own clocks, so rows are put in buckets of the sampling
    interval, averaged per node and device, and summed over them. An empty
    value is a missing counter: it stays NaN (min_count=1), never 0. None
    when the sampler has not written a row yet."""
    rows = read_rows(path, ["wall_time", *IO_COLUMNS], lambda row: bool(row.get("wall_time")))
    if rows.empty:  # created, nothing written yet
        return None
    rows[["host", "device"]] = rows.reindex(columns=["host", "device"]).astype("string").fillna("")
    values = rows.reindex(columns=IO_COLUMNS).apply(pd.to_numeric, errors="coerce")
    interval = rows.groupby(["host", "device"])["wall_time"].diff().median()
    interval = interval if interval == interval and interval > 0 else 1.0
    bucket = ((rows["wall_time"] - rows["wall_time"].min()) // interval).rename("bucket")
    per_device = values.groupby([bucket, rows["host"], rows["device"]]).mean()
    total = per_device.groupby(level="bucket").sum(min_count=1)
    frame = total.reset_index(drop=True)
    frame.insert(0, "elapsed_seconds", total.index.to_numpy() * interval)
    start = pd.Timestamp(rows["wall_time"].min(), unit="s", tz="UTC").strftime("%Y-%m-%d %H:%M UTC")
    return IOTrace(label, start, frame)


def read_storage_monitors(files: Sequence[Path]) -> List[IOTrace]:
    """`"Time";"Read";"Write"` CSVs, bandwidth_<key> (bytes/s) paired with iops_<key> (ops/s)."""
    pairs: Dict[str, Dict[str, pd.DataFrame]] = {}
    for path in sorted(files):
        match = MONITOR_CSV.match(path.name)
        frame = pd.read_csv(path, sep=";").set_index("Time")
        unit = "bytes" if match["kind"] == "bandwidth" else "ops"
        pairs.setdefault(match["key"], {})[unit] = frame.rename(
            columns={"Read": f"read_{unit}_per_second", "Write": f"write_{unit}_per_second"})
    traces = []
    for key, frames in sorted(pairs.items()):
        frame = pd.concat(frames.values(), axis=1).reindex(columns=IO_COLUMNS).astype(float)
        times = pd.Series(pd.to_datetime(frame.index, utc=True), index=frame.index)
        order = np.argsort(times.to_numpy(), kind="stable")
        frame, times = frame.iloc[order], times.iloc[order]
        start = frame.index[0]  # as the file writes it, with its time zone if it has one
        frame = frame.reset_index(drop=True)
        frame.insert(0, "elapsed_seconds", (times - times.iloc[0]).dt.total_seconds().to_numpy())
        traces.append(IOTrace(f"storage monitor {key}", start, frame))
    return traces


def load(paths: Sequence[Union[str, Path]]) -> Logs:
    """Every run and I/O trace under `paths` (directories are walked; a run
    directory is not descended into, as its before-resume-*/ are history)."""
    runs: List[Run] = []
    io: List[IOTrace] = []
    for root in map(Path, paths):
        if not root.exists():
            raise UsageError(f"{root}: no such file or directory")
        walk = [(str(root.parent), [], [root.name])] if root.is_file() else os.walk(root)
        tb_csvs, monitors = [], []
        for folder, subfolders, files in walk:
            folder, files = Path(folder), sorted(files)
            subfolders.sort()
            if not root.is_file() and ("metrics.csv" in files or "config.json" in files):
                subfolders[:] = []
                run = read_run_dir(folder)
                if run is None or run.epochs.empty:  # still in its first epoch: nothing to show yet
                    print(f"note: {folder}: no epoch finished yet, skipped", file=sys.stderr)
                    continue
                runs.append(run)
                trace = read_io_csv(folder / "io.csv", f"block devices, run {run.name}") if "io.csv" in files else None
                io += [trace] if trace is not None else []
            elif any(name.startswith("events.out.tfevents.") for name in files):
                runs.append(read_event_dir(folder))
            tb_csvs += [folder / name for name in files if TB_CSV.match(name)]
            monitors += [folder / name for name in files if MONITOR_CSV.match(name)]
        runs += read_tb_csvs(tb_csvs, (root if root.is_dir() else root.parent).resolve().name)
        io += read_storage_monitors(monitors)
    if not runs and not io:
        raise UsageError(f"{' '.join(map(str, paths))}: no run directories, TensorBoard logs or storage-monitor "
                         f"CSVs found")
    runs.sort(key=lambda run: (run.series, run.replicas, run.name))
    return Logs(runs, io)


# --- figures --------------------------------------------------------------------------------------------

def count_label(count: int, device_kind: str) -> str:
    """'8 GPUs', '1 GPU', '2 CPU processes'."""
    if device_kind == "cpu":
        return f"{count} CPU process{'es' if count != 1 else ''}"
    return f"{count} GPU{'s' if count != 1 else ''}"


# Launchers that start every process on the machine they run on.
ONE_MACHINE_LAUNCHERS = ("single process", "spawn")


def shared_cores(runs: Sequence[Run]) -> str:
    """What the CPU series of a figure measured, for its title: '' without one;
    processes that one machine's cores run share them, so more of them is no
    scaling ('CPU processes sharing one machine's 2 cores, not scaling')."""
    environments = [(run.config or {}).get("environment") or {} for run in runs if run.device_kind == "cpu"]
    if not environments:
        return ""
    if not all(environment.get("launcher") in ONE_MACHINE_LAUNCHERS for environment in environments):
        return "CPU processes, not GPUs"
    cores = sorted({str(environment.get("cpu_count")) for environment in environments if environment.get("cpu_count")})
    return f"CPU processes sharing one machine's {'/'.join(cores) + ' ' if cores else ''}cores, not scaling"


def run_labels(runs: Sequence[Run]) -> List[str]:
    """Legend labels: the GPU count, the series when several are shown, a
    number when one series has several runs of a count."""
    several = len({run.series for run in runs}) > 1
    labels = [(f"{run.series}: " if several else "") + count_label(run.replicas, run.device_kind) for run in runs]
    return [f"{label} #{labels[:i].count(label) + 1}" if labels.count(label) > 1 else label
            for i, label in enumerate(labels)]


def _finish(fig, ax, runs: Sequence[Run], legend_loc: str = "best"):
    """Grid, legend, and hardware and versions under the plot: a figure states what it measured."""
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc=legend_loc)
    lines = sorted({f"{run.series}: {run.hardware}" for run in runs})
    fig.text(0.01, 0.005, "\n".join(lines), fontsize=6, va="bottom", color="0.35")
    fig.subplots_adjust(bottom=0.11 + 0.022 * len(lines))
    return fig


def _count_figure(table: pd.DataFrame, runs: Sequence[Run], column: str, draw_series, log_y: bool,
                  legend_loc: str = "best", reference_line: Optional[Tuple[float, str]] = None, **axes):
    """A figure of `column` against the GPU count (x log2, ticked at the
    counts present): `draw_series(ax, colour, series, rows, note)` draws
    each hardware series' rows (`note`: the legend's word on averaged runs),
    then a dashed horizontal `reference_line` (y, label) if given, and `axes`
    go to ax.set. None when no row has the column."""
    table = table.dropna(subset=[column])
    if table.empty:
        return None
    fig, ax = plt.subplots(figsize=(8, 5.5))
    kinds, counts = set(table["device_kind"]), sorted(set(table["gpus"]))
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(count) for count in counts])
    ax.minorticks_off()
    ax.set_xlabel("GPUs" if kinds == {"gpu"} else "CPU processes" if kinds == {"cpu"} else "GPUs or CPU processes")
    ax.set_xlim(counts[0] / 1.5, counts[-1] * 1.5)
    if log_y:  # plain numbers (1,024, not 2^10) on the log axis
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 10 else f"{v:.3g}"))
    for index, (series, rows) in enumerate(table.groupby("series", sort=True)):
        note = "" if (rows["runs"] == 1).all() else " (mean of " + "/".join(map(str, rows["runs"])) + " runs)"
        draw_series(ax, f"C{index}", series, rows, note)
    if reference_line is not None:
        ax.axhline(reference_line[0], color="0.5", linestyle="--", linewidth=1, label=reference_line[1])
    ax.set(**axes)
    return _finish(fig, ax, runs, legend_loc=legend_loc)


def accuracy_figure(runs: Sequence[Run], column: str, ylabel: str, smooth: float = 0.0):
    """Accuracy (%) vs epoch, one curve per run; EMA-smoothed (as TensorBoard's
    slider) with the raw curve faint, when smooth > 0. None without data."""
    shown = [(run, label) for run, label in zip(runs, run_labels(runs)) if run.epochs[column].notna().any()]
    if not shown:
        return None
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for run, label in shown:
        values = run.epochs[column].dropna()
        if smooth > 0:
            raw = ax.plot(values.index, values, alpha=0.25, linewidth=0.8)[0]
            ax.plot(values.index, values.ewm(alpha=1 - smooth).mean(), color=raw.get_color(), label=label)
        else:  # markers: a run of one epoch is a point, which a line alone would not show
            ax.plot(values.index, values, "o-", markersize=3, label=label)
    ax.set(xlabel="epoch", ylabel=ylabel, title=f"{ylabel[0].upper()}{ylabel[1:]}, {len(shown)} run(s)"
           + (f", EMA smoothing {smooth:g}" if smooth > 0 else ""))
    return _finish(fig, ax, [run for run, _ in shown])


def throughput_figure(table: pd.DataFrame, runs: Sequence[Run]):
    """Mean global training images/s vs GPU count, with the ideal linear line from the smallest count."""
    def draw(ax, colour, series, rows, note):
        ax.plot(rows["gpus"], rows["images_per_second"], "o-", color=colour, label=series + note)
        first = rows.iloc[0]
        ax.plot(rows["gpus"], first["images_per_second"] * rows["gpus"] / first["gpus"], "--", color=colour,
                alpha=0.5, label=f"{series}: ideal linear from {count_label(first['gpus'], first['device_kind'])}")

    shared = shared_cores(runs)
    return _count_figure(table, runs, "images_per_second", draw, log_y=True, legend_loc="upper left",
                         ylabel="training throughput (images/s, global)",
                         title="Mean training throughput per epoch" + (f"\n({shared})" if shared else ""))


def efficiency_figure(table: pd.DataFrame, runs: Sequence[Run]):
    """Scaling efficiency (%) vs GPU count, baseline: the smallest count of each series."""
    def draw(ax, colour, series, rows, note):
        first = rows.iloc[0]
        ax.plot(rows["gpus"], rows["scaling_efficiency_percent"], "o-", color=colour,
                label=f"{series} (baseline {count_label(first['gpus'], first['device_kind'])}: "
                      f"{first['images_per_second_per_gpu']:.0f} images/s each){note}")
        for gpus, percent in zip(rows["gpus"], rows["scaling_efficiency_percent"]):
            ax.annotate(f"{percent:.0f}%", (gpus, percent), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=8)

    shared, only_cpu = shared_cores(runs), set(table["device_kind"]) == {"cpu"}
    title = ("Per-process images/s relative to the smallest count:\n" + shared if only_cpu else
             "Scaling efficiency: per-GPU images/s relative to the smallest count" + (
                 f"\n(the CPU series: {shared})" if shared else ""))
    return _count_figure(table, runs, "scaling_efficiency_percent", draw, log_y=False, legend_loc="lower left",
                         reference_line=(100, "100% (each process as fast as one alone)" if only_cpu
                                         else "100% (linear scaling)"), title=title,
                         ylabel="per-process images/s relative to the smallest count (%)" if only_cpu
                         else "scaling efficiency (%)",
                         ylim=(0, max(115, table["scaling_efficiency_percent"].max() + 15)))


def training_time_figure(table: pd.DataFrame, runs: Sequence[Run]):
    """Training time (h) vs GPU count; the legend gives each series' usual
    epoch count, and a point that ran another number of epochs says so."""
    def draw(ax, colour, series, rows, note):
        hours, usual = rows["training_seconds"] / 3600, rows["epochs"].mode().iloc[0]
        ax.plot(rows["gpus"], hours, "o-", color=colour, label=f"{series}, {usual} epochs{note}")
        for gpus, value, epochs in zip(rows["gpus"], hours, rows["epochs"]):
            ax.annotate(f"{value:.3g} h" + (f"\n({epochs} epochs)" if epochs != usual else ""), (gpus, value),
                        textcoords="offset points", xytext=(6, 4), fontsize=8)

    return _count_figure(table, runs, "training_seconds", draw, log_y=True, ymargin=0.15,  # room for the annotations
                         ylabel="training time (h)", title="Training time (train + validation, from logged wall times)")


def data_wait_figure(runs: Sequence[Run]):
    """Share of training time spent waiting for data (%) vs epoch."""
    shown = [(run, label) for run, label in zip(runs, run_labels(runs))
             if run.epochs["data_wait_fraction"].notna().any()]
    if not shown:
        return None
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for run, label in shown:
        values = run.epochs["data_wait_fraction"].dropna() * 100
        ax.plot(values.index, values, "o-", markersize=3, label=label)
    ax.set(xlabel="epoch", ylabel="data-wait share of training time (%)", ylim=(0, None),
           title=f"Time spent waiting for the input pipeline, {len(shown)} run(s)")
    return _finish(fig, ax, [run for run, _ in shown])


def make_figures(logs: Logs, smooth: float = 0.0, predictions: Optional[Tuple[str, List[dict]]] = None) -> dict:
    """Every figure by name: a matplotlib Figure, or (a str) why there is none;
    with `predictions` (a scaling model CSV's name and rows), the measured GPU
    scaling beside them (plots_scaling)."""
    table = summarize(logs.runs)
    figures = {name: accuracy_figure(logs.runs, column, ylabel, smooth)
               for name, (column, ylabel) in ACCURACY_FIGURES.items()}
    figures.update(training_throughput=throughput_figure(table, logs.runs),
                   scaling_efficiency=efficiency_figure(table, logs.runs),
                   training_time=training_time_figure(table, logs.runs), IO=io_figure(logs.io),
                   data_wait=data_wait_figure(logs.runs))
    if predictions is not None:
        figures[plots_scaling.FIGURE_NAME] = plots_scaling.model_comparison_figure(table, predictions[1], predictions[0])
    reasons = {"IO": "no I/O samples (io.csv rows, storage-monitor CSVs)" if not logs.io
               else "no block-device counters in any I/O log",
               "data_wait": "no input has a data-wait share (metrics.csv data_wait_fraction, Data/wait_fraction)",
               "training_time": "no run has two epochs' wall times",
               plots_scaling.FIGURE_NAME: "no GPU runs of two counts or more to compare with the scaling model"}
    return {name: figure if figure is not None else reasons.get(name, "no run has these values")
            for name, figure in figures.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m common.tools.plots", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", metavar="RUN_OR_LOG_DIR",
                        help="run directories, folders of them, TensorBoard logs or CSV exports")
    parser.add_argument("--out", default="figures", metavar="DIR", help="where the PNG and PDF files go")
    parser.add_argument("--smooth", type=float, default=0.0, metavar="ALPHA",
                        help="EMA smoothing of the accuracy curves, 0 (none) to below 1")
    parser.add_argument("--scaling-model", metavar="CSV", help="a CSV of python -m common.tools.scaling: the GPU "
                        f"runs' scaling efficiency beside its predictions ({plots_scaling.FIGURE_NAME}.png)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> List[Path]:
    args = build_parser().parse_args(argv)
    if not 0 <= args.smooth < 1:
        raise UsageError(f"argument --smooth: expected a number in [0, 1), got {args.smooth:g}")
    predictions = None if args.scaling_model is None else (
        args.scaling_model, plots_scaling.read_predictions(args.scaling_model))
    figures = make_figures(load(args.paths), args.smooth, predictions)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, figure in figures.items():
        if isinstance(figure, str):
            print(f"{name}: not written ({figure})")
            continue
        for suffix in (".png", ".pdf"):
            figure.savefig(out / (name + suffix), dpi=150, metadata={"CreationDate": None} if suffix == ".pdf" else {})
            written.append(out / (name + suffix))
        plt.close(figure)
        print(f"{name}: {out / name}.png, .pdf")
    return written


if __name__ == "__main__":
    run_main(main)
