"""common.trackers: the parameters and metrics a tracker gets, a failing
tracker as one warning, MLflow's local store and W&B offline in this
process (a real server: tests/e2e/test_tracked_runs.py), and --tracker's checks."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from common import cli, trackers
from common.errors import UsageError
from common.meters import EpochMetrics
from common.ports import free_port
from common.trackers import RUN_IDS_NAME, Trackers, epoch_values, flat_parameters
from helpers import FAST_ARGS, make_image_folder
from tracker_records import mlflow_artifacts, wandb_runs

RECORD = {"command": "python imagenet_nd.py --dist-url tcp://alice:s3cret@node0:1", "started": "2026-11-27T20:00",
          "start_epoch": 0, "start_step": 0, "resumed_from": None,
          "options": {"arch": "resnet18", "epochs": 2, "lr_steps": [30, 60], "recipe": None, "evaluate": False},
          "resolved": {"global_batch_size": 4, "lr": 0.0015625},
          "environment": {"host": "vm", "git_commit": None}}
EXPECTED_PARAMETERS = {"options.arch": "resnet18", "options.epochs": "2", "options.lr_steps": "[30, 60]",
                       "options.recipe": "null", "options.evaluate": "false", "resolved.global_batch_size": "4",
                       "resolved.lr": "0.0015625", "environment.host": "vm", "environment.git_commit": "null"}


def metrics_row(epoch: int, split: str, loss: float, **more) -> dict:
    return dataclasses.asdict(EpochMetrics(epoch=epoch, split=split, loss=loss, top1=50.0 + epoch, top5=100.0,
                                           images=24, steps=6, seconds=1.5, images_per_second=16.0,
                                           seconds_per_step=0.25, data_wait_fraction=0.01,
                                           lr=0.1 if split == "train" else None, wall_time=1.8e9 + epoch, **more))


def track(names, run_dir, rows, stopped=False, record=RECORD, resuming=False) -> list:
    """One start of a run with the real trackers `names`: opened, sent `rows`, finished; the lines they said."""
    said = []
    group = Trackers(said.append)
    group.open(names, run_dir, record, resuming=resuming)
    for row in rows:
        group.log(row)
    group.finish(stopped=stopped)
    return said


def test_parameters_are_config_json_flattened_without_the_per_start_fields():
    assert flat_parameters(RECORD) == EXPECTED_PARAMETERS
    long = flat_parameters({"options": {"data": "x" * 7000}})["options.data"]
    assert len(long) == trackers.MAX_PARAMETER_CHARS and long.endswith("...")


def test_metrics_are_a_rows_numeric_columns_named_split_column():
    values = epoch_values(metrics_row(3, "val", 0.5, macro_f1=40.0))
    assert values == {"val_loss": 0.5, "val_top1": 53.0, "val_top5": 100.0, "val_images": 24.0, "val_steps": 6.0,
                      "val_seconds": 1.5, "val_images_per_second": 16.0, "val_seconds_per_step": 0.25,
                      "val_data_wait_fraction": 0.01, "val_wall_time": 1.8e9 + 3, "val_macro_f1": 40.0}
    assert epoch_values(metrics_row(0, "val_ema", 0.25))["val_ema_loss"] == 0.25


class Recorder:
    """A tracker that keeps what it is sent; `fails_at`: the method that raises."""

    def __init__(self, run_dir, run_id, parameters, name="recorder", fails_at=None, calls=None):
        self.name = name
        if fails_at == "start":
            raise ConnectionError("cannot reach http://alice:s3cret@tracker.example:5000/api")
        self.run_id, self.fails_at, self.calls = run_id or "run-1", fails_at, calls
        calls.append(("start", run_dir.name, run_id, parameters))

    def record(self):
        return {"run_id": self.run_id}

    def log(self, values, epoch, wall_time):
        if self.fails_at == "log":
            raise RuntimeError("HTTP 503\nService Unavailable")
        self.calls.append(("log", epoch, values["train_loss"]))

    def upload(self, run_dir, files):
        self.calls.append(("upload", [path.name for path in files]))

    def close(self, outcome):
        self.calls.append(("close", outcome))


def test_a_failing_tracker_is_one_warning_and_left_off_while_the_others_go_on(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.csv").write_text("epoch\n")
    good, bad, said = [], [], []
    group = Trackers(said.append, {"good": lambda *args: Recorder(*args, name="good", calls=good),
                                   "bad": lambda *args: Recorder(*args, name="bad", fails_at="log", calls=bad)})
    group.open(["bad", "good"], run_dir, RECORD, resuming=False)
    for epoch in range(3):
        group.log(metrics_row(epoch, "train", 1.0 / (epoch + 1)))
    group.finish(stopped=True)
    warnings = [line for line in said if line.startswith("warning")]
    assert warnings == ["warning: bad tracker failed to log metrics (RuntimeError: HTTP 503); it is left off for the "
                        "rest of the run and training goes on (the run directory has every figure)"]
    assert good == [("start", "r", None, EXPECTED_PARAMETERS), ("log", 0, 1.0), ("log", 1, 0.5),
                    ("log", 2, 1.0 / 3), ("upload", ["metrics.csv"]), ("close", "KILLED")]
    assert [call[0] for call in bad] == ["start"]
    assert json.loads((run_dir / RUN_IDS_NAME).read_text()) == {"bad": {"run_id": "run-1"},
                                                                "good": {"run_id": "run-1"}}


def test_a_tracker_that_cannot_start_says_so_without_the_credentials_and_is_not_recorded(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    said = []
    group = Trackers(said.append, {"mlflow": lambda *args: Recorder(*args, fails_at="start", calls=[])})
    group.open(["mlflow"], run_dir, RECORD, resuming=False)
    group.log(metrics_row(0, "train", 1.0))
    group.finish(stopped=False)
    assert said == ["warning: mlflow tracker failed to start (ConnectionError: cannot reach "
                    "http://***@tracker.example:5000/api); it is left off for the rest of the run and training goes "
                    "on (the run directory has every figure)"]
    assert not (run_dir / RUN_IDS_NAME).exists()


def test_a_resume_continues_the_run_ids_kept_in_the_run_directory(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / RUN_IDS_NAME).write_text(json.dumps({"good": {"run_id": "kept-7"}}))
    calls, said = [], []
    Trackers(said.append, {"good": lambda *args: Recorder(*args, calls=calls)}).open(["good"], run_dir, RECORD,
                                                                                      resuming=True)
    assert calls[0][:3] == ("start", "r", "kept-7")
    assert said == ['good: continuing run kept-7 ({"run_id": "kept-7"})']


def test_a_run_ended_by_an_error_ends_its_tracked_run_failed_with_the_reports_so_far(tmp_path, monkeypatch):
    import imagenet_nd

    data = make_image_folder(tmp_path / "data")
    damaged = sorted((data / "val" / "class_1").iterdir())[0]
    damaged.write_bytes(b"not a JPEG")  # validation of epoch 0 ends the run: --bad-images fail
    calls = []
    monkeypatch.setitem(trackers.MAKERS, "mlflow", lambda *args: Recorder(*args, name="mlflow", calls=calls))
    real_find_spec = cli.importlib.util.find_spec  # the Recorder stands in: no need of MLflow installed
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: True if name == "mlflow" else real_find_spec(name))
    with pytest.raises(UsageError, match="cannot decode image"):
        imagenet_nd.main([str(data), *FAST_ARGS, "-j", "0", "--epochs", "2", "--steps-per-epoch", "1", "--tracker",
                          "mlflow", "--logdir", str(tmp_path / "runs"), "--run-name", "r"])
    assert [call[0] for call in calls] == ["start", "upload", "close"]
    assert calls[-2:] == [("upload", ["config.json"]), ("close", "FAILED")]  # not left RUNNING


@pytest.fixture
def mlflow_environment(monkeypatch):
    """No tracking URI or experiment of the user's; MLflow's HTTP variables restored after the test."""
    pytest.importorskip("mlflow", reason="--tracker mlflow: pip install -r requirements-trackers.txt")
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", *trackers.MLFLOW_HTTP_BOUNDS):
        monkeypatch.setenv(name, "")  # recorded, so that the test's own settings are undone
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.slow  # MLflow makes its SQLite store's tables: 10 s on a loaded 2-core machine
def test_mlflow_keeps_a_local_store_in_the_run_directory_and_a_resume_appends_to_its_run(tmp_path,
                                                                                        mlflow_environment):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    for name in ("config.json", "metrics.csv", "val_report.csv"):
        (run_dir / name).write_text(name)
    said = track(["mlflow"], run_dir, [metrics_row(0, "train", 0.75), metrics_row(1, "train", 0.5)], stopped=True)
    assert {name: os.environ[name] for name in trackers.MLFLOW_HTTP_BOUNDS} == trackers.MLFLOW_HTTP_BOUNDS
    run_id = json.loads((run_dir / RUN_IDS_NAME).read_text())["mlflow"]["run_id"]
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    assert client.get_run(run_id).info.status == "KILLED"

    said += track(["mlflow"], run_dir, [metrics_row(2, "train", 0.25)], resuming=True,
                  record={**RECORD, "options": {**RECORD["options"], "epochs": 3, "seed": 1}})
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r"
    assert run.data.params == {**EXPECTED_PARAMETERS, "options.seed": "1"}  # the first value kept, new ones added
    history = client.get_metric_history(run_id, "train_loss")
    assert [(point.step, point.value, point.timestamp) for point in history] == [
        (0, 0.75, 1_800_000_000_000), (1, 0.5, 1_800_000_001_000), (2, 0.25, 1_800_000_002_000)]
    assert mlflow_artifacts(client, run_id) == ["config.json", "metrics.csv", "val_report.csv"]
    assert (run_dir / "mlflow" / "artifacts").is_dir()
    assert [line for line in said if "warning" in line] == []


@pytest.mark.slow  # MLflow makes its SQLite store's tables
def test_a_resume_whose_mlflow_run_is_not_in_the_store_starts_a_new_run_instead_of_none(tmp_path,
                                                                                       mlflow_environment):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    lost = "0123456789abcdef0123456789abcdef"  # kept by a start whose store was another (MLFLOW_TRACKING_URI)
    (run_dir / RUN_IDS_NAME).write_text(json.dumps({"mlflow": {"run_id": lost}}))
    said = track(["mlflow"], run_dir, [metrics_row(3, "train", 0.5)], resuming=True)
    run_id = json.loads((run_dir / RUN_IDS_NAME).read_text())["mlflow"]["run_id"]
    assert run_id != lost
    assert [line for line in said if "warning" in line] == []
    assert said[0].startswith(f"mlflow: started run {run_id}, as its run {lost} is not in this store (")
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [(point.step, point.value) for point in client.get_metric_history(run_id, "train_loss")] == [(3, 0.5)]


def test_mlflow_bounds_only_the_http_settings_the_user_left_unset(tmp_path, mlflow_environment):
    mlflow_environment.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    mlflow_environment.setenv("MLFLOW_TRACKING_URI", f"http://alice:s3cret@127.0.0.1:{free_port()}")
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    said = track(["mlflow"], run_dir, [metrics_row(0, "train", 1.0)])
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == trackers.MLFLOW_HTTP_BOUNDS["MLFLOW_HTTP_REQUEST_TIMEOUT"]
    assert len(said) == 1 and said[0].startswith("warning: mlflow tracker failed to start (")
    assert "http://***@127.0.0.1:" in said[0] and "s3cret" not in said[0]
    assert not (run_dir / RUN_IDS_NAME).exists()


def test_wandb_offline_keeps_the_parameters_metrics_and_reports(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="--tracker wandb: pip install -r requirements-trackers.txt")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "tests")
    run_dir = tmp_path / "runs" / "r"
    (run_dir / "figures").mkdir(parents=True)
    (run_dir / "val_report.csv").write_text("report")
    (run_dir / "figures" / "accuracy.png").write_bytes(b"png")
    said = track(["wandb"], run_dir, [metrics_row(0, "train", 0.75), metrics_row(0, "val", 0.5)])
    assert [line for line in said if "warning" in line] == []
    (run,) = wandb_runs(tmp_path)
    assert run["id"] == json.loads((run_dir / RUN_IDS_NAME).read_text())["wandb"]["run_id"]
    assert run["config"] == EXPECTED_PARAMETERS
    rows = [{key: value for key, value in row.items() if not key.startswith("_")} for row in run["history"]]
    assert rows == [{"epoch": 0, **epoch_values(metrics_row(0, "train", 0.75))},
                    {"epoch": 0, **epoch_values(metrics_row(0, "val", 0.5))}]
    assert {"val_report.csv", "figures/accuracy.png"} <= set(run["files"])
    assert (run["folder"] / "files" / "figures" / "accuracy.png").read_bytes() == b"png"


def test_tracker_flags_are_checked_before_training(tiny_data, monkeypatch):
    base = [str(tiny_data), "-a", "resnet18"]
    assert cli.parse("nd", base).trackers == ()
    assert cli.parse("nd", base + ["--tracker", "wandb", "--tracker", "mlflow", "--tracker", "wandb"]).trackers == (
        "wandb", "mlflow")
    with pytest.raises(UsageError, match=r"^argument --tracker: not with --evaluate"):
        cli.parse("nd", base + ["--tracker", "mlflow", "--evaluate"])
    real_find_spec = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None if name == "wandb" else real_find_spec(name))
    with pytest.raises(UsageError) as raised:
        cli.parse("nd", base + ["--tracker", "mlflow", "--tracker", "wandb"])
    assert str(raised.value) == "argument --tracker: wandb is not installed: pip install -r requirements-trackers.txt"
