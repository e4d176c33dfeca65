"""The benchmark harness (python -m common.tools.bench): one JSON line per
configuration with the documented fields, the same rows in the CSV, and the
ratios computed from them."""
import csv
import dataclasses
import json

import pytest

from common.tools import bench
from conftest import cpu_has_native_bf16, make_image_folder, run_command

import sys

NUMBERS = ("images_per_second", "ms_per_step", "peak_memory_mib")


def json_rows(stdout: str) -> list:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def check_rows(rows: list, csv_path) -> None:
    """Every field in order; figures in every row but those of a half type this CPU emulates, which say so."""
    for row in rows:
        assert tuple(row) == bench.FIELDS  # every field, in order
        if row["note"].endswith("skipped (--measure-emulated times it)"):
            assert all(row[field] == "" for field in NUMBERS), row
        else:
            for field in NUMBERS:
                assert float(row[field]) > 0, (row["config"], field)
        assert row["torch"] and row["torchvision"] and row["device_name"] and row["date"] and row["capability"]
        assert row["bf16_native"] in (True, False)
    with open(csv_path, newline="") as handle:
        written = list(csv.DictReader(handle))
    assert [row["config"] for row in written] == [row["config"] for row in rows]
    assert [row["images_per_second"] and float(row["images_per_second"]) for row in written] == \
        [row["images_per_second"] for row in rows]


def test_record_has_every_field_and_refuses_unknown_ones():
    row = bench.record(section="train", config="nd", images_per_second=1.0)
    assert tuple(row) == bench.FIELDS and row["ms_per_step"] == ""
    with pytest.raises(ValueError):
        bench.record(images_per_sec=1.0)


def test_ratios_are_the_configurations_quotients_against_their_targets():
    rows = [bench.record(section="train", config="reference", images_per_second=10.0),
            bench.record(section="train", config="nd", images_per_second=12.0),
            bench.record(section="train", config="ddp_apex O2 channels_last", images_per_second=21.0),
            bench.record(section="input", config="reference", workers=1, images_per_second_per_worker=100.0),
            bench.record(section="input", config="reference", workers=2, images_per_second_per_worker=90.0),
            bench.record(section="input", config="torchvision", workers=2, images_per_second_per_worker=150.0),
            bench.record(section="end-to-end", config="nd", images_per_second=6.0)]
    lines = bench.ratios(rows)
    assert lines[0].startswith("train: fp32 (imagenet_nd.py) over the reference loop: 1.20x") and "met)" in lines[0]
    assert ": 2.10x" in lines[1] and "NOT met" in lines[1]
    assert ": 1.50x" in lines[2] and "NOT met" in lines[2]  # the best per-worker figure of each: 150 / 100
    assert lines[3] == "end-to-end: real JPEGs over synthetic data, nd: 0.50 (1.00 = not input-bound)"


def test_gpu_ratios_state_the_absolute_target_and_what_the_input_alone_could_feed():
    gpu = dict(cuda="13.0")
    rows = [bench.record(section="train", config="reference", images_per_second=1800.0, **gpu),
            bench.record(section="train", config="ddp_apex O2 channels_last", images_per_second=3100.0, **gpu),
            bench.record(section="input", config="torchvision", workers=6, images_per_second=1550.0, **gpu),
            bench.record(section="input", config="torchvision", workers=12, images_per_second=2790.0, **gpu),
            bench.record(section="input", config="gpu", workers=12, images_per_second=3410.0, **gpu)]
    assert bench.ratios(rows) == [
        "train: ResNet-50 AMP + channels-last, images/s on synthetic data (one H100): 3100.00 images/s "
        "(target >= 3000 images/s on the GPU: met)",
        "input alone: the torchvision backend's best images/s over ddp_apex O2 channels_last's synthetic training: "
        "0.90 (what it could feed; the end-to-end row measures both at once)",
        "input alone: the gpu backend's best images/s over ddp_apex O2 channels_last's synthetic training: "
        "1.10 (what it could feed; the end-to-end row measures both at once)"]


def test_input_rounds_alternate_the_configurations_and_keep_each_ones_best(tmp_path, monkeypatch):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=8, val_per_class=1, size=40)
    calls = []
    speeds = {("reference", 1): [50.0, 70.0, 60.0], ("pil", 1): [90.0, 80.0, 85.0], ("torchvision", 1): [100.0] * 3}

    def measured(spec):
        calls.append(spec["backend"])
        return {"images_per_second": speeds[spec["backend"], spec["workers"]].pop(0), "ms_per_step": 1.0,
                "peak_memory_mib": 1.0, "images_per_second_per_worker": 1.0}

    monkeypatch.setattr(bench, "run_child", measured)
    settings = bench.Settings(device="cpu", arch="resnet18", batch_size=4, image_size=32, warmup_steps=1, steps=1,
                              workers=[1], data=str(root), input_batches=2, input_rounds=3)
    rows = bench.input_section(settings, str(root))
    assert calls == ["reference", "pil", "torchvision"] * 3  # round after round, not one configuration's three
    assert [(row["config"], row["images_per_second"]) for row in rows] == [
        ("reference", 70.0), ("pil", 90.0), ("torchvision", 100.0)]


@pytest.mark.slow  # six fresh processes (35 s); the rounds and ratios are unit-tested above
def test_input_section_prints_one_json_line_per_backend_and_worker_count(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=8, val_per_class=1, size=40)
    csv_path = tmp_path / "bench.csv"
    completed = run_command([sys.executable, "-m", "common.tools.bench", "--sections", "input", "--data", root,
                             "--workers", "0", "1", "-b", "4", "--input-batches", "2", "--input-rounds", "1",
                             "--image-size", "32",
                             "--csv", csv_path])
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = json_rows(completed.stdout)
    assert [(row["config"], row["workers"]) for row in rows] == [
        (backend, workers) for backend in ("reference", "pil", "torchvision") for workers in (0, 1)]
    check_rows(rows, csv_path)
    assert all(row["images_per_second_per_worker"] == row["images_per_second"] for row in rows if row["workers"] == 1)
    again = run_command([sys.executable, "-m", "common.tools.bench", "--sections", "input", "--data", root, "--csv",
                         csv_path])
    assert again.returncode == 2 and "exists" in again.stderr  # a result is never overwritten


@pytest.mark.slow
def test_train_section_runs_each_script_and_the_reference_loop(tmp_path):
    csv_path = tmp_path / "bench.csv"
    completed = run_command([sys.executable, "-m", "common.tools.bench", "--sections", "train", "-b", "4",
                             "--image-size", "32", "--steps", "2", "--warmup-steps", "1", "--csv", csv_path],
                            timeout=900)
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = json_rows(completed.stdout)
    check_rows(rows, csv_path)
    described = {row["config"]: (row["precision"], row["memory_format"]) for row in rows}
    native = cpu_has_native_bf16()
    assert described == {
        "reference": ("fp32", "contiguous"),
        "nd": ("fp32", "channels_last"),  # --memory-format auto on the CPU
        "nd contiguous": ("fp32", "contiguous"),
        "ddp": ("fp32", "channels_last"),
        # Where bf16 is emulated, its rows name what was asked and are not timed (no memory format ran).
        "ddp_apex O1": ("O1 bf16", "channels_last" if native else ""),
        "ddp_apex O2 channels_last": ("O2 bf16", "channels_last" if native else ""),
        "ddp_apex auto": ("O1 bf16" if native else "fp32", "channels_last"),  # what the script picks here
    }
    timed = [row for row in rows if row["images_per_second"] != ""]
    assert len(timed) == (7 if native else 5)
    assert all(row["measured_steps"] == 2 and row["warmup_steps"] == 1 for row in timed)
    assert any(line.startswith("train: fp32 (imagenet_nd.py) over the reference loop: ")
               for line in completed.stdout.splitlines())


def _fake_measurements(monkeypatch, images_per_second: float = 10.0) -> list:
    """bench's subprocess measurements replaced by a fixed figure; returns the configurations asked for."""
    asked = []
    figures = {"images_per_second": images_per_second, "ms_per_step": 1.0, "peak_memory_mib": 1.0,
               "images_per_second_per_worker": images_per_second}
    monkeypatch.setattr(bench, "run_child", lambda spec: asked.append(spec.get("backend", spec["kind"])) or figures)
    monkeypatch.setattr(bench, "run_script", lambda script, flags, *args, **kwargs: asked.append(
        " ".join([script] + flags)) or dict(figures, precision="fp32", memory_format="contiguous",
                                            measured_steps=1, warmup_steps=1))
    return asked


def test_train_configurations_named_run_compiled_ones_without_the_compile_flag(tmp_path, monkeypatch):
    settings = bench.Settings(device="cpu", arch="resnet18", batch_size=4, image_size=32, warmup_steps=1, steps=1,
                              workers=[1], data=None, input_batches=2, input_rounds=1)
    asked = _fake_measurements(monkeypatch)
    rows = bench.train_section(settings, tmp_path, with_compile=False, only=["nd compile"])
    assert asked == ["reference-train", "imagenet_nd.py --compile"]
    assert [(row["config"], row["compile"]) for row in rows] == [("reference", False), ("nd compile", True)]
    asked.clear()
    every = bench.train_section(settings, tmp_path, with_compile=False)
    assert [row["config"] for row in every] == ["reference"] + [
        name for name, script, _ in bench.TRAIN_CONFIGS if script != "imagenet_dp.py"]  # no DataParallel on the CPU
    asked.clear()
    compiled = bench.train_section(settings, tmp_path, with_compile=True)
    assert [row["config"] for row in compiled][-2:] == [name for name, _, _ in bench.COMPILE_CONFIGS]


def test_half_types_this_cpu_emulates_are_skipped_and_never_shown_as_a_speed_up(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "emulated_half", lambda flags, device: "bf16 emulated on this CPU (AVX2)"
                        if "O1" in flags or "O2" in flags else "")
    asked = _fake_measurements(monkeypatch)
    settings = bench.Settings(device="cpu", arch="resnet18", batch_size=4, image_size=32, warmup_steps=1, steps=1,
                              workers=[1], data=None, input_batches=2, input_rounds=1)
    rows = bench.train_section(settings, tmp_path, with_compile=False)
    assert "imagenet_ddp_apex.py --nproc-per-node 1 --opt-level O1" not in asked  # not run at all
    skipped = {row["config"]: (row["precision"], row["images_per_second"], row["note"]) for row in rows if row["note"]}
    assert skipped == {
        "ddp_apex O1": ("O1 bf16", "", "bf16 emulated on this CPU (AVX2): skipped (--measure-emulated times it)"),
        "ddp_apex O2 channels_last": ("O2 bf16", "", "bf16 emulated on this CPU (AVX2): skipped (--measure-emulated "
                                                     "times it)")}
    lines = bench.ratios(rows)
    assert lines[:3] == [
        "train: fp32 (imagenet_nd.py) over the reference loop: 1.00x (target >= 1x on the 2-core CPU: met)",
        "train: imagenet_ddp_apex.py's own choice of precision over the reference loop: 1.00x (target >= 1x on the "
        "2-core CPU: met)",
        "train: bf16 autocast + channels-last over the reference loop: not measured (bf16 emulated on this CPU "
        "(AVX2): skipped (--measure-emulated times it)); not a speed-up on this machine"]
    # Asked to, it times them anyway, and labels them.
    measured = bench.train_section(dataclasses.replace(settings, measure_emulated=True), tmp_path, with_compile=False)
    labelled = {row["config"]: row["note"] for row in measured if row["note"]}
    assert labelled == {"ddp_apex O1": "bf16 emulated on this CPU (AVX2)",
                        "ddp_apex O2 channels_last": "bf16 emulated on this CPU (AVX2)"}
    assert all(row["images_per_second"] == 10.0 for row in measured)
    next(row for row in measured if row["config"] == "ddp_apex O1")["images_per_second"] = 0.5  # 20x slower
    assert "train: ddp_apex O1 over the reference loop: 0.05x (bf16 emulated on this CPU (AVX2): a slowdown to " \
           "avoid, not a speed-up)" in bench.ratios(measured)


def test_an_input_configuration_that_measures_nothing_still_gets_its_row(tmp_path, monkeypatch):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=8, val_per_class=1, size=40)
    _fake_measurements(monkeypatch, images_per_second=0.0)
    settings = bench.Settings(device="cpu", arch="resnet18", batch_size=4, image_size=32, warmup_steps=1, steps=1,
                              workers=[1], data=str(root), input_batches=2, input_rounds=2)
    rows = bench.input_section(settings, str(root))
    assert [(row["config"], row["images_per_second"]) for row in rows] == [
        ("reference", 0.0), ("pil", 0.0), ("torchvision", 0.0)]
