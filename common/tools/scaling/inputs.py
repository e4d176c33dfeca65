"""What the scaling model is given, read from files: a measured step from a
run directory (settings_from_run) or a bench CSV (settings_from_bench), the
links from measured all-reduce rows (links_from_comm_csv), and measured
scaling efficiencies from run logs (measured_efficiencies). A file that
cannot be read is a UsageError naming the flag.
"""
from __future__ import annotations

import csv
import math
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from common.errors import UsageError, error_summary
from common.tools import plots
from common.tools.scaling.model import Links, Settings

def settings_from_run(path: Path, settings: Settings) -> Settings:
    """Step time and data wait from a run directory's metrics.csv (mean over its
    training epochs), and arch, batch, image size and world size from config.json."""
    if not path.is_dir():
        raise UsageError(f"argument --run: {path}: no such run directory")
    run = plots.read_run_dir(path)
    if run is None or run.epochs["seconds_per_step"].dropna().empty:
        raise UsageError(f"argument --run: {path}: no finished training epoch in metrics.csv")
    options = (run.config or {}).get("options") or {}
    step_ms = 1000.0 * float(run.epochs["seconds_per_step"].mean())
    wait = run.epochs["data_wait_fraction"].dropna()
    return replace(settings, step_ms=step_ms, data_wait_ms=step_ms * float(wait.mean()) if len(wait) else 0.0,
                   measured_gpus=run.replicas, arch=options.get("arch", settings.arch),
                   batch_size=int(options.get("batch_size", settings.batch_size)),
                   image_size=int(options.get("image_size", settings.image_size)))


def read_csv(path: Path, flag: str) -> List[dict]:
    if not path.is_file():
        raise UsageError(f"argument {flag}: {path}: no such file")
    try:
        with open(path, newline="") as handle:
            return list(csv.DictReader(handle))
    except (OSError, csv.Error, UnicodeDecodeError) as error:
        raise UsageError(f"argument {flag}: {path}: not a readable CSV ({error_summary(error)})") from None


def _number(row: dict, *columns: str) -> Optional[float]:
    for column in columns:
        try:
            value = float(row.get(column) or "nan")
        except ValueError:
            continue
        if math.isfinite(value):
            return value
    return None


def settings_from_bench(path: Path, config: Optional[str], settings: Settings) -> Settings:
    """ms_per_step, batch_size, arch, image_size of a bench CSV row (common.tools.bench):
    the first training row (section train or end-to-end) of --arch, or of --bench-config.
    A synthetic-data row has no data wait; a real-data row's wait is inside its step time."""
    rows = [row for row in read_csv(path, "--bench")
            if row.get("section", "train") in ("train", "end-to-end") and _number(row, "ms_per_step")]
    rows = [row for row in rows if (config is None or row.get("config") == config)]
    if not rows:
        raise UsageError(f"argument --bench: {path}: no training row with ms_per_step"
                         + (f" and config {config!r}" if config else ""))
    row = rows[0]
    return replace(settings, step_ms=_number(row, "ms_per_step"), data_wait_ms=0.0, measured_gpus=1,
                   arch=row.get("arch") or settings.arch,
                   batch_size=int(_number(row, "batch_size") or settings.batch_size),
                   image_size=int(_number(row, "image_size") or settings.image_size))


def links_from_comm_csv(path: Path, links: Links) -> Links:
    """Bandwidths and latencies from a measured all-reduce CSV (a future bench
    "comm" section; tolerant of how it names things). Rows: section=comm when a
    section column exists. Size: bytes | size_bytes | size. Bus bandwidth:
    busbw_GBps | busbw_gbytes_per_s | "busbw (GB/s)" in GB/s, or busbw_gbps in Gbit/s.
    Time: latency_us | time_us. Scope: a scope column (intra/inter), else nodes > 1
    is inter-node. Bandwidth: the largest size's busbw; latency per ring step:
    the smallest size's time / (2(n-1)) when a ranks | world_size | gpus column
    gives n, else taken as per step."""
    rows = [row for row in read_csv(path, "--comm-csv") if row.get("section", "comm") == "comm"]
    found: Dict[str, Dict[str, float]] = {}
    for row in rows:
        size = _number(row, "bytes", "size_bytes", "size")
        gbytes = _number(row, "busbw_GBps", "busbw_gbytes_per_s", "busbw (GB/s)")
        if gbytes is None and _number(row, "busbw_gbps") is not None:
            gbytes = _number(row, "busbw_gbps") / 8
        if size is None or gbytes is None:
            continue
        scope = (row.get("scope") or "").strip().lower()
        scope = scope if scope in ("intra", "inter") else "inter" if (_number(row, "nodes") or 1) > 1 else "intra"
        entry = found.setdefault(scope, {"largest": -1.0, "smallest": math.inf})
        if size > entry["largest"]:
            entry.update(largest=size, bytes_per_second=gbytes * 1e9)
        time_us = _number(row, "latency_us", "time_us")
        if time_us is not None and size < entry["smallest"]:
            ranks = _number(row, "ranks", "world_size", "gpus")
            entry.update(smallest=size, latency=time_us * 1e-6 / (2 * (ranks - 1) if ranks and ranks > 1 else 1))
    if not found:
        raise UsageError(f"argument --comm-csv: {path}: no comm rows with a size (bytes) and a bus bandwidth "
                         f"(busbw_GBps or busbw_gbps)")
    intra, inter = found.get("intra", {}), found.get("inter", {})
    return replace(links,
                   intra_node_bytes_per_second=intra.get("bytes_per_second", links.intra_node_bytes_per_second),
                   intra_node_latency_seconds=intra.get("latency", links.intra_node_latency_seconds),
                   inter_node_bytes_per_second=inter.get("bytes_per_second", links.inter_node_bytes_per_second),
                   inter_node_latency_seconds=inter.get("latency", links.inter_node_latency_seconds))


def measured_efficiencies(paths: Sequence[Path], device_kind: str = "gpu") -> Dict[str, Dict[int, float]]:
    """{series: {GPU count: measured scaling efficiency %}} from logs, as
    common.tools.plots defines it (per-GPU images/s over the smallest count's);
    only series with several counts, of the given device kind."""
    existing = [path for path in paths if path.exists()]
    if not existing:
        return {}
    try:
        table = plots.summarize(plots.load(existing).runs)
    except UsageError:  # folders without any run yet
        return {}
    found = {}
    for series, rows in table.groupby("series"):
        rows = rows.dropna(subset=["scaling_efficiency_percent"])
        if len(rows) >= 2 and set(rows["device_kind"]) == {device_kind}:
            found[series] = dict(zip(rows["gpus"].astype(int), rows["scaling_efficiency_percent"].astype(float)))
    return found
