"""The I/O figure of common.tools.plots: storage traffic over time, from the
runs' io.csv and storage-monitor CSVs (read by common.tools.plots)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import matplotlib
import pandas as pd

matplotlib.use("Agg")  # files only: plotting must work on headless cluster nodes
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

IO_COLUMNS = ["read_bytes_per_second", "write_bytes_per_second", "read_ops_per_second", "write_ops_per_second"]


@dataclass
class IOTrace:
    """Storage traffic over time; NaN where a counter is missing (never 0)."""

    label: str
    start: str  # first sample's time, for the reader
    frame: pd.DataFrame  # elapsed_seconds + IO_COLUMNS


def io_figure(traces: Sequence[IOTrace]):
    """Read/write MB/s (left axis) and IOPS (right axis) vs time, one panel per
    trace. A trace without counters says so instead of showing zeros."""
    if not traces or all(trace.frame[IO_COLUMNS].isna().all().all() for trace in traces):
        return None
    fig, axes = plt.subplots(len(traces), 1, figsize=(9, 3.6 * len(traces)), squeeze=False)
    for ax, trace in zip(axes[:, 0], traces):
        frame, minutes = trace.frame, trace.frame["elapsed_seconds"] / 60
        ax.set(xlabel=f"time since {trace.start} (min)", ylabel="read/write (MB/s)", title=trace.label)
        ax.grid(alpha=0.3)
        if frame[IO_COLUMNS].isna().all().all():
            ax.text(0.5, 0.5, "no block-device counters\n(e.g. the dataset is on a network file system)",
                    transform=ax.transAxes, ha="center", va="center")
            continue
        lines, right, missing = [], None, []
        for column, style in zip(IO_COLUMNS, ("C0.-", "C1.-", "C2.--", "C3.--")):
            ops = "ops" in column
            label = column.split("_")[0] + (" IOPS" if ops else " MB/s")
            if frame[column].isna().all():
                missing.append(label)
                continue
            if ops and right is None:
                right = ax.twinx()  # its x-axis is hidden; the label keeps every axes self-describing
                right.set(xlabel=ax.get_xlabel(), ylabel="IOPS (operations/s)")
            lines += (right if ops else ax).plot(minutes, frame[column] / (1 if ops else 1e6), style,
                                                 markersize=3, label=label)
        if missing:  # said, not drawn as zeros
            ax.text(0.01, 0.97, "no counter: " + ", ".join(missing), transform=ax.transAxes, va="top", fontsize=8)
        ax.legend(handles=lines, fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig
