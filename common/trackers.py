"""Experiment trackers (--tracker mlflow, --tracker wandb): a run's
parameters, per-epoch figures and reports also sent to MLflow or Weights &
Biases, beside its run directory, never instead of it. Called by
common.telemetry.RunLog on the primary process only.

- Parameters: config.json's record flattened (`flat_parameters`: options.arch,
  resolved.global_batch_size, ...), without the per-start fields (the
  command, times, the checkpoint resumed from) and without any environment
  variable.
- Metrics: each metrics.csv row's numeric columns, named <split>_<column>
  (train_loss, val_top1, val_ema_top1), at step = the row's epoch.
- Artifacts at the run's end: config.json, resumes.jsonl, metrics.csv, the
  per-class reports, bad_images.csv and figures/, those the run directory has.
- Resume: each tracker's run id is kept in the run directory's trackers.json,
  so `--resume` (auto, a requeue) continues the same tracked run.
- A tracker that fails (a server that does not answer or refuses, any
  exception of its library) is one warning line and is left off for the rest
  of the run; training goes on. MLflow's HTTP calls are bounded for this
  process (MLFLOW_HTTP_BOUNDS, unless the user set them), W&B's start by
  WANDB_INIT_TIMEOUT_SECONDS: a tracker never holds training for long.

Each library is imported only when its tracker is made (cli checks that it is
installed, before training starts). No torch.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from common.errors import error_summary, one_line, without_credentials
from common.files import atomic_write

RUN_IDS_NAME = "trackers.json"  # in the run directory: each tracker's run, for a resume to continue
ARTIFACT_NAMES = ("config.json", "resumes.jsonl", "metrics.csv", "val_report.csv", "val_report_best.csv",
                  "bad_images.csv")
FIGURES_FOLDER = "figures"
# config.json's fields that describe one start of the run, not the run: left out of the parameters (a
# resume's are in resumes.jsonl, an artifact). The command line is left out too: it is the user's text.
PER_START_FIELDS = ("command", "started", "start_epoch", "start_step", "resumed_from")
MAX_PARAMETER_CHARS = 6000  # MLflow refuses longer parameter values (its MAX_PARAM_VAL_LENGTH)
# MLflow's HTTP requests, unless the user set these: 10 s per attempt, 2 retries with 1 s then 2 s of back-off,
# so one call gives up within about 35 s (MLflow's defaults: 120 s and 7 retries with factor 2, some minutes).
MLFLOW_HTTP_BOUNDS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                      "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
# Without MLFLOW_TRACKING_URI: a SQLite store and its artifacts in the run directory's mlflow/ folder. The run
# directory stays the one place that holds a run (copied, its tracking goes along; a resume finds it there), runs
# never share one SQLite file, and the tools that walk --logdir do not descend into a run directory, so they never
# take the artifacts' copies of config.json and metrics.csv for runs. Several runs in one view: a server.
MLFLOW_DEFAULT_FOLDER = "mlflow"
MLFLOW_EXPERIMENT = "imagenet"  # the experiment, unless MLFLOW_EXPERIMENT_NAME names one
WANDB_INIT_TIMEOUT_SECONDS = 60.0
# How a tracked run ends, in MLflow's run statuses (W&B: exit code 0 for FINISHED, else 1). STOPPED: to be
# continued (a signal, exit 74 or 3); FAILED: an error ended the run, which would otherwise stay RUNNING for good.
FINISHED, STOPPED, FAILED = "FINISHED", "KILLED", "FAILED"


def flat_parameters(record: dict) -> Dict[str, str]:
    """config.json's (or a resumes.jsonl line's) record as tracker parameters:
    nested keys joined by '.', every value a string (a string as it is,
    anything else as JSON: 32, null, true, [30, 60]), cut to MAX_PARAMETER_CHARS."""
    flat: Dict[str, str] = {}

    def add(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                add(f"{prefix}.{key}" if prefix else str(key), inner)
            return
        text = value if isinstance(value, str) else json.dumps(value)
        flat[prefix] = text if len(text) <= MAX_PARAMETER_CHARS else text[:MAX_PARAMETER_CHARS - 3] + "..."

    add("", {key: value for key, value in record.items() if key not in PER_START_FIELDS})
    return flat


def epoch_values(row: dict) -> Dict[str, float]:
    """A metrics.csv row (EpochMetrics as a dict) as tracker metrics: each
    numeric column but the epoch, named <split>_<column>; empty ones left out."""
    return {f"{row['split']}_{column}": float(value) for column, value in row.items()
            if column not in ("epoch", "split") and isinstance(value, (int, float)) and not isinstance(value, bool)}


def artifacts(run_dir: Path) -> List[Path]:
    """The files of the run directory a tracker keeps, those it has, and its figures/ folder's files."""
    files = [run_dir / name for name in ARTIFACT_NAMES if (run_dir / name).is_file()]
    figures = run_dir / FIGURES_FOLDER
    if figures.is_dir():
        files += sorted(path for path in figures.rglob("*") if path.is_file())
    return files


class MlflowTracker:
    """One MLflow run, through MlflowClient (no fluent API: no active run
    kept in the process)."""

    name = "mlflow"

    def __init__(self, run_dir: Path, run_id: Optional[str], parameters: Dict[str, str]):
        for variable, value in MLFLOW_HTTP_BOUNDS.items():
            os.environ.setdefault(variable, value)  # MLflow reads them at each request
        import mlflow
        from mlflow.environment_variables import MLFLOW_EXPERIMENT_NAME, MLFLOW_TRACKING_URI
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
        # Its store's set-up lines ("Creating initial MLflow database tables...") would sit among the run's own on
        # stderr at every first start: only its warnings and errors are said.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)

        self._metric = Metric
        default_store = not MLFLOW_TRACKING_URI.is_set()
        store = run_dir.resolve() / MLFLOW_DEFAULT_FOLDER
        if default_store:
            store.mkdir(exist_ok=True)
        self.where = f"sqlite:///{store / 'mlflow.db'}" if default_store else mlflow.get_tracking_uri()
        self.client = MlflowClient(self.where)
        known = {}
        if run_id is not None:
            try:
                self.client.update_run(run_id, status="RUNNING")
                known = self.client.get_run(run_id).data.params
            except MlflowException as error:
                if error.error_code != "RESOURCE_DOES_NOT_EXIST":  # a server gone: the caller's warning
                    raise
                # Not in this store (MLFLOW_TRACKING_URI changed since, the run deleted): a new run, rather than
                # no tracking for this and every later resume
                run_id = None
        if run_id is None:
            experiment_name = MLFLOW_EXPERIMENT_NAME.get() or MLFLOW_EXPERIMENT
            experiment = self.client.get_experiment_by_name(experiment_name)
            experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(
                experiment_name, artifact_location=(store / "artifacts").as_uri() if default_store else None)
            run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        self.run_id = run_id
        # MLflow keeps a parameter's first value: a resume adds the new ones (its changes: resumes.jsonl)
        new = [Param(key, value) for key, value in parameters.items() if key not in known]
        self.client.log_batch(run_id, params=new)

    def record(self) -> dict:
        return {"run_id": self.run_id, "tracking_uri": without_credentials(self.where)}

    def log(self, values: Dict[str, float], epoch: int, wall_time: float) -> None:
        self.client.log_batch(self.run_id, metrics=[self._metric(key, value, int(wall_time * 1000), epoch)
                                                    for key, value in values.items()])

    def upload(self, run_dir: Path, files: List[Path]) -> None:
        for path in files:
            folder = path.parent.relative_to(run_dir).as_posix()
            self.client.log_artifact(self.run_id, str(path), None if folder == "." else folder)

    def close(self, outcome: str) -> None:
        self.client.set_terminated(self.run_id, outcome)


class WandbTracker:
    """One W&B run, in its mode (WANDB_MODE: online, offline), project and
    folder (WANDB_PROJECT, WANDB_DIR): W&B's own settings. Its records of
    the machine, git and the command line are off: the parameters are
    config.json's alone."""

    name = "wandb"

    def __init__(self, run_dir: Path, run_id: Optional[str], parameters: Dict[str, str]):
        import wandb

        settings = wandb.Settings(x_disable_meta=True, disable_git=True, save_code=False, x_save_requirements=False,
                                  console="off", x_disable_stats=True, init_timeout=WANDB_INIT_TIMEOUT_SECONDS,
                                  quiet=True)
        self.run = wandb.init(id=run_id, resume="allow", name=run_dir.name,
                              config=parameters, settings=settings, allow_val_change=True)
        self.run_id = self.run.id
        self.run.define_metric("epoch")
        self.run.define_metric("*", step_metric="epoch")  # the x-axis is the epoch, as metrics.csv's

    def record(self) -> dict:
        return {"run_id": self.run_id, "project": self.run.project}

    def log(self, values: Dict[str, float], epoch: int, wall_time: float) -> None:
        self.run.log({"epoch": epoch, **values})

    def upload(self, run_dir: Path, files: List[Path]) -> None:
        """Copies in the run's files folder, which W&B sends at the finish (run.save links them instead,
        and warns for each)."""
        for path in files:
            copy = Path(self.run.dir) / path.relative_to(run_dir)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, copy)

    def close(self, outcome: str) -> None:
        self.run.finish(exit_code=0 if outcome == FINISHED else 1)


MAKERS = {"mlflow": MlflowTracker, "wandb": WandbTracker}


class Trackers:
    """The run's trackers, each called through `_call`: its first failure is
    one warning line (`say`) and the tracker is left off from then on."""

    def __init__(self, say: Callable[[str], None], makers: Optional[dict] = None):
        self.say, self.makers = say, makers or MAKERS
        self.active: list = []
        self.run_dir: Optional[Path] = None

    def open(self, names: Sequence[str], run_dir: Path, record: dict, resuming: bool) -> None:
        """Start (or, `resuming`, continue) each tracker's run and send it
        `record`'s parameters; note the runs' ids in trackers.json."""
        if not names:
            return
        self.run_dir = run_dir
        ids = self._read_ids() if resuming else {}
        parameters = flat_parameters(record)
        for name in names:
            run_id = ids.get(name, {}).get("run_id")
            tracker = self._call(name, "start", lambda: self.makers[name](run_dir, run_id, parameters))
            if tracker is not None:
                self.active.append(tracker)
                ids[name] = tracker.record()
                lost = f", as its run {run_id} is not in this store" if run_id not in (None, tracker.run_id) else ""
                self.say(f"{name}: {'continuing' if run_id == tracker.run_id else 'started'} run {tracker.run_id}"
                         f"{lost} ({without_credentials(json.dumps(ids[name]))})")
        if not self.active:
            return
        try:
            text = json.dumps(ids, indent=2) + "\n"
            atomic_write(run_dir / RUN_IDS_NAME, lambda handle: handle.write(text.encode()))
        except OSError as error:
            self.say(one_line(f"warning: could not write {run_dir / RUN_IDS_NAME} ({error.strerror or error}): a "
                              f"resume of this run will start new tracked runs; training goes on"))

    def log(self, row: dict) -> None:
        """One metrics.csv row, as `epoch_values`."""
        values = epoch_values(row)
        for tracker in list(self.active):
            self._call(tracker, "log metrics", lambda: tracker.log(values, row["epoch"], row.get("wall_time")
                                                                   or time.time()))

    def finish(self, stopped: bool, failed: bool = False) -> None:
        """Send the run directory's reports and end each tracked run (stopped: to be continued; failed: ended by
        an error). Once: the trackers are left off after it, so a second call does nothing."""
        files = artifacts(self.run_dir) if self.active else []
        outcome = FAILED if failed else STOPPED if stopped else FINISHED
        for tracker in list(self.active):
            self._call(tracker, "upload the reports", lambda: tracker.upload(self.run_dir, files))
            if tracker in self.active:
                self._call(tracker, "end its run", lambda: tracker.close(outcome))
        self.active = []

    def _read_ids(self) -> dict:
        path = self.run_dir / RUN_IDS_NAME
        try:
            return json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError) as error:
            self.say(one_line(f"warning: cannot read {path} ({error_summary(error)}): the trackers start new runs"))
            return {}

    def _call(self, tracker, what: str, operation: Callable):
        """operation()'s result, or None when it raised: then one warning, and `tracker` (a tracker, or a
        name before it is made) is left off."""
        try:
            return operation()
        except Exception as error:  # noqa: BLE001 -- whatever the library raises, training goes on
            name = getattr(tracker, "name", tracker)
            if tracker in self.active:
                self.active.remove(tracker)
            self.say(one_line(without_credentials(
                f"warning: {name} tracker failed to {what} ({type(error).__name__}: {error_summary(error)}); it is "
                f"left off for the rest of the run and training goes on (the run directory has every figure)")))
            return None
