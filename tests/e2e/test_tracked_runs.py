"""--tracker as a user runs it: a real `mlflow server` on loopback gets the
run's parameters, every metrics.csv figure and the reports, and a resume
continues the same tracked run; a tracker at a closed port is one warning,
the run ends as it would without it, and W&B offline keeps what metrics.csv
holds. The training runs are processes of their own (the tracker's
environment is theirs), 2 epochs of the tiny data each."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.ports import free_port
from common.trackers import RUN_IDS_NAME, flat_parameters
from helpers import FAST_ARGS, REPO, make_image_folder, metrics, run_script, single_run_dir
from mlflow_server import MlflowServer
from tracker_records import metrics_csv_series, mlflow_artifacts, mlflow_series, wandb_runs

pytestmark = pytest.mark.slow
pytest.importorskip("mlflow", reason="--tracker mlflow: pip install -r requirements-trackers.txt")
pytest.importorskip("wandb", reason="--tracker wandb: pip install -r requirements-trackers.txt")

SECRET = "s3cret-not-for-printing"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("trackers") / "data")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    yield server
    server.stop()


def train(data: Path, logdir: Path, env: dict, *extra: str):
    return run_script([REPO / "imagenet_nd.py", data, *FAST_ARGS, "--logdir", logdir, "--run-name", "tracked",
                       *extra], env_extra=env, timeout=900)


@pytest.fixture(scope="module")
def tracked(data, server, tmp_path_factory):
    """A 2-epoch run with --tracker mlflow at the server: (its run directory, metrics.csv's rows then)."""
    logdir = tmp_path_factory.mktemp("tracked") / "runs"
    result = train(data, logdir, {"MLFLOW_TRACKING_URI": server.url}, "--epochs", "2", "--tracker", "mlflow")
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stdout + result.stderr
    run_dir = single_run_dir(logdir)
    return run_dir, metrics(run_dir)


def test_mlflow_server_holds_config_json_every_metrics_csv_figure_and_the_reports(tracked, server):
    from mlflow.tracking import MlflowClient

    run_dir, _ = tracked
    client = MlflowClient(server.url)
    run_id = json.loads((run_dir / RUN_IDS_NAME).read_text())["mlflow"]["run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert run.data.params == flat_parameters(json.loads((run_dir / "config.json").read_text()))
    assert run.data.params["options.epochs"] == "2" and run.data.params["options.trackers"] == '["mlflow"]'
    series = metrics_csv_series(run_dir)
    assert len(series["train_loss"]) == 2 and len(series["val_top1"]) == 2
    assert mlflow_series(client, run_id) == series
    assert {"config.json", "metrics.csv", "val_report.csv", "val_report_best.csv"} <= set(
        mlflow_artifacts(client, run_id))
    assert not (run_dir / "mlflow").exists()  # the server's store, not a local one


def test_a_resume_continues_the_same_mlflow_run(tracked, server, data):
    from mlflow.tracking import MlflowClient

    run_dir, _ = tracked
    run_id = json.loads((run_dir / RUN_IDS_NAME).read_text())["mlflow"]["run_id"]
    result = train(data, run_dir.parent, {"MLFLOW_TRACKING_URI": server.url}, "--epochs", "3", "--resume", "auto",
                   "--tracker", "mlflow")
    assert result.returncode == 0, result.stderr
    assert f"mlflow: continuing run {run_id}" in result.stdout
    assert json.loads((run_dir / RUN_IDS_NAME).read_text())["mlflow"]["run_id"] == run_id
    client = MlflowClient(server.url)
    series = mlflow_series(client, run_id)
    assert sorted(series["train_loss"]) == [0, 1, 2]
    assert series == metrics_csv_series(run_dir)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert "resumes.jsonl" in mlflow_artifacts(client, run_id)
    experiment_id = client.get_run(run_id).info.experiment_id
    assert [run.info.run_id for run in client.search_runs([experiment_id])] == [run_id]  # no second run


def test_a_tracker_at_a_closed_port_is_one_warning_and_wandb_offline_keeps_metrics_csv(tracked, data, tmp_path):
    """MLflow's URL holds a password: no line, file or tracker record shows it."""
    _, reference = tracked
    wandb_dir = tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    env = {"MLFLOW_TRACKING_URI": f"http://alice:{SECRET}@127.0.0.1:{free_port()}", "WANDB_MODE": "offline",
           "WANDB_DIR": str(wandb_dir), "WANDB_PROJECT": "tests"}
    result = train(data, tmp_path / "runs", env, "--epochs", "2", "--tracker", "mlflow", "--tracker", "wandb")
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    warnings = [line for line in output.splitlines() if "warning" in line.lower() and "mlflow" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: mlflow tracker failed to start ("), output
    assert "http://***@127.0.0.1:" in warnings[0]
    run_dir = single_run_dir(tmp_path / "runs")
    assert metrics(run_dir) == reference  # the same run as without a failing tracker
    (run,) = wandb_runs(wandb_dir)
    assert json.loads((run_dir / RUN_IDS_NAME).read_text()) == {"wandb": {"run_id": run["id"], "project": "tests"}}
    assert run["config"] == flat_parameters(json.loads((run_dir / "config.json").read_text()))
    logged = {}
    for row in run["history"]:
        for name, value in row.items():
            if not name.startswith("_") and name != "epoch":
                logged.setdefault(name, {})[row["epoch"]] = value
    assert logged == metrics_csv_series(run_dir)
    assert {"config.json", "metrics.csv", "val_report.csv"} <= set(run["files"])
    kept = [output] + [path.read_bytes().decode(errors="replace") for folder in (run_dir, wandb_dir)
                       for path in folder.rglob("*") if path.is_file() and path.suffix != ".tar"]
    assert not [text for text in kept if SECRET in text]
