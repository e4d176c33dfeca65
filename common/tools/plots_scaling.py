"""A measured scaling curve beside the scaling model's prediction for it.

    python -m common.tools.plots results/upstream --out figures/upstream \
        --scaling-model results/scaling/upstream-v100-hal.csv

The measured curve is regenerated from the runs' logs (common.tools.plots.summarize:
per-GPU images/s at N over the smallest count); the predictions are the rows of a
CSV of python -m common.tools.scaling (docs/scaling.md). Each scenario of the CSV
is one dashed line, for the gradient hook the CSV compared with measured figures.
RESULTS.md's summary tables the same rows (common.tools.results_summary), read
with `read_predictions` and `compared_rows`, so the figure and the table agree.
"""
from __future__ import annotations

import csv
from typing import Dict, List, Sequence

import matplotlib

matplotlib.use("Agg")  # files only: plotting must work on headless cluster nodes
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from common.errors import UsageError  # noqa: E402

FIGURE_NAME = "scaling_vs_model"
# Where the upstream's logs (results/upstream) were measured: its README, not its logs, says so.
UPSTREAM_HARDWARE = "NVIDIA V100 GPUs (NCSA HAL, 4 per node), 2020"


PREDICTION_COLUMNS = {"scenario", "hook", "gpus", "efficiency_percent"}


def read_rows(path: str, flag: str) -> List[dict]:
    """The rows of a CSV; a missing or unreadable file is one line naming `flag`."""
    try:
        with open(path, newline="") as handle:
            return list(csv.DictReader(handle))
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"argument {flag}: cannot read {path} ({getattr(error, 'strerror', None) or error})") \
            from None


def compares_measured(rows: List[dict]) -> bool:
    """Whether a CSV is the scaling model's with measured efficiencies beside its predictions."""
    return bool(rows) and PREDICTION_COLUMNS <= set(rows[0]) and any(row.get("measured_efficiency_percent")
                                                                      for row in rows)


def read_predictions(path: str, flag: str = "--scaling-model") -> List[dict]:
    """The rows of a scaling model CSV; a missing, unreadable or other CSV is one line naming `flag`."""
    rows = read_rows(path, flag)
    if not rows or not PREDICTION_COLUMNS <= set(rows[0]):
        raise UsageError(f"argument {flag}: {path} is no CSV of python -m common.tools.scaling (columns scenario, "
                         f"hook, gpus, efficiency_percent)")
    return rows


def compared_rows(rows: Sequence[dict]) -> Dict[str, List[dict]]:
    """scenario -> its rows (by GPU count) for the hook the CSV compared with
    measured efficiencies (the first hook where none was), in the CSV's order."""
    measured = [row["hook"] for row in rows if row.get("measured_efficiency_percent")]
    hook = measured[0] if measured else rows[0]["hook"]
    scenarios: Dict[str, List[dict]] = {}
    for row in rows:
        if row["hook"] == hook:
            scenarios.setdefault(row["scenario"], []).append(row)
    return {scenario: sorted(found, key=lambda row: int(row["gpus"])) for scenario, found in scenarios.items()}


def model_comparison_figure(table, rows: Sequence[dict], source: str, hardware: str = UPSTREAM_HARDWARE):
    """Scaling efficiency (%) against GPUs: each GPU series of `table`
    (plots.summarize) measured, solid; each scenario of `rows` predicted, dashed.
    None when the table has no GPU series."""
    measured = table[table["device_kind"] == "gpu"].dropna(subset=["scaling_efficiency_percent"])
    if measured.empty:
        return None
    scenarios = compared_rows(rows)
    hook = next(iter(scenarios.values()))[0]["hook"]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    counts = sorted({int(count) for count in measured["gpus"]} |
                    {int(row["gpus"]) for found in scenarios.values() for row in found})
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(count) for count in counts])
    ax.minorticks_off()
    for series, found in measured.groupby("series", sort=True):
        ax.plot(found["gpus"], found["scaling_efficiency_percent"], "o-", color="black", linewidth=2,
                label=f"measured: {series} (its logs)")
        for gpus, percent in zip(found["gpus"], found["scaling_efficiency_percent"]):
            ax.annotate(f"{percent:.0f}%", (gpus, percent), textcoords="offset points", xytext=(0, -14),
                        ha="center", fontsize=8)
    for index, (scenario, found) in enumerate(scenarios.items()):
        label = scenario if len(scenario) <= 70 else scenario[:69] + "…"
        ax.plot([int(row["gpus"]) for row in found], [float(row["efficiency_percent"]) for row in found], "s--",
                color=f"C{index}", alpha=0.8, markersize=4, label=f"predicted: {label}")
    ax.axhline(100, color="0.5", linestyle=":", linewidth=1)
    ax.set(xlabel="GPUs", ylabel="scaling efficiency (%)",
           ylim=(0, 115), title=f"GPU scaling of ResNet-50 training on {hardware}:\nmeasured (the runs' logs) "
                                f"and the scaling model's prediction ({hook} gradients)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.text(0.01, 0.005, f"predictions: {source} (python -m common.tools.scaling; docs/scaling.md)", fontsize=6,
             va="bottom", color="0.35")
    fig.subplots_adjust(bottom=0.13)
    return fig
