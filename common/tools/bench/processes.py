"""Each measurement in a fresh process, so that its peak memory is its own
and no state carries over: run_child (a measurement of measurements.py, run
as `python -m common.tools.bench --child SPEC`) and run_script (an entry
script for W + N training steps, its figures read from its metrics.csv);
the GPU is sampled meanwhile, and a process that fails is raised as
ChildFailed, which the sections turn into the row's note.
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, List, Optional

from common.tools.bench.gpu_monitor import GpuMonitor
from common.tools.bench.settings import Settings

REPO = Path(__file__).resolve().parents[3]


def run_child(spec: dict, gpu: Optional[GpuMonitor] = None, preexec_fn: Optional[Callable[[], None]] = None) -> dict:
    """measurements.child(spec) in a fresh process: its figures, with that process's id and the GPU's samples (_run).
    `preexec_fn` runs in it first (the storage section: it joins the throttled storage's cgroup)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        ran = _run([sys.executable, "-m", "common.tools.bench", "--child", json.dumps(spec), "--child-out", str(out)],
                   gpu, preexec_fn)
        return dict(json.loads(out.read_text()), **ran)


class ChildFailed(RuntimeError):
    """A measured process that exited with an error: its row says so, and the harness goes on."""

    def __init__(self, command: List[str], status: int, output: str):
        super().__init__(f"{' '.join(command)} failed (exit {status}):\n{output[-3000:]}")
        last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "no output")
        self.reason = f"exit {status}: {last[:300]}"


def _run(command: List[str], gpu: Optional[GpuMonitor] = None,
         preexec_fn: Optional[Callable[[], None]] = None) -> dict:
    """Run `command` from the repository, sampling the GPU meanwhile when `gpu`
    is given; its output is shown only if it fails (ChildFailed). Returns the
    process's id and the GPU's samples (None: not sampled)."""
    with gpu.sampling() if gpu else contextlib.nullcontext() as samples:
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   preexec_fn=preexec_fn)
        output, _ = process.communicate()
    if process.returncode != 0:
        raise ChildFailed(command, process.returncode, output)
    return {"process": process.pid, "gpu_readings": samples}


def run_script(script: str, flags: List[str], settings: Settings, logdir: Path, data: Optional[str] = None,
               workers: Optional[int] = None) -> dict:
    """One entry script for W + N training steps; its train row of metrics.csv.
    `workers` (-j): by default settings.synthetic_workers without `data`."""
    workers = settings.synthetic_workers if workers is None and data is None else (workers or 0)
    import pandas

    run_name = f"bench-{len(list(logdir.iterdir())) if logdir.exists() else 0}"
    command = [sys.executable, script, *([data] if data else ["--synthetic"]), "-a", settings.arch,
               "-b", str(settings.batch_size), "--image-size", str(settings.image_size),
               "--val-resize", str(settings.image_size), "-j", str(workers), "--device", settings.device,
               "--epochs", "1", "--steps-per-epoch", str(settings.warmup_steps + settings.steps),
               "--throughput-warmup-steps", str(settings.warmup_steps), "--checkpoint-every", "0",
               "--io-interval", "0", "-p", "1000000", "--logdir", str(logdir), "--run-name", run_name, *flags]
    ran = _run(command, settings.gpu)
    run_dir = logdir / run_name
    row = pandas.read_csv(run_dir / "metrics.csv").query("split == 'train'").iloc[-1]
    config = json.loads((run_dir / "config.json").read_text())
    peak = row.get("peak_memory_mib")
    if peak is None or peak != peak:  # NaN on the CPU: the training process's resident memory
        peak = row.get("host_memory_mib")
    resolved = config.get("resolved", {})
    return {"measured_steps": int(row["steps"]) - int(row["warmup_steps"]), "warmup_steps": int(row["warmup_steps"]),
            "images_per_second": float(row["images_per_second"]),
            "ms_per_step": 1000.0 * float(row["seconds_per_step"]),
            "peak_memory_mib": float(peak), "precision": resolved.get("precision", ""),
            "memory_format": "channels_last" if resolved.get("channels_last") else "contiguous",
            "command": " ".join(["python", *command[1:]]).replace(str(logdir), "LOGDIR"), **ran}
