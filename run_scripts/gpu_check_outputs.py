"""What run_scripts/gpu_check.py brings back from a GPU session, apart from running it: the run
directories copied without their checkpoints, the graphs part's table and medians, a profile's summary
under its variant's name, env.txt's date line, summary-<parts>.txt, and the one archive the device tool
brings back (docs/tests.md#the-gpu-record-in-one-call). No torch, nothing of `common/`: gpu_check.py
imports it as `python3 run_scripts/gpu_check.py` is started, from its own folder (sys.path[0]).
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import statistics
import tarfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

MAX_TRANSFER_FILES = 8  # what the device tool brings back from $OUT
MAX_COPIED_FILE_BYTES = 4 << 20  # a run directory's file larger than this stays behind (none of its logs is)
LEFT_BEHIND = (".pth.tar", "run.lock", "trace.json")  # checkpoints, the lock, the profiler's Chrome trace


@dataclasses.dataclass
class Outcome:
    """A part's row of the summary."""

    part: str
    status: str  # ran, failed (exit N), stopped at the deadline, partial (k of n steps), skipped
    seconds: float = 0.0
    notes: List[str] = dataclasses.field(default_factory=list)


# --- copies and tables ---

def copy_run_logs(source: Path, destination: Path) -> Tuple[List[str], List[str]]:
    """Each run directory under `source` into `destination` without its checkpoints, lock and traces, nor
    any file over MAX_COPIED_FILE_BYTES: (the runs copied, the files left behind, relative to `source`)."""
    runs, left = [], []
    if not source.is_dir():
        return runs, left
    for run in sorted(path for path in source.iterdir() if path.is_dir()):
        runs.append(run.name)
        for path in sorted(run.rglob("*")):
            if not path.is_file():
                continue
            relative = path.relative_to(source)
            if path.name.endswith(LEFT_BEHIND) or path.stat().st_size > MAX_COPIED_FILE_BYTES:
                left.append(str(relative))
                continue
            target = destination / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    return runs, left


def copy_note(copied: Tuple[List[str], List[str]]) -> str:
    runs, left = copied
    return f"{len(runs)} run director{'y' if len(runs) == 1 else 'ies'} copied, {len(left)} file(s) left behind"


def copy_profile(run_dir: Path, target: Path) -> str:
    """The run's profile summary.txt as `target`; its first line (ms per step, the GPU's idle share) as the note."""
    found = sorted(run_dir.glob("profile-*/summary.txt"))
    if not found:
        return f"no profile summary in {run_dir}"
    target.write_bytes(found[-1].read_bytes())
    return f"{target.name}: {last_line(found[-1], first=True)}"


def add_throughput_row(table: Path, run_dir: Path, mode: str, repeat: int) -> str:
    """The run's training images/s (metrics.csv, after its warm-up steps) as a row of `table`."""
    try:
        with open(run_dir / "metrics.csv", newline="") as handle:
            row = next(row for row in csv.DictReader(handle) if row.get("split") == "train")
    except (OSError, StopIteration):
        return f"no training row in {run_dir / 'metrics.csv'}"
    new = not table.exists()
    with open(table, "a", newline="") as handle:
        writer = csv.writer(handle)
        if new:
            writer.writerow(["cuda_graphs", "repeat", "images_per_second", "peak_memory_mib"])
        writer.writerow([mode, repeat, row["images_per_second"], row.get("peak_memory_mib", "")])
    return f"--cuda-graphs {mode}: {float(row['images_per_second']):,.0f} images/s"


def graphs_note(table: Path) -> str:
    """Each mode's median images/s over its runs, and graphed over eager."""
    rates: Dict[str, List[float]] = {"off": [], "on": []}
    if table.exists():
        with open(table, newline="") as handle:
            for row in csv.DictReader(handle):
                rates[row["cuda_graphs"]].append(float(row["images_per_second"]))
    medians = {mode: statistics.median(values) for mode, values in rates.items() if values}
    parts = [f"--cuda-graphs {mode}: median {medians[mode]:,.0f} images/s of {len(rates[mode])}"
             for mode in medians]
    if len(medians) == 2:
        parts.append(f"on/off {medians['on'] / medians['off']:.3f}")
    return "; ".join(parts) or "no run measured"


def last_line(path: Path, first: bool = False) -> str:
    """The last (or first) line of a text file that is not blank: pytest's and the bench's verdicts."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return (lines[0] if first else lines[-1]) if lines else ""


# --- the summary and the archive ---

def session_date(now: Optional[datetime.datetime] = None) -> str:
    """`date`'s line as common.tools.results_summary reads an env.txt's first line, whatever the locale."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%a %b %d %I:%M:%S %p UTC %Y")


def summary_text(outcomes: Sequence[Outcome], header: str) -> str:
    """summary-<parts>.txt: a row per part (status, seconds, notes), then 'skipped: ...' (or 'skipped: nothing')."""
    lines = [header, "", f"{'part':8}  {'status':32}  {'seconds':>7}  notes"]
    for outcome in outcomes:
        lines.append(f"{outcome.part:8}  {outcome.status:32}  {outcome.seconds:7.0f}  {' | '.join(outcome.notes)}")
    skipped = [f"{outcome.part} ({'; '.join(outcome.notes)})" for outcome in outcomes
               if outcome.status == "skipped"]
    skipped += [f"{outcome.part}: {note}" for outcome in outcomes if outcome.status != "skipped"
                for note in outcome.notes if " needs at least " in note]  # the steps a part left
    return "\n".join(lines + ["", "skipped: " + (", ".join(skipped) or "nothing")]) + "\n"


def pack(out: Path, summary: Path, runs: Optional[Path], kind_folder: str) -> Path:
    """Every file of `out`, and the matrix's copied `runs` (None: no matrix ran), into one archive whose paths are the
    repository's (results/gpu-<kind>-<date>/..., results/runs/gpu-<date>/...); the packed files but the
    summary are removed, so `out` holds two files, within the device tool's MAX_TRANSFER_FILES."""
    archive = out / f"gpu-check-{summary.stem.removeprefix('summary-')}.tar.gz"
    packed = [path for path in sorted(out.rglob("*")) if path.is_file() and path not in (summary, archive)]
    with tarfile.open(archive, "w:gz") as tar:
        for path in [*packed, summary]:  # the summary stays beside the archive too, to be read first
            tar.add(path, arcname=f"results/{kind_folder}/{path.relative_to(out).as_posix()}")
        if runs is not None and runs.is_dir():
            tar.add(runs, arcname=f"results/runs/{runs.name}")
    for path in packed:
        path.unlink()
    for folder in sorted((path for path in out.rglob("*") if path.is_dir()), reverse=True):
        folder.rmdir()  # emptied: the device tool would count an empty folder too
    return archive
