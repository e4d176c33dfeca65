"""What the scaling model's command writes: the rows compared with measured
runs (attach_measured), the CSV (write_csv_new, never replacing a file
without --overwrite), a plain-text summary, and the figure.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from common.errors import UsageError, error_summary
from common.files import atomic_write_text

CSV_COLUMNS = ["scenario", "hook", "gpus", "nodes", "arch", "batch_size", "accumulation_steps", "buckets",
               "comm_bytes_per_step", "step_ms", "compute_ms", "comm_ms", "exposed_comm_ms", "data_wait_ms",
               "images_per_second_per_gpu", "images_per_second", "efficiency_percent",
               "measured_efficiency_percent", "difference_pp"]


def attach_measured(rows: List[dict], measured: Dict[str, Dict[int, float]], hook: str) -> None:
    """Measured efficiency and the difference (pp) on the rows of `hook`, when one series was measured."""
    if len(measured) != 1:
        return
    (points,) = measured.values()
    for row in rows:
        if row["hook"] == hook and row["gpus"] in points:
            row["measured_efficiency_percent"] = points[row["gpus"]]
            row["difference_pp"] = row["efficiency_percent"] - points[row["gpus"]]


# --- outputs -------------------------------------------------------------------------------------------------

def write_csv_new(path: Path, rows: Sequence[dict], overwrite: bool) -> None:
    """Atomically (files.atomic_write_text): a temporary file beside it,
    flushed, then renamed into place, or, unless `overwrite`, linked into
    place, which fails if the name exists (another writer in between):
    nothing already written is replaced."""
    exists = f"argument --out: {path}: exists; nothing written (choose another --out, or --overwrite)"
    if path.exists() and not overwrite:
        raise UsageError(exists)

    def write(handle) -> None:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: (f"{value:.4g}" if isinstance(value, float) and math.isfinite(value)
                                   else "" if isinstance(value, float) else value) for key, value in row.items()})

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"argument --out: {path}: cannot write ({error_summary(error)})") from None
    try:
        atomic_write_text(path, write, overwrite=overwrite)
    except FileExistsError:
        raise UsageError(exists) from None
    except OSError as error:
        raise UsageError(f"argument --out: {path}: cannot write ({error_summary(error)})") from None


def draw_figure(panels: Sequence[Tuple[str, List[dict], Dict[str, Dict[int, float]], str]], path: Path,
                validation: Optional[List[dict]] = None) -> None:
    """Predicted efficiency per hook vs GPUs (log2 x axis), one panel per table
    (title, rows, measured points, the hook the scenarios are drawn with);
    measured points on top. Scenarios after the first are drawn dashed, for
    one hook only (so the panel stays readable); hooks with the same curve
    (fp16 and bf16 send the same bytes) share a line. `validation`: Validation
    B's rows (common.tools.link_validation), a last panel of measured and
    predicted step times on this machine."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = len(panels) + bool(validation)
    fig, axes = plt.subplots(1, count, figsize=(7.5 * count, 5.5), squeeze=False)
    if validation:
        _draw_validation(axes[0][-1], validation)
    for ax, (title, rows, measured, scenario_hook) in zip(axes[0], panels):
        scenarios = list(dict.fromkeys(row["scenario"] for row in rows))
        curves: Dict[Tuple, List[str]] = {}  # one line per distinct curve, named by every hook that has it
        for hook in dict.fromkeys(row["hook"] for row in rows):
            points = tuple((r["gpus"], round(r["efficiency_percent"], 6)) for r in rows
                           if r["hook"] == hook and r["scenario"] == scenarios[0])
            curves.setdefault(points, []).append(hook)
        for index, (points, hooks) in enumerate(curves.items()):
            ax.plot(*zip(*points), "-", color=f"C{index}", label=f"predicted, hook {' = '.join(hooks)}")
        for offset, scenario in enumerate(scenarios[1:], start=1):
            points = [(r["gpus"], r["efficiency_percent"]) for r in rows
                      if r["hook"] == scenario_hook and r["scenario"] == scenario]
            ax.plot(*zip(*points), "--", color=f"C{len(curves) + offset}", label=f"{scenario} ({scenario_hook})")
        for offset, (series, values) in enumerate(measured.items()):
            counts = sorted(values)
            ax.plot(counts, [values[c] for c in counts], "o", color="black" if offset == 0 else f"C{9 - offset}",
                    markersize=7, label=f"measured: {series}")
            for count in counts:
                ax.annotate(f"{values[count]:.0f}%", (count, values[count]), textcoords="offset points",
                            xytext=(0, -13), ha="center", fontsize=8)
        if not measured:
            ax.text(0.98, 0.97, "no measured GPU runs of several counts to compare", transform=ax.transAxes,
                    ha="right", va="top", fontsize=8, color="0.35")
        counts = sorted({row["gpus"] for row in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.minorticks_off()
        ax.axhline(100, color="0.6", linestyle=":", linewidth=1)
        ax.set(xlabel="GPUs", ylabel="scaling efficiency (%)", ylim=(0, 110), title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    fig.text(0.01, 0.005, "Model: python -m common.tools.scaling (DDP buckets from the model, ring all-reduce, "
             "overlap with backward by FLOPs). Measured: per-GPU images/s over the smallest run's.",
             fontsize=7, color="0.35")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _draw_validation(ax, rows: List[dict]) -> None:
    """Validation B: per link and hook, the measured step (dot) against the
    model's (cross), and the step without communication (the bars' floor)."""
    labels = [f"{row['link']}\n{row['hook']}" for row in rows]
    positions = range(len(rows))
    ax.bar(positions, [float(row["compute_ms"]) for row in rows], color="0.85", label="compute (no communication)")
    ax.plot(positions, [float(row["measured_ms"]) for row in rows], "o", color="black", markersize=8,
            label="measured step")
    ax.plot(positions, [float(row["predicted_ms"]) for row in rows], "x", color="C3", markersize=10, mew=2,
            label="predicted step")
    for position, row in zip(positions, rows):
        ax.annotate(f"{float(row['difference_percent']):+.1f}%", (position, float(row["measured_ms"])),
                    textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
    ax.set_xticks(list(positions), labels)
    ax.set(ylabel="ms per step", title=f"Validation B: 2 CPU processes over a tc-limited veth, "
                                       f"{rows[0]['arch']} b{rows[0]['batch_size']}")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="upper right")


def summary_lines(rows: Sequence[dict], gpus: int) -> List[str]:
    """A plain-text table at one GPU count: every scenario and hook."""
    lines = [f"{'scenario':<62} {'hook':<9} {'step_ms':>8} {'exposed_comm_ms':>15} {'data_wait_ms':>12} "
             f"{'img/s/GPU':>9} {'eff_%':>6}"]
    for row in rows:
        if row["gpus"] == gpus:
            lines.append(f"{row['scenario'][:62]:<62} {row['hook']:<9} {row['step_ms']:8.1f} "
                         f"{row['exposed_comm_ms']:15.2f} {row['data_wait_ms']:12.1f} "
                         f"{row['images_per_second_per_gpu']:9.0f} {row['efficiency_percent']:6.1f}")
    return lines
