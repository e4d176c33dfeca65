"""RESULTS.md's opening summary (common.tools.results), and the Markdown cells
both write: the headline figures this project measured, each with the hardware
and the date its file records, read from the files given (no number typed in):

- GPU training throughput by configuration and data backend, from the GPU
  benchmark CSVs (python -m common.tools.bench --device cuda);
- on CPUs, the ratios over the plain PyTorch reference the README's targets
  are stated in (bench/targets.py), from the CPU benchmark CSVs;
- the upstream's GPU scaling regenerated from its logs beside the scaling
  model's prediction (a CSV of python -m common.tools.scaling that holds
  measured efficiencies), with its figure (common.tools.plots --scaling-model).
"""
from __future__ import annotations

import datetime
import math
import re
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from common.errors import UsageError
from common.tools import plots, plots_scaling
from common.tools.bench import targets
from common.tools.bench.report import as_number

SUMMARY_HEADING = "## Summary"
# The benchmark sections whose rows are training throughput (the others: the input pipeline alone, data
# scale, communication, storage).
TRAINING_SECTIONS = ("train", "end-to-end")
# The first line of a --profile-steps summary.txt (measure.StepProfiler), and what a GPU session's env.txt
# beside it holds: `date`'s output first, nvidia-smi's table (its GPU rows: "|   0  NVIDIA H200   On  |").
PROFILE_LINE = re.compile(r"(?P<steps>.+?) profiled: (?P<ms>[\d.]+) ms per step"
                          r"(?:; the GPU ran no kernel or copy (?P<idle>[\d.]+)% of that time)?")
SMI_GPU = re.compile(r"^\|\s+\d+\s+(?P<name>NVIDIA .+?)\s+(?:On|Off)\s+\|", re.MULTILINE)


def portable_path(value: str) -> str:
    """An absolute path as '…/<its last part>': where a run's files lay on its
    machine (/tmp/job123/runs, /home/someone/imagenet) tells a reader nothing
    and would publish machine paths; relative paths stay as typed."""
    if not isinstance(value, str) or not value.startswith("/"):
        return value
    name = Path(value).name
    return f"…/{name}" if name else "…"


def number(value, digits: int = 2) -> str:
    """A table cell: fixed decimals, thousands separators, a dash for missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    cells = [[str(cell).replace("|", "\\|") for cell in row] for row in rows]  # a | would end the cell
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def folded(summary: str, body: str) -> str:
    """A section a reader opens: GitHub's <details>, with a blank line each side of the Markdown inside."""
    return "\n".join([f"<details><summary>{summary}</summary>", "", body.strip("\n"), "", "</details>"])


def _on_gpu(rows: List[dict]) -> bool:
    return any(row.get("cuda") for row in rows)


def _csv_cell(path: str) -> str:
    return f"`{Path(portable_path(Path(path).as_posix())).name}`"


def gpu_throughput(tables: Sequence[Tuple[str, List[dict]]]) -> Optional[str]:
    """One row per measured training configuration of the GPU CSVs, with the GPU and the date it ran on."""
    rows = []
    for path, found in tables:
        for row in found if _on_gpu(found) else ():
            speed = as_number(row["images_per_second"])
            if row["section"] not in TRAINING_SECTIONS or speed is None:
                continue
            repeats = int(as_number(row.get("repeats")) or 1)
            data = row.get("data_backend") or "synthetic"
            rows.append([row["device_name"], row["date"], row["section"], row["config"],
                         f"{row['arch']}, batch {row['batch_size']}, {row['image_size']} px",
                         f"{row['precision']}, {row['memory_format']}", f"{data}, {row['workers']} workers",
                         number(speed, 0), f"median of {repeats}" if repeats > 1 else "one run", _csv_cell(path)])
    if not rows:
        return None
    return table(["GPU", "date", "section", "configuration", "model", "precision, memory format",
                  "data, loader workers", "images/s", "measured", "CSV (results/bench)"], rows)


def cpu_ratios(tables: Sequence[Tuple[str, List[dict]]]) -> Optional[str]:
    """One row per CPU CSV with training or input rows: each target's ratio over the plain reference."""
    rows = []
    for path, found in tables:
        if _on_gpu(found) or not any(row["section"] in ("train", "input") for row in found):
            continue
        cells = []
        for _, numerator, denominator, section, target in targets.CPU_TARGETS:
            top = targets.compared_figure(found, section, numerator)
            bottom = targets.compared_figure(found, section, denominator)
            cells.append("—" if top is None or bottom is None else
                         f"{top / bottom:.2f}× ({'met' if top / bottom >= target else 'NOT met'})")
        if all(cell == "—" for cell in cells):
            continue  # a CSV of one configuration alone (the emulated path timed once): no ratio
        first = found[0]
        rows.append([first["device_name"], first.get("capability") or "not recorded", first["date"], *cells,
                     _csv_cell(path)])
    if not rows:
        return None
    return table(["CPU", "capability", "date",
                  *(f"{section}: {numerator} over {denominator} (target ≥ {target:g}×)"
                    for _, numerator, denominator, section, target in targets.CPU_TARGETS),
                  "CSV (results/bench)"], rows)


def _session(folder: Path) -> Tuple[str, str]:
    """(GPU, date) from a GPU session's env.txt: `date`, then nvidia-smi; 'not recorded' where it says neither."""
    try:
        text = (folder / "env.txt").read_text(errors="replace")
    except OSError:
        return "GPU not recorded", "date not recorded"
    gpu = SMI_GPU.search(text)
    try:
        day = datetime.datetime.strptime(text.splitlines()[0].strip(), "%a %b %d %I:%M:%S %p %Z %Y").date().isoformat()
    except (ValueError, IndexError):
        day = "date not recorded"
    return (gpu["name"] if gpu else "GPU not recorded"), day


def profiles(paths: Sequence[str]) -> Optional[str]:
    """One row per --profile-steps summary.txt: its step time and the share the GPU ran nothing, with the
    GPU and date of the env.txt beside it."""
    rows = []
    for path in paths:
        try:
            first = Path(path).read_text(errors="replace").splitlines()[:1]
        except OSError as error:
            raise UsageError(f"argument --profiles: cannot read {path} ({error.strerror})") from None
        found = PROFILE_LINE.match(first[0]) if first else None
        if found is None:
            raise UsageError(f"argument --profiles: {path} is no summary.txt of --profile-steps (its first line: "
                             f"'N step(s) profiled: X ms per step...')")
        gpu, day = _session(Path(path).parent)
        rows.append([gpu, day, f"`{Path(path).parent.name}/{Path(path).name}`", found["steps"], found["ms"],
                     f"{found['idle']}%" if found["idle"] else "—"])
    return table(["GPU", "date", "profile", "steps", "ms per step (profiled)", "GPU idle (no kernel or copy)"],
                 rows) if rows else None


def upstream_scaling(upstream: Sequence[plots.Run], scaling_paths: Sequence[str], figures: Path) -> List[str]:
    """The upstream's measured scaling efficiency (from its logs) beside the
    scaling model's predictions of it (the first CSV with measured figures)."""
    measured = plots.summarize(upstream)
    measured = measured[measured["device_kind"] == "gpu"]
    found = ((path, plots_scaling.read_rows(path, "--scaling")) for path in scaling_paths)
    source, predicted = next(((path, rows) for path, rows in found if plots_scaling.compares_measured(rows)),
                             (None, None))
    if measured.empty or predicted is None:
        return []
    scenarios = plots_scaling.compared_rows(predicted)
    counts = sorted({int(count) for count in measured["gpus"]})
    rows = []
    for series, found in measured.groupby("series", sort=True):
        by_count = dict(zip(found["gpus"].astype(int), found["scaling_efficiency_percent"]))
        rows.append([f"measured: `{series}`, its logs", *(f"{by_count[count]:.1f}%" if count in by_count else "—"
                                                          for count in counts),
                     plots_scaling.UPSTREAM_HARDWARE, "`results/upstream`"])
    for scenario, found in scenarios.items():
        by_count = {int(row["gpus"]): as_number(row["efficiency_percent"]) for row in found}
        rows.append([f"predicted: {scenario}", *(f"{by_count[count]:.1f}%" if by_count.get(count) is not None
                                                 else "—" for count in counts),
                     "the same cluster, modelled from its published figures", _csv_cell(source)])
    figure = figures / "upstream" / f"{plots_scaling.FIGURE_NAME}.png"
    hook = next(iter(scenarios.values()))[0]["hook"]
    return ["### GPU scaling: the upstream's runs, regenerated from their logs, and the scaling model", "",
            *([f"![measured and predicted GPU scaling]({figure.as_posix()})", ""] if figure.is_file() else []),
            f"Scaling efficiency: per-GPU images/s at N GPUs over the smallest count's. Measured by another project "
            f"(not this one) on {plots_scaling.UPSTREAM_HARDWARE}; predicted by `python -m common.tools.scaling` "
            f"for {hook} gradients (docs/scaling.md, and the Scaling model section below).", "",
            table(["", *(f"{count} GPUs" for count in counts), "hardware and date", "source"], rows)]


def summary(bench: Sequence[Tuple[str, List[dict]]], upstream: Sequence[plots.Run], scaling_paths: Sequence[str],
            figures: Path, profile_paths: Sequence[str] = ()) -> str:
    """The summary RESULTS.md opens with; the recipes table (results.recipes_section) follows it."""
    parts = [SUMMARY_HEADING, "",
             "What this project measured, each figure with the hardware and the date its file records; the runs' "
             "option tables and the raw benchmark tables follow, folded."]
    gpu, cpu = gpu_throughput(bench), cpu_ratios(bench)
    if gpu:
        parts += ["", "### GPU training throughput, by configuration and data backend", "",
                  "Global training images/s of one GPU, warm-up steps left out, each configuration in a fresh "
                  "process (`python -m common.tools.bench --device cuda`); `synthetic`: data made on the device.", "",
                  gpu]
    profiled = profiles(profile_paths)
    if profiled:
        parts += ["", "Where a step's time goes, from `--profile-steps` (the run's `summary.txt`, the GPU and date from "
                  "the `env.txt` of its session):", "", profiled]
    if cpu:
        parts += ["", "### CPU: ratios against the plain PyTorch reference", "",
                  "Each configuration's images/s over the plain PyTorch loop (train) or input pipeline (input, per "
                  "worker) measured in the same run of `make bench` on the same machine; the README's targets.", "",
                  cpu]
    scaling = upstream_scaling(upstream, scaling_paths, figures) if scaling_paths else []
    if scaling:
        parts += [""] + scaling
    return "\n".join(parts)
