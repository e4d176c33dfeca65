"""What the trackers kept, read back for the tests: an offline W&B run's
records (its run-<id>.wandb file, read without W&B's service) and an
MLflow run's parameters, metric histories and artifacts."""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Dict, List

from helpers import csv_rows

_WANDB_BLOCK_BYTES = 32768  # a .wandb file is LevelDB's log format: 32 KiB blocks of records
_WANDB_HEADER = b":W&B"  # then 0xBEE1 and a version byte: 7 bytes
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
# W&B's service process writes an offline run's file on its own, after run.finish() has returned: seconds later
# on a loaded machine. A run's records are read once the file ends in its exit record; a generous bound.
_WANDB_WRITE_DEADLINE_S = 120.0


def _wandb_records(path: Path):
    """The protobuf Records of a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == _WANDB_HEADER, path
    position, pending = 7, b""
    while position + 7 <= len(data):
        if _WANDB_BLOCK_BYTES - position % _WANDB_BLOCK_BYTES < 7:  # a block's tail too short for a header
            position += _WANDB_BLOCK_BYTES - position % _WANDB_BLOCK_BYTES
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _finished_records(path: Path) -> list:
    """The records of a .wandb file once its exit record is written (or, past the deadline, those it has)."""
    deadline = time.monotonic() + _WANDB_WRITE_DEADLINE_S
    while True:
        try:
            records = list(_wandb_records(path))
        except Exception:  # noqa: BLE001 -- a record being written: protobuf's DecodeError, until the deadline
            if time.monotonic() > deadline:
                raise
            records = []
        if any(record.WhichOneof("record_type") == "exit" for record in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def wandb_runs(wandb_dir: Path) -> List[dict]:
    """Each offline run under WANDB_DIR, oldest first: its id, config (key: value), history rows and files."""
    runs = []
    for folder in sorted((wandb_dir / "wandb").glob("offline-run-*")):
        run = {"id": None, "config": {}, "history": [], "files": sorted(
            path.relative_to(folder / "files").as_posix() for path in (folder / "files").rglob("*") if path.is_file()),
            "folder": folder}
        for record in _finished_records(next(folder.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
                run["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "config":
                run["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif kind == "history":
                run["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                       for item in record.history.item})
        run["config"].pop("_wandb", None)  # W&B's own
        runs.append(run)
    return runs


def metrics_csv_series(run_dir: Path) -> Dict[str, Dict[int, float]]:
    """metrics.csv as the trackers' series: <split>_<column> -> {epoch: value}, every non-empty numeric cell."""
    series: Dict[str, Dict[int, float]] = {}
    for row in csv_rows(run_dir / "metrics.csv"):
        for column, text in row.items():
            if column in ("epoch", "split") or text == "":
                continue
            series.setdefault(f"{row['split']}_{column}", {})[int(row["epoch"])] = float(text)
    return series


def mlflow_series(client, run_id: str) -> Dict[str, Dict[int, float]]:
    """An MLflow run's metric histories: name -> {step: value}; a step logged twice must not be."""
    series = {}
    for name in client.get_run(run_id).data.metrics:
        history = client.get_metric_history(run_id, name)
        steps = [point.step for point in history]
        assert len(steps) == len(set(steps)), (name, steps)
        series[name] = {point.step: point.value for point in history}
    return series


def mlflow_artifacts(client, run_id: str, folder: str = "") -> List[str]:
    """Every artifact file's path in an MLflow run."""
    paths = []
    for entry in client.list_artifacts(run_id, folder or None):
        paths += mlflow_artifacts(client, run_id, entry.path) if entry.is_dir else [entry.path]
    return sorted(paths)
