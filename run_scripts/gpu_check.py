#!/usr/bin/env python3
"""The GPU record in one prepared call: on a machine with a CUDA GPU, the checks and measurements
a GPU session owes this project, within a deadline, most valuable first
(docs/tests.md#the-gpu-record-in-one-call).

    bash run_scripts/gpu_check.sh                          # every part, in the order below
    bash run_scripts/gpu_check.sh tests profile graphs     # these parts, in the order named
    GPU_CHECK_DRY_RUN=1 bash run_scripts/gpu_check.sh      # the commands and the deadline arithmetic only

The parts (env always comes first: a few seconds):
  tests    the `gpu`-marked tests (pytest -m gpu)
  profile  --profile-steps of the default step (imagenet_ddp_apex.py, ResNet-50, batch 256, synthetic
           data); with --cuda-graphs off and on where the scripts have that flag (auto is one of them)
  graphs   the same step's images/s with --cuda-graphs off then on, 3 such pairs
  bench    python -m common.tools.bench --device cuda, its train and end-to-end sections, 3 repeats
  decode   the bench's decode section: DALI's decoders alone at hw_decoder_load 0, 0.65 and 0.9, 3 repeats
  matrix   run_scripts/gpu_demo_matrix.sh (every script, O0-O3 in fp16 and bf16, each >= 95% top-1),
           its run directories copied without checkpoints into results/runs/gpu-<date>/

Each step has an estimate of its time on one H100/H200 and the least time worth starting it with: a
step that would start with less time left is skipped, and one that runs past the deadline is stopped
(its process group), keeping what it wrote. Everything small goes into one folder (--out; default
results/gpu-<kind>-<date>/) with summary-<parts>.txt: each part ran, failed, stopped or skipped,
and its seconds; its last line names what was skipped. --pack (the device tool's $OUT, which brings
back 8 files at most) leaves only that summary and one archive there, whose paths are the
repository's: `tar -xzf gpu-check-*.tar.gz` at the repository's root puts every file in its place.

Exit status: 0 when no part failed (skipped ones included), 1 when one did, 2 for a mistake in the
command line, no CUDA GPU or no torch (one line). torch is imported only to find the GPU; a dry run
needs no GPU, but torch (the scripts' parser lists torchvision's models).
What it brings back (the copies, tables, summary and archive) is gpu_check_outputs.py's.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

# run_scripts/ is no package: its sibling is found on sys.path, whose first entry is this folder when the file is
# run (gpu_check.sh, the device tool), unless python -P or PYTHONSAFEPATH leave it out.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_outputs import (MAX_TRANSFER_FILES, Outcome, add_throughput_row, copy_note, copy_profile,
                               copy_run_logs, graphs_note, last_line, pack, session_date, summary_text)

REPO = Path(__file__).resolve().parent.parent
PARTS = ("tests", "profile", "graphs", "bench", "decode", "matrix")  # the default order: most valuable first
DEFAULT_SECONDS = 540  # one 10-minute command of the device tool, with a minute to spare
MAX_SECONDS = 86_400
RESERVE_SECONDS = 20  # kept back from the parts for the archive and the summary
STOP_GRACE_SECONDS = 10
NOT_FOUND_EXIT_STATUS = 127  # a command that could not start, as a shell says it
DEADLINE_EXIT_STATUS = 75  # gpu_demo_matrix.sh: runs left for want of time, none failed (sysexits' EX_TEMPFAIL)
GRAPHS_REPEATS = 3
MATRIX_RUN_SECONDS = 40  # one digits run on an H200 took about 26 s (2026-11-26): gpu_demo_matrix.sh's RUN_SECONDS
# gpu_demo_matrix.sh's FIRST_RUN_SECONDS: its first run also writes the digits and starts CUDA and cuDNN on a
# cold machine, which 40 s did not leave room for; a guess, not timed yet.
MATRIX_FIRST_RUN_SECONDS = 60
MATRIX_RUNS = 10  # gpu_demo_matrix.sh's: nd, dp, ddp, O0, O1-O3 in fp16 and in bf16
# The default GPU step, as the benchmark's "ddp_apex O2 channels_last" configuration runs it, left to its own
# defaults: --opt-level auto is O2 on a GPU, -j the scripts' default (the bench's synthetic rows on a GPU use it
# too: Settings.synthetic_workers). The first 15 steps are left out of the throughput and the profile: --cuda-graphs
# on captures at step 12 under DDP (11 eager steps first), and neither figure should hold the capture; eager runs
# leave out as many, to compare alike.
STEP_FLAGS = ("imagenet_ddp_apex.py", "--synthetic", "-a", "resnet50", "-b", "256", "--nproc-per-node", "1",
              "--epochs", "1", "--checkpoint-every", "0", "--throughput-warmup-steps", "15")
# A test marked gpu: `@pytest.mark.gpu` before it, or a module's `pytestmark = pytest.mark.gpu` (or a list holding it).
GPU_MARK = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*\bpytest\.mark\.gpu\b)", re.MULTILINE)
BENCH_FLAGS = ("-m", "common.tools.bench", "--device", "cuda", "--sections", "train", "end-to-end",
               "--configs", "ddp_apex O2 channels_last", "--repeats", "3")
DECODE_FLAGS = ("-m", "common.tools.bench", "--device", "cuda", "--sections", "decode", "--repeats", "3")


class UsageError(Exception):
    """A mistake in the command line, or no GPU: one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{message} (see --help)")


@dataclasses.dataclass(frozen=True)
class Settings:
    python: str  # the interpreter every step runs with
    out: Path  # the output folder
    runs_copy: Path  # where the matrix's run directories are copied, without checkpoints
    scratch: Path  # the steps' own run directories (checkpoints, traces): left on the machine
    cuda_graphs: bool  # whether the scripts have --cuda-graphs yet (another change of issue 41 adds it)


@dataclasses.dataclass(frozen=True)
class Step:
    label: str
    commands: Tuple[Tuple[str, ...], ...]
    log: str  # the output folder's file the commands' output is appended to
    estimate_seconds: float  # about what it takes on one H100 or H200
    least_seconds: float  # started only with this much time left
    env: Mapping[str, object] = dataclasses.field(default_factory=dict)  # a callable value: asked at the start
    after: Optional[Callable[[], str]] = None  # then: copies, tables; returns a note


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    steps: Tuple[Step, ...]
    unavailable: str = ""  # why this part cannot run here at all
    after: Optional[Callable[[], str]] = None  # after its steps: a note for the summary


# --- what each part runs ---

def env_step(settings: Settings) -> Step:
    """env.txt: the session's date (first line, as results_summary reads it), nvidia-smi, the clocks,
    the versions, nvidia-smi -q."""
    # The bench's own record of the machine (common.tools.bench.machine.versions), and what it leaves out.
    versions = ('import json, platform, torch; from importlib import metadata; '
                'from common.tools.bench.machine import versions; '
                'print(json.dumps({**versions(), "python": platform.python_version(), '
                '"cudnn": torch.backends.cudnn.version(), "dali": [found.version for found in '
                'metadata.distributions() if (found.metadata["Name"] or "").startswith("nvidia-dali")]}))')
    commands = (("nvidia-smi",),
                ("nvidia-smi", "--query-gpu=name,uuid,driver_version,pstate,clocks.sm,clocks.max.sm,clocks.mem,"
                 "power.limit,temperature.gpu,clocks_event_reasons.active", "--format=csv"),
                (settings.python, "-c", versions), ("nproc",), ("uname", "-a"), ("nvidia-smi", "-q"))
    return Step("env", commands, "env.txt", 5, 0)


def gpu_test_files() -> List[str]:
    """The test files that mark a test `gpu`: pytest collects only these (seconds, not the whole suite's
    imports), and a file that cannot be collected on the GPU image stops none of the others."""
    return sorted(path.relative_to(REPO).as_posix() for path in (REPO / "tests").rglob("test_*.py")
                  if GPU_MARK.search(path.read_text(errors="replace")))


def tests_part(settings: Settings) -> Part:
    command = (settings.python, "-m", "pytest", *gpu_test_files(), "-m", "gpu", "-q", "-p", "no:randomly",
               "-p", "no:cacheprovider", "--continue-on-collection-errors")
    # 76 s and 32 s in the two pytest runs of the 2026-11-26 H200 session, with fewer gpu tests than now.
    return Part("tests", (Step("tests", (command,), "tests.log", 180, 90,
                               after=lambda: last_line(settings.out / "tests.log")),))


def profile_part(settings: Settings) -> Part:
    """The default step profiled; where --cuda-graphs exists, eager and graphed, one run each (its auto
    is one of the two: the run's own line says which)."""
    variants = [("eager", ("--cuda-graphs", "off")), ("graphs", ("--cuda-graphs", "on"))] if settings.cuda_graphs \
        else [("default", ())]
    steps = []
    for name, flags in variants:
        logdir = settings.scratch / "profile"
        command = (settings.python, *STEP_FLAGS, "--steps-per-epoch", "30", "--profile-steps", "10",
                   "--logdir", str(logdir), "--run-name", name, *flags)
        target = settings.out / f"profile-resnet50-b256-{name}-summary.txt"
        # 40 s: a guess (two processes' start, cuDNN's autotuning, 30 steps, the trace written); not timed yet.
        steps.append(Step(f"profile {name}", (command,), "profile.log", 40, 40,
                          after=lambda logdir=logdir, name=name, target=target: copy_profile(logdir / name, target)))
    return Part("profile", tuple(steps))


def graphs_part(settings: Settings) -> Part:
    """images/s of the default step eager then graphed, GRAPHS_REPEATS pairs (a pair a step, so a deadline
    leaves whole pairs and any drift lands on both alike), into graphs.csv."""
    if not settings.cuda_graphs:
        return Part("graphs", (), unavailable="imagenet_ddp_apex.py has no --cuda-graphs flag here")
    table = settings.out / "graphs.csv"
    steps = []
    for repeat in range(1, GRAPHS_REPEATS + 1):
        run_dirs = {mode: settings.scratch / "graphs" / f"{mode}-{repeat}" for mode in ("off", "on")}
        commands = tuple((settings.python, *STEP_FLAGS, "--steps-per-epoch", "50", "--cuda-graphs", mode,
                          "--logdir", str(run_dir.parent), "--run-name", run_dir.name)
                         for mode, run_dir in run_dirs.items())
        steps.append(Step(f"graphs pair {repeat}", commands, "graphs.log", 60, 60,
                          after=lambda run_dirs=run_dirs, repeat=repeat: "; ".join(
                              add_throughput_row(table, run_dir, mode, repeat) for mode, run_dir in run_dirs.items())))
    return Part("graphs", tuple(steps), after=lambda: graphs_note(table))


def bench_part(settings: Settings) -> Part:
    """Both sections' rows reach the CSV as they come: a bench stopped at the deadline keeps the ones done."""
    command = (settings.python, *BENCH_FLAGS, "--csv", str(settings.out / "bench.csv"))
    # 420 s: a guess, about 20 s for each of its 18 processes and the JPEGs made; 150 s: its train section.
    return Part("bench", (Step("bench", (command,), "bench.log", 420, 150,
                               after=lambda: last_line(settings.out / "bench.log")),))


def dali_missing() -> str:
    """Why the interpreter that runs the parts has no DALI ('' when it has one): the device tool's GPU image has
    none, and the decode part would then spend its time on JPEGs for rows that say so."""
    try:
        found = importlib.util.find_spec("nvidia.dali") is not None
    except (ImportError, ValueError):  # no `nvidia` package at all; a broken one
        found = False
    return "" if found else f"NVIDIA DALI is not installed for {sys.executable} (requirements-dali.txt)"


def decode_part(settings: Settings) -> Part:
    """DALI's decoders alone (whole files and the training's crops): what bounds the end-to-end dali row."""
    missing = dali_missing()
    if missing:
        return Part("decode", (), unavailable=missing)
    command = (settings.python, *DECODE_FLAGS, "--csv", str(settings.out / "bench-decode.csv"))
    # 90 s and 40 s: guesses (3 processes, 6 pipelines of 40 batches of 256 each, the JPEGs made); not timed yet.
    return Part("decode", (Step("decode", (command,), "bench-decode.log", 90, 40,
                                after=lambda: last_line(settings.out / "bench-decode.log")),))


def matrix_part(settings: Settings, deadline: Callable[[], float]) -> Part:
    """gpu_demo_matrix.sh starts a run only while MATRIX_RUN_SECONDS fit before the deadline, its first only while
    MATRIX_FIRST_RUN_SECONDS do (so its closing accuracy check still runs); then the run directories are copied
    without their checkpoints."""
    logdir = settings.scratch / "matrix"
    command = ("bash", "run_scripts/gpu_demo_matrix.sh")
    step = Step("matrix", (command,), "matrix.log",
                MATRIX_FIRST_RUN_SECONDS + (MATRIX_RUNS - 1) * MATRIX_RUN_SECONDS, MATRIX_FIRST_RUN_SECONDS,
                env={"PYTHON": settings.python, "LOGDIR": str(logdir), "RUN_SECONDS": str(MATRIX_RUN_SECONDS),
                     "FIRST_RUN_SECONDS": str(MATRIX_FIRST_RUN_SECONDS),
                     "MATRIX_DEADLINE": lambda: str(int(deadline()))},
                after=lambda: "; ".join(filter(None, (last_line(settings.out / "matrix.log"),
                                                      copy_note(copy_run_logs(logdir, settings.runs_copy))))))
    return Part("matrix", (step,))


def build_parts(names: Sequence[str], settings: Settings, deadline: Callable[[], float]) -> List[Part]:
    builders = {"tests": tests_part, "profile": profile_part, "graphs": graphs_part, "bench": bench_part,
                "decode": decode_part, "matrix": lambda settings: matrix_part(settings, deadline)}
    return [Part("env", (env_step(settings),))] + [builders[name](settings) for name in names]


# --- running them within the deadline ---

class Clock:
    """Seconds since the start, and what a step's run costs: a real clock runs the commands, a dry
    run's advances by each step's estimate (capped by the time left, as the real timeout caps it)."""

    def __init__(self, seconds: float, dry_run: bool, now: Callable[[], float] = time.monotonic):
        self.seconds, self.dry_run, self._now = seconds, dry_run, now
        self._start, self._simulated = now(), 0.0

    def elapsed(self) -> float:
        return self._simulated if self.dry_run else self._now() - self._start

    def left(self) -> float:
        """Time left for the parts: the deadline less RESERVE_SECONDS for the archive and the summary."""
        return self.seconds - RESERVE_SECONDS - self.elapsed()

    def wall_deadline(self) -> float:
        """The same as a time.time() value, for a child that watches it itself (gpu_demo_matrix.sh)."""
        return time.time() + self.left()

    def advance(self, seconds: float) -> None:
        self._simulated += seconds


def run_command(command: Sequence[str], env: Mapping[str, object], log, timeout: float) -> Optional[int]:
    """One command in its own process group, its output appended to `log`; its exit status, or None
    when it ran past `timeout` (its whole group stopped: SIGTERM, then SIGKILL after STOP_GRACE_SECONDS)."""
    log.write(f"$ {shlex.join(command)}\n")
    log.flush()
    variables = {name: value() if callable(value) else value for name, value in env.items()}
    try:
        process = subprocess.Popen(list(command), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONUNBUFFERED="1", **variables),
                                   start_new_session=True)
    except OSError as error:  # not installed here (nvidia-smi on a machine without the driver's tools)
        log.write(f"(could not start: {error.strerror})\n")
        return NOT_FOUND_EXIT_STATUS
    try:
        return process.wait(timeout=max(timeout, 0.001))
    except subprocess.TimeoutExpired:
        stop_group(process)
        log.write(f"\n(stopped at the deadline, after {timeout:.0f} s)\n")
        return None


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the command's process group (pytest's and the scripts' own children too), SIGKILL to
    what is left of it after STOP_GRACE_SECONDS; back once none of it runs (or a few seconds after)."""
    for stop, grace in ((signal.SIGTERM, STOP_GRACE_SECONDS), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, stop)
        except ProcessLookupError:
            return
        give_up = time.monotonic() + grace
        while time.monotonic() < give_up:
            process.poll()  # the leader reaped, so that only live members (or unreaped orphans) answer
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def run_step(step: Step, clock: Clock, out: Path) -> str:
    """A step's commands in turn, within the time left: 'ran', 'failed (exit N)' or 'stopped at the deadline'."""
    status = "ran"
    with open(out / step.log, "a") as log:
        if step.log == "env.txt" and log.tell() == 0:
            log.write(session_date() + "\n")
        for command in step.commands:
            code = run_command(command, step.env, log, clock.left())
            if code is None:
                return "stopped at the deadline"
            if code == DEADLINE_EXIT_STATUS:
                status = "stopped at the deadline"
            elif code != 0 and status == "ran" and step.log != "env.txt":  # env.txt: whatever answers
                status = f"failed (exit {code})"
    return status


def run_part(part: Part, clock: Clock, out: Path, show: Callable[[str], None]) -> Outcome:
    """A part's steps in turn, each started only with its least time left; the outcome for the summary."""
    outcome, started, statuses = Outcome(part.name, "skipped"), clock.elapsed(), []
    if part.unavailable:
        outcome.notes.append(part.unavailable)
        show(f"[{started:4.0f} s] {part.name}: skipped: {part.unavailable}")
        return outcome
    for step in part.steps:
        left = clock.left()
        if left < step.least_seconds:
            outcome.notes.append(f"{step.label} needs at least {step.least_seconds:.0f} s, {max(left, 0):.0f} s left")
            show(f"[{clock.elapsed():4.0f} s] {step.label}: skipped: {outcome.notes[-1]}")
            continue
        show(f"[{clock.elapsed():4.0f} s] {step.label}: about {step.estimate_seconds:.0f} s, {left:.0f} s left"
             f" (into {step.log})")
        for line in shown_commands(step):
            show("    " + line)
        if clock.dry_run:
            clock.advance(min(step.estimate_seconds, left))
            statuses.append("would run" if step.estimate_seconds <= left else "would stop at the deadline")
            continue
        statuses.append(run_step(step, clock, out))
        note = step.after() if step.after is not None else ""
        if note:
            outcome.notes.append(note)
    outcome.status = part_status(statuses, len(part.steps))
    if part.after is not None and not clock.dry_run and statuses:
        outcome.notes.append(part.after())
    outcome.seconds = clock.elapsed() - started
    return outcome


def shown_commands(step: Step) -> List[str]:
    """The step's commands as a shell would take them, its variables before the first (a deadline
    computed when the step starts shown as <deadline>)."""
    variables = [f"{name}=<deadline>" if callable(value) else f"{name}={shlex.quote(value)}"
                 for name, value in step.env.items()]
    lines = [shlex.join(command) for command in step.commands]
    return [" ".join(variables + lines[:1])] + lines[1:]


def part_status(statuses: Sequence[str], steps: int) -> str:
    """One status for a part from its steps' (the first failure or stop wins)."""
    if not statuses:
        return "skipped"
    trouble = next((status for status in statuses if status not in ("ran", "would run")), None)
    if trouble:
        return trouble
    done = statuses[0] if len(statuses) == steps else f"partial ({len(statuses)} of {steps} steps)"
    return done


# --- the command line ---

def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpu_check.py", formatter_class=argparse.RawDescriptionHelpFormatter,
                     description=__doc__.split("\n\n")[0],
                     epilog="Exit status: 0 no part failed, 1 one did, 2 a mistake or no CUDA GPU "
                            "(docs/tests.md#the-gpu-record-in-one-call)")
    parser.add_argument("parts", nargs="*", type=_part, metavar="PART",
                        help=f"the parts to run, in this order (default: {' '.join(PARTS)}); env always runs first")
    parser.add_argument("--seconds", type=_seconds, default=DEFAULT_SECONDS, metavar="N",
                        help=f"the deadline, from the start (default {DEFAULT_SECONDS}: one 10-minute call of the "
                             f"device tool with a minute to spare; at most {MAX_SECONDS}). gpu_check.sh: "
                             f"GPU_CHECK_SECONDS")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="the output folder (default results/gpu-<kind>-<date>/). gpu_check.sh: $OUT, with --pack")
    parser.add_argument("--pack", action="store_true",
                        help="leave only the summary and one archive in --out (the device tool brings back "
                             f"{MAX_TRANSFER_FILES} files at most); extract it at the repository's root")
    parser.add_argument("--dry-run", action="store_true",
                        help="print each step's commands and the deadline arithmetic (each step taking its "
                             "estimate); run nothing, need no GPU. gpu_check.sh: GPU_CHECK_DRY_RUN=1")
    parser.add_argument("--kind", type=_kind, default=None, metavar="NAME",
                        help="the GPU's short name in the folder's name (default: from the GPU's, e.g. h100)")
    return parser


def _part(text: str) -> str:
    if text not in PARTS:  # argparse's choices refuse nargs="*"'s empty default on Python 3.11 and older
        raise argparse.ArgumentTypeError(f"unknown part {text!r} (choose from {', '.join(PARTS)})")
    return text


def _kind(text: str) -> str:
    if not re.fullmatch(r"[a-z0-9]{1,32}", text):  # a part of a folder's name, nothing more
        raise argparse.ArgumentTypeError(f"expected lower-case letters and digits like h100, got {text!r}")
    return text


def _seconds(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected whole seconds from 1 to {MAX_SECONDS}, got {text!r}")
    return value


def gpu_kind(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA A100-SXM4-80GB' -> 'a100', 'Tesla V100-SXM2-16GB' -> 'v100'."""
    words = [word for word in name.split() if word.upper() not in ("NVIDIA", "TESLA", "GEFORCE")] or ["gpu"]
    return "".join(character for character in words[0].split("-")[0].lower() if character.isalnum()) or "gpu"


def visible_gpu() -> Optional[str]:
    """The first CUDA GPU's name, or None where torch sees none; a UsageError where there is no torch (a dry run
    too: the scripts' parser, which has_cuda_graphs_flag reads, lists torchvision's models)."""
    try:
        import torch
    except ImportError:  # gpu_check.sh's python3 where there is no .venv: one line, not a traceback
        raise UsageError(f"torch is not installed for {sys.executable} (gpu_check.sh: set PYTHON to a python "
                         f"that has it)") from None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def has_cuda_graphs_flag() -> bool:
    """Whether the scripts' parser has --cuda-graphs yet (common.flags, torch-free)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from common import flags

    return any("--cuda-graphs" in action.option_strings for action in flags.build_parser("ddp_apex")._actions)


def make_folder(out: Path) -> None:
    """--out made (with its parents), or one line saying why it cannot be."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"argument --out: {out} is a file, not a folder") from None
    except OSError as error:
        raise UsageError(f"argument --out: cannot create {out} ({error.strerror})") from None


def main(argv: Optional[Sequence[str]] = None, gpu_name: Callable[[], Optional[str]] = visible_gpu,
         show: Callable[[str], None] = functools.partial(print, flush=True)) -> int:
    """Exit status: 0 no part failed, 1 one did; a UsageError for main's caller to print."""
    args = build_parser().parse_args(argv)
    # From here, not after torch is imported and CUDA starts to name the GPU (seconds, more on a cold machine):
    # the device tool's timeout_s counts them too.
    clock = Clock(args.seconds, args.dry_run)
    names = list(dict.fromkeys(args.parts or PARTS))
    gpu = gpu_name()
    if gpu is None and not args.dry_run:
        raise UsageError(f"no CUDA GPU is visible to {sys.executable} (torch.cuda.is_available() is False); "
                         f"--dry-run shows what would run")
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    kind_folder = f"gpu-{args.kind or gpu_kind(gpu or 'unknown')}-{date}"
    out = (args.out or REPO / "results" / kind_folder).resolve()
    settings = Settings(sys.executable, out, REPO / "results" / "runs" / f"gpu-{date}",
                        REPO / "runs" / "gpu-check" / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S"),
                        has_cuda_graphs_flag())
    parts = build_parts(names, settings, clock.wall_deadline)
    show(f"gpu_check: {'dry run, ' if args.dry_run else ''}{gpu or 'no GPU'}; deadline {args.seconds} s, "
         f"{RESERVE_SECONDS} s of it kept for the summary; output: {out}")
    if not args.dry_run:
        make_folder(out)
    outcomes = [run_part(part, clock, out, show) for part in parts]
    header = (f"gpu_check {' '.join(names)}: {gpu or 'no GPU'}, {session_date()}, deadline {args.seconds} s"
              + (" (dry run: each step taking its estimate)" if args.dry_run else ""))
    text = summary_text(outcomes, header)
    show(text)
    if args.dry_run and args.out is None:
        return 0
    make_folder(out)
    summary = out / f"summary-{'-'.join(names)}.txt"
    summary.write_text(text)
    if args.pack and not args.dry_run:
        runs = settings.runs_copy if "matrix" in names else None
        show(f"packed: {pack(out, summary, runs, kind_folder)} (tar -xzf it at the repository's root)")
    return 1 if any(outcome.status.startswith("failed") for outcome in outcomes) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UsageError as error:
        print(f"gpu_check.py: error: {error}", file=sys.stderr)
        sys.exit(2)
