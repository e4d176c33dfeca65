"""Ray: an entry script's own training run by Ray Train on a Ray cluster
(run_scripts/ray_train.py), or many of them searched by Ray Tune
(run_scripts/ray_tune.py). The driver's side lives here: reading the
launcher's own flags, connecting to a cluster or starting one on this
machine (and stopping it again), and the `TorchTrainer` whose workers run
the script's `main` unchanged. In each worker common.launcher finds Ray
Train's context and common.rendezvous adopts the process group Ray has joined; the run
directory, checkpoints and `--resume auto` are the project's own.

Ray is optional (requirements-ray.txt): it is imported only here, when a
Ray launcher runs, and a missing package is one line saying what to install.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import logging
import math
import os
import re
import secrets
import shlex
import socket
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from common import cli, launcher
from common.arguments import positive_float
from common.config import Config
from common.errors import (FAILED_EXIT_STATUS, PEER_LOST_EXIT_STATUS, USAGE_EXIT_STATUS, ReportedError, UsageError,
                           error_summary, report, without_credentials)

RAY_REQUIREMENTS = "requirements-ray.txt"
REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {"imagenet_ddp.py": "ddp", "imagenet_ddp_apex.py": "ddp_apex"}  # the scripts with a process group
ADDRESS_CHECK_SECONDS = 5.0
# Ray prints its own progress and warnings by the line: its loggers in the workers and the controller
# say only errors, so the console reads as under torchrun (Ray's log files keep everything).
RAY_LOG_LEVEL = "ERROR"

LOST_A_PEER = "lost the connection to another worker, which failed first"

WorkerCount = Union[int, Tuple[int, int]]


# Read by Ray when it is imported (the driver) or starts a process (the workers):
RAY_ENVIRONMENT = {
    # Each of the script's progress lines differs from the last only in numbers: Ray's deduplication of
    # similar lines would fold them into "[repeated 2x across cluster]".
    "RAY_DEDUP_LOGS": "0",
    "RAY_COLOR_PREFIX": "0",  # no colour codes in log files
    # Ray's own loggers in every process of the job say errors only: its controller's lines on each
    # resource request and worker-group start would outnumber the script's. failure_notes says what
    # matters (a failed worker, a restart); Ray's log files keep everything.
    "RAY_LOGGER_LEVEL": "error",
}
# ... and by each worker: Ray Train turns print() into log records, which reach the console a second time.
WORKER_ENVIRONMENT = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}


def import_ray():
    """The ray module with Train and Tune, or one line saying what to install."""
    for name, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    try:
        import ray
        import ray.train  # noqa: F401
        import ray.train.torch  # noqa: F401
        import ray.tune  # noqa: F401
    except ImportError as error:
        raise UsageError(f"Ray is not installed ({error_summary(error)}): pip install -r {RAY_REQUIREMENTS}") from None
    return ray


def worker_count(text: str) -> WorkerCount:
    """--num-workers: N, or MIN-MAX for Ray's elastic range."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if not match:
        raise UsageError(f"argument --num-workers: expected N or MIN-MAX (e.g. 4 or 2-8), got {text!r}")
    low, high = int(match.group(1)), int(match.group(2) or match.group(1))
    if low < 1:
        raise UsageError(f"argument --num-workers: at least 1 worker, got {text!r}")
    if high < low:
        raise UsageError(f"argument --num-workers: MIN-MAX needs MIN <= MAX, got {text!r}")
    return low if match.group(2) is None else (low, high)


@dataclasses.dataclass(frozen=True)
class ScriptRun:
    """The training command after `--`: an entry script with a process group and its flags."""

    path: Path
    mode: str
    argv: Tuple[str, ...]
    cfg: Config

    def command(self, extra: Sequence[str] = ()) -> List[str]:
        return [self.path.name, *self.argv, *extra]

    @staticmethod
    def parsed(path: Path, mode: str, argv: Sequence[str]) -> "ScriptRun":
        """`argv` checked by the script's own parser, with no flag that a launcher sets."""
        cfg = cli.parse(mode, list(argv))
        launcher.check_launcher_flags(cfg, launcher.RAY_STARTS_THE_PROCESSES, local_rank_too=True)
        return ScriptRun(path, mode, tuple(argv), cfg)

    def with_flags(self, extra: Sequence[str]) -> "ScriptRun":
        return ScriptRun.parsed(self.path, self.mode, (*self.argv, *extra))


def script_run(words: Sequence[str]) -> ScriptRun:
    """Check the command after `--` here, before Ray starts: the script, its
    flags (the script's own parser), and no flag that a launcher sets."""
    if not words:
        raise UsageError("expected the training command after `--`, e.g. -- imagenet_ddp.py -a resnet50 DATA")
    script = Path(words[0])
    if script.name not in SCRIPTS:
        raise UsageError(f"the command after `--` must start with {' or '.join(SCRIPTS)} (the scripts with a "
                         f"process group), got {words[0]!r}")
    path = script if script.is_file() else REPO / script.name
    if not path.is_file():
        raise UsageError(f"no such script: {words[0]}")
    return ScriptRun.parsed(path.resolve(), SCRIPTS[script.name], words[1:])


def on_devices(run: ScriptRun, use_gpu: bool) -> ScriptRun:
    """The training command as Ray places it: with --use-gpu each worker has
    one GPU of its own (NCCL); without, the CPU, even where the machine has
    GPUs that Ray gave no worker (--device auto would take them)."""
    cfg = run.cfg
    if use_gpu and cfg.device == "cpu":
        raise UsageError("argument --use-gpu: the training command says --device cpu; drop one of them")
    if not use_gpu and cfg.device == "cuda":
        raise UsageError("argument --device: cuda needs the launcher's --use-gpu (Ray gives a worker a GPU only then)")
    if not use_gpu and cfg.dist_backend == "nccl":
        raise UsageError("argument --dist-backend: nccl needs the launcher's --use-gpu")
    return run if use_gpu or cfg.device == "cpu" else run.with_flags(["--device", "cpu"])


def check_restarts(run: ScriptRun, max_failures: int, count: WorkerCount) -> None:
    """A worker group Ray starts again runs the command again: only --resume
    auto makes it continue the run (another would start over, or stop at its
    --run-name's existing directory)."""
    if run.cfg.resume == "auto":
        return
    if max_failures > 0:
        raise UsageError("argument --max-failures: Ray restarts the training command after a failure, which "
                         "continues only with --resume auto in it; add --resume auto after `--`")
    if not isinstance(count, int):
        raise UsageError("argument --num-workers: an elastic run restarts the training command at each resize, "
                         "which continues only with --resume auto in it; add --resume auto after `--`")


RAY_CLIENT_PORT = 10001  # ray://HOST without a port: Ray Client's default


def check_address(address: str, source: str = "argument --address") -> None:
    """An unreachable --address (or RAY_ADDRESS) is one line now, not Ray's minutes of retries."""
    if address in ("auto", "local"):
        return
    match = re.fullmatch(r"(ray://)?(\[[^\]]+\]|[^:/\[\]]+)(?::(\d+))?", address)
    if not match or not (match.group(3) or match.group(1)):
        raise UsageError(f"{source}: expected HOST:PORT of the Ray head (or ray://HOST[:PORT], auto), got {address!r}")
    host, port = match.group(2).strip("[]"), int(match.group(3) or RAY_CLIENT_PORT)
    try:
        socket.create_connection((host, port), timeout=ADDRESS_CHECK_SECONDS).close()
    except OSError as error:
        raise UsageError(f"{source}: cannot reach the Ray head at {host}:{port} "
                         f"({error.strerror or error}); is `ray start --head` running there?") from None


class Cluster:
    """Connected to a Ray cluster for the `with` block: the one at `address`
    (or RAY_ADDRESS), else a new one on this machine sized to it, stopped at
    the end with every process it started."""

    def __init__(self, address: Optional[str], environ=os.environ):
        self.address = launcher.ray_head_address(address, environ)
        self.source = "argument --address" if address else "environment variable RAY_ADDRESS"
        if self.address:
            check_address(self.address, self.source)  # before Ray is imported: nothing has started
        self.ray = import_ray()

    def __enter__(self) -> "Cluster":
        pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        environment = {**RAY_ENVIRONMENT, **WORKER_ENVIRONMENT, "PYTHONPATH": pythonpath}
        try:
            # "local": a new cluster, even where one already runs on this machine (None would join that one).
            self.ray.init(address=self.address or "local", logging_level=logging.ERROR,
                          log_to_driver=True, runtime_env={"env_vars": environment})
        except Exception as error:  # ConnectionError, AuthenticationError (no token), RuntimeError: one story
            where = f"join the Ray cluster at {self.address}" if self.address else "start a Ray cluster here"
            hint = "; set RAY_AUTH_TOKEN to its token" if "token" in str(error).lower() else ""
            raise UsageError(f"{self.source if self.address else 'ray'}: could not {where} "
                             f"({error_summary(error)}){hint}") from None
        return self

    def __exit__(self, *exc_info) -> None:
        self.ray.shutdown()  # a cluster this process started stops with it; one it joined goes on

    @property
    def started_here(self) -> bool:
        return self.address in (None, "local")

    def resources(self) -> Dict[str, float]:
        return self.ray.cluster_resources()

    def where(self) -> str:
        have = self.resources()
        size = f"{have.get('CPU', 0):g} CPUs, {have.get('GPU', 0):g} GPUs"
        return f"a new Ray cluster on this machine ({size})" if self.started_here else \
            f"the Ray cluster at {without_credentials(self.address)} ({size})"


def describe(count: WorkerCount) -> str:
    return f"{count} worker(s)" if isinstance(count, int) else f"{count[0]} to {count[1]} workers (elastic)"


def trainer(run: ScriptRun, num_workers: WorkerCount, use_gpu: bool, max_failures: int, cpus_per_worker: float,
            name: str, storage: str, callbacks: Sequence = (), launcher: str = "ray_train.py",
            cwd: Optional[str] = None):
    """Ray Train's TorchTrainer for `run`: each worker calls the script's
    main() with its flags (train_loop), in the launcher's working directory
    `cwd` (default: this process's), where its relative paths point."""
    import_ray()
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    cfg = run.cfg
    torch_config = TorchConfig(backend=cfg.dist_backend or ("nccl" if use_gpu else "gloo"),
                               timeout_s=math.ceil(cfg.dist_timeout))
    return TorchTrainer(
        train_loop, train_loop_config={"script": str(run.path), "mode": run.mode, "argv": list(run.argv),
                                       "cwd": cwd or os.getcwd()},
        torch_config=torch_config,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": cpus_per_worker, **({"GPU": 1} if use_gpu else {})}),
        run_config=RunConfig(name=name, storage_path=storage, failure_config=FailureConfig(max_failures),
                             callbacks=[failure_notes(launcher, max_failures), *callbacks],
                             logging_config=LoggingConfig(log_level=RAY_LOG_LEVEL)))


def run_name(prefix: str = "imagenet") -> str:
    """A Ray run name of its own for each launch: Ray restores the state of an
    earlier run with the same name and storage, which a new run must not
    inherit (--resume auto continues within this launch, across its restarts)."""
    host = socket.gethostname().split(".")[0]
    return f"{prefix}-{datetime.datetime.now().strftime('%b%d_%H-%M-%S')}-{host}-{secrets.token_hex(2)}"


def check_resources(cluster: Cluster, num_workers: WorkerCount, use_gpu: bool, cpus_per_worker: float,
                    flag: str = "--num-workers", extra_cpus: float = 0.0) -> None:
    """On a cluster this launcher started, a request it can never meet is an
    error now, where Ray would wait for ever (an autoscaling cluster may grow:
    there Ray waits). `extra_cpus`: what else the run holds (a Tune trial's own)."""
    have = cluster.resources()
    fewest = num_workers if isinstance(num_workers, int) else num_workers[0]
    if use_gpu and have.get("GPU", 0) < 1:
        raise UsageError("argument --use-gpu: the Ray cluster has no GPU")
    if not cluster.started_here:
        return
    need = {"CPU": fewest * cpus_per_worker + extra_cpus, "GPU": float(fewest) if use_gpu else 0.0}
    for kind, amount in need.items():
        if have.get(kind, 0) < amount:
            raise UsageError(f"argument {flag}: {fewest} worker(s) need {amount:g} {kind}s and this machine's Ray "
                             f"cluster has {have.get(kind, 0):g}")


def runs_at_once(cluster: Cluster, workers: int, use_gpu: bool, cpus_per_worker: float, extra_cpus: float) -> int:
    """How many runs of `workers` workers the cluster holds at the same time (at least 1)."""
    have = cluster.resources()
    fits = have.get("CPU", 0) // (workers * cpus_per_worker + extra_cpus)
    if use_gpu:
        fits = min(fits, have.get("GPU", 0) // workers)
    return max(1, int(fits))


def is_training_failure(error: BaseException) -> bool:
    """Whether `error` is Ray Train giving up on the run (its workers failed
    more often than --max-failures allows), not a fault of this driver."""
    from ray.train import TrainingFailedError
    return isinstance(_cause(error), TrainingFailedError)


def _cause(error: BaseException) -> BaseException:
    """What a Ray task raised, unwrapped (a Tune trial's error comes as Ray's RayTaskError)."""
    return getattr(error, "cause", None) or error


def _worker_failures(error: BaseException) -> Dict[int, BaseException]:
    """Rank -> exception of a run Ray Train gave up on (Tune hands it over wrapped)."""
    return getattr(_cause(error), "worker_failures", None) or {}


def _script_said(failure: BaseException) -> Tuple[Optional[int], str]:
    """(exit status, line) of a worker's failure that the script itself
    reported (a UsageError: 2; a NaN loss: 3; ...), else (None, its summary)."""
    if isinstance(failure, ScriptUsageError):  # also when Ray hands it over wrapped (a subclass of both)
        return USAGE_EXIT_STATUS, error_summary(failure)
    status = re.search(r"the training script exited with status (\d+)", str(failure))
    if isinstance(failure, ScriptExit) and status:
        return int(status.group(1)), status.group(0)
    return None, error_summary(failure)


def failed_workers(worker_errors: Dict[int, BaseException]) -> str:
    """The failed workers' ranks and why, those that only lost a peer last: the others say what happened."""
    found = [(rank, _script_said(error)[1]) for rank, error in worker_errors.items()]
    found.sort(key=lambda pair: (LOST_A_PEER in pair[1], pair[0]))
    return "; ".join(f"worker rank {rank}: {why}" for rank, why in found)


def how_it_ended(error: BaseException) -> Tuple[int, str]:
    """(exit status, one line) for a run Ray gave up on: a UsageError a
    worker met is that line and status 2; a status the script chose (3 for a
    NaN loss, 74 for a checkpoint it could not write) is kept; otherwise 1
    and the failed workers."""
    if isinstance(_cause(error), UsageError):  # met before any worker started (a Tune trial's own flags)
        return USAGE_EXIT_STATUS, str(_cause(error))
    failures = _worker_failures(error)
    for failure in sorted(failures.values(), key=lambda failure: LOST_A_PEER in str(failure)):
        status, line = _script_said(failure)
        if status == USAGE_EXIT_STATUS:
            return status, line
        if status is not None and status != PEER_LOST_EXIT_STATUS:
            return status, f"training failed ({failed_workers(failures)})"
    return FAILED_EXIT_STATUS, \
        f"training failed ({failed_workers(failures) if failures else error_summary(_cause(error))})"


def failure_notes(launcher: str, max_failures: int):
    """A Ray Train callback (run by its controller, whose output reaches this
    console) that says which worker failed and whether Ray starts the group
    again: Ray's own loggers say errors only (RAY_ENVIRONMENT)."""
    from ray.train import UserCallback

    class FailureNotes(UserCallback):
        def __init__(self):
            self.failures = 0

        def after_exception(self, run_context, worker_exceptions) -> None:
            what = failed_workers(worker_exceptions)
            if any(_preempted(error) for error in worker_exceptions.values()):
                # Ray counts these apart (FailureConfig.max_preemption_failures, unlimited by default).
                print(f"{launcher}: {what}; a preempted node: Ray starts the worker group again (preemptions do "
                      f"not count against --max-failures)", flush=True)
                return
            self.failures += 1
            then = (f"Ray starts the worker group again ({self.failures} of --max-failures {max_failures})"
                    if self.failures <= max_failures else "no restart left (--max-failures)")
            print(f"{launcher}: {what}; {then}", flush=True)

    return FailureNotes()


def _preempted(error: BaseException) -> bool:
    """Whether Ray says a worker died because its node was preempted (its
    private helper; False where a Ray version lacks it)."""
    try:
        from ray.train.v2._internal.execution.worker_group.poll import _is_preempted_actor
        return bool(_is_preempted_actor(error))
    except Exception:  # noqa: BLE001 - an internal of Ray's that may move
        return False


def tune_trial(run: ScriptRun, workers: int, use_gpu: bool, cpus_per_worker: float, search_name: str, storage: str):
    """Ray Tune's trial function: one Ray Train run of `run` with the
    trial's flags, in a run directory of its own (<search>-<trial id>), its
    epochs' reports passed on to Tune. Its workers run where ray_tune.py was
    started (Tune moves each trial into a folder of its own)."""
    launched_in = os.getcwd()

    def trial(config: dict) -> None:
        from ray import tune
        from ray.tune.integration.ray_train import TuneReportCallback
        os.chdir(launched_in)  # DATA and --logdir relative to it: checked here by the script's parser too
        name = f"{search_name}-{tune.get_context().get_trial_id()}"
        trainer(run.with_flags(trial_flags(config, name)), workers, use_gpu, 0, cpus_per_worker, name, storage,
                callbacks=[TuneReportCallback()], launcher="ray_tune.py", cwd=launched_in).fit()
    return trial


def trial_flags(config: dict, run_name: Optional[str] = None) -> List[str]:
    """A trial's flags for the script: --FLAG VALUE for each searched flag (and its --run-name)."""
    flags = [word for flag, value in sorted(config.items()) for word in (f"--{flag}", str(value))]
    return flags + (["--run-name", run_name] if run_name else [])


def trials_table(results, run: ScriptRun, search_name: str, metric: str, mode: str, launcher_flags: Sequence[str]):
    """One row per trial (pandas): its flags, how it ended (and its exit
    status, as ray_train.py would end: 0 unless it failed), its last and
    best --metric, its run directory and the command that runs it again
    (ray_train.py with `launcher_flags`); `best` marks the best trial that
    did not fail."""
    import pandas as pd
    rows = []
    for result in results:
        history = result.metrics_dataframe if result.metrics_dataframe is not None else pd.DataFrame()
        values = history[metric].dropna() if metric in history else pd.Series(dtype=float)
        trial_id = Path(result.path).name  # ray_tune.py names each trial's folder by its id
        epochs = len(values)
        trial_cfg = run.with_flags(trial_flags(result.config)).cfg  # --epochs may be searched
        reached = trial_cfg.desired_acc is not None and "val_top1" in history and \
            history["val_top1"].max() >= trial_cfg.desired_acc
        status, ended = how_it_ended(result.error) if result.error is not None else (0, None)
        if result.error is not None:
            ended = f"failed: {ended}"
        else:
            ended = "finished" if epochs >= trial_cfg.epochs or reached else "stopped early"
        command = ["python", ray_train_path(), *launcher_flags, "--", *run.command(trial_flags(result.config))]
        rows.append({"trial": trial_id, **{f"--{flag}": value for flag, value in sorted(result.config.items())},
                     "ended": ended, "exit_status": status, "epochs": epochs,
                     f"last_{metric}": values.iloc[-1] if epochs else math.nan,
                     f"best_{metric}": (values.max() if mode == "max" else values.min()) if epochs else math.nan,
                     "run_dir": str(Path(run.cfg.logdir).resolve() / f"{search_name}-{trial_id}"),
                     "command": " ".join(shlex.quote(word) for word in command)})
    table = pd.DataFrame(rows)
    table["best"] = False
    scores = table[f"best_{metric}"].where(~table["ended"].str.startswith("failed")) if rows else pd.Series(dtype=float)
    if scores.notna().any():
        table.loc[scores.idxmax() if mode == "max" else scores.idxmin(), "best"] = True
    return table


# --- the launchers' command lines ---

def ray_train_path() -> str:
    """run_scripts/ray_train.py as a command typed here would name it: relative inside the repository."""
    path = os.path.relpath(REPO / "run_scripts" / "ray_train.py")
    return path if not path.startswith("..") else str(REPO / "run_scripts" / "ray_train.py")


def add_cluster_flags(parser) -> None:
    """The flags ray_train.py and ray_tune.py share."""
    parser.add_argument("--address", metavar="HOST:PORT",
                        help="the Ray cluster's head (or auto); default RAY_ADDRESS, else a new cluster on this "
                             "machine, stopped at the end")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker (NCCL)")
    parser.add_argument("--cpus-per-worker", type=positive_float, default=1.0, metavar="C",
                        help="CPUs Ray reserves for each worker: its data-loading processes use them (default 1)")
    parser.add_argument("--storage", metavar="DIR", type=storage_path, default=storage_path("~/ray_results"),
                        help="where Ray keeps its own record of each run (default ~/ray_results); the run "
                             "directories stay under the script's --logdir")


def storage_path(text: str) -> str:
    """--storage: a folder, made absolute here (Ray's storage reads it as a URI, and a trial runs
    elsewhere), or a URI of Ray's storage as it is (s3://bucket/path)."""
    return text if "://" in text else str(Path(text).expanduser().resolve())


def split_command(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(the launcher's flags, the training command after `--`, which
    script_run requires; without `--`, --help still answers)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


# --- in each Ray Train worker ---

class ScriptUsageError(Exception):
    """A UsageError in a worker (its one line), carried to the driver."""


class ScriptExit(RuntimeError):
    """The script's own exit status in a worker (a NaN loss: 3), carried to the driver."""


def train_loop(config: dict) -> None:
    """Ray Train's training function: the entry script's main() with its
    flags, in the driver's working directory (Ray starts workers elsewhere),
    where common.launcher finds Ray's context and joins no group of its own."""
    if os.path.isdir(config["cwd"]):
        os.chdir(config["cwd"])
    # Ray Train sets the root logger to INFO (Python's default is WARNING), and logs each report there.
    logging.getLogger().setLevel(logging.WARNING)
    sys.argv = [config["script"], *config["argv"]]  # error lines start with the script's name
    spec = importlib.util.spec_from_file_location(f"imagenet_{config['mode']}", config["script"])
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    try:
        script.main(config["argv"])
    except UsageError as error:  # one line, not a traceback, on the driver's console
        raise ScriptUsageError(str(error)) from None
    except ReportedError as error:  # its line here, and its own status (a batch that did not come: 5)
        report(error)
        raise ScriptExit(f"the training script exited with status {error.status}") from None
    except SystemExit as stop:  # a stop the script says itself (a NaN loss: exit 3); Ray sees a failure
        if stop.code == PEER_LOST_EXIT_STATUS:
            raise RuntimeError(LOST_A_PEER) from None
        if stop.code not in (None, 0):
            raise ScriptExit(f"the training script exited with status {stop.code}") from None
