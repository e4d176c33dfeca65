"""--seed and --deterministic end to end on the CPU: two runs with the same
seed end with bit-identical weights and momentum buffers and the same
metrics.csv apart from its timing columns, whatever the number of
data-loading workers, with dropout (seeded per step), and for two-process
DDP; another seed gives other weights and metrics; --deterministic changes
nothing on the CPU and config.json records it.

Every run is its own process, as a user's runs are (and --deterministic
changes process-wide torch settings that must not leak into other tests)."""
import csv
import dataclasses
import json
from pathlib import Path

import pytest
from torch import nn

from common.rundir import CHECKPOINT_NAME
from common.meters import EpochMetrics
from common.models import build_model
from helpers import (REPO, differing_tensors, is_timing_column, load_checkpoint, make_image_folder, run_script,
                     single_run_dir)

# Random crops and flips (the defaults) and BatchNorm, 6 steps of 4 images per epoch.
RESNET = ["-a", "resnet18", "--image-size", "32", "--val-resize", "32", "-b", "4", "-p", "100", "--epochs", "2"]
# SqueezeNet 1.1's classifier starts with Dropout(p=0.5): the model's own randomness, seeded per step.
SQUEEZENET = ["-a", "squeezenet1_1", "--image-size", "32", "--val-resize", "32", "-b", "4", "-p", "100",
              "--epochs", "2"]


KNOWN_TIMING_COLUMNS = {"seconds", "images_per_second", "seconds_per_step", "data_wait_fraction", "wall_time",
                        "images_per_second_per_gpu", "peak_memory_mib"}
MUST_BE_COMPARED = {"epoch", "split", "loss", "top1", "top5", "images", "steps", "lr", "dataset_bytes", "macro_f1"}


def test_timing_columns_are_told_apart_from_the_results():
    columns = [field.name for field in dataclasses.fields(EpochMetrics)]
    timing = {name for name in columns if is_timing_column(name)}
    assert timing >= KNOWN_TIMING_COLUMNS and is_timing_column("host_memory_mib")
    assert MUST_BE_COMPARED <= set(columns) - timing  # the comparisons below cannot become vacuous


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("determinism") / "data")  # 24 training images, 9 val, 3 classes


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """run(script, *args, copy=0): the run directory of `script DATA *args`, trained once per
    (script, args, copy) in this module; a different `copy` is a second, independent run."""
    done = {}

    def run(script, *args, copy=0):
        key = (script, tuple(map(str, args)), copy)
        if key not in done:
            logdir = tmp_path_factory.mktemp("runs")
            result = run_script([REPO / script, data, *args, "--logdir", logdir])
            assert result.returncode == 0, result.stdout + result.stderr
            done[key] = single_run_dir(logdir)  # only rank 0 writes one
        return done[key]

    return run


def training_state(run_dir: Path):
    """(model state_dict, {parameter index: momentum buffer}) of the last checkpoint."""
    state = load_checkpoint(run_dir / CHECKPOINT_NAME)
    momentum = {index: entry["momentum_buffer"] for index, entry in state["optimizer"]["state"].items()}
    assert len(momentum) == len(state["optimizer"]["param_groups"][0]["params"])  # SGD with momentum: one each
    return state["state_dict"], momentum


def metrics_header_and_rows(run_dir: Path):
    """metrics.csv as (header, rows); the values are the strings written, so equal means bit-equal."""
    with open(run_dir / "metrics.csv", newline="") as handle:
        reader = csv.DictReader(handle)
        return reader.fieldnames, list(reader)


def results(run_dir: Path):
    """metrics.csv without its timing columns."""
    header, rows = metrics_header_and_rows(run_dir)
    compared = [name for name in header if not is_timing_column(name)]
    assert MUST_BE_COMPARED <= set(compared)
    return [{name: row[name] for name in compared} for row in rows]


def assert_same_run(a: Path, b: Path):
    weights_a, momentum_a = training_state(a)
    weights_b, momentum_b = training_state(b)
    assert differing_tensors(weights_a, weights_b) == []
    assert differing_tensors(momentum_a, momentum_b) == []
    assert metrics_header_and_rows(a)[0] == metrics_header_and_rows(b)[0]
    assert results(a) == results(b)
    assert len(results(a)) == 4  # 2 epochs, train and val


def assert_other_run(a: Path, b: Path):
    weights_a, _ = training_state(a)
    weights_b, _ = training_state(b)
    assert differing_tensors(weights_a, weights_b) != []
    assert [row["loss"] for row in results(a)] != [row["loss"] for row in results(b)]


def options(run_dir: Path) -> dict:
    return json.loads((run_dir / "config.json").read_text())["options"]


@pytest.mark.slow
def test_same_seed_gives_bit_identical_weights_and_metrics(runs):
    first = runs("imagenet_nd.py", *RESNET, "--seed", "5", "-j", "2")
    second = runs("imagenet_nd.py", *RESNET, "--seed", "5", "-j", "2", copy=1)
    assert options(first)["seed"] == 5 and options(first)["workers"] == 2
    assert_same_run(first, second)


@pytest.mark.slow
def test_the_number_of_data_workers_changes_nothing(runs):
    # Each image's crop and flip are seeded from (seed, epoch, index): drawn in two worker processes
    # or in the training process itself, they are the same.
    with_workers = runs("imagenet_nd.py", *RESNET, "--seed", "5", "-j", "2")
    in_process = runs("imagenet_nd.py", *RESNET, "--seed", "5", "-j", "0")
    assert_same_run(with_workers, in_process)


@pytest.mark.slow
def test_another_seed_gives_other_weights_and_metrics(runs):
    assert_other_run(runs("imagenet_nd.py", *RESNET, "--seed", "5", "-j", "2"),
                     runs("imagenet_nd.py", *RESNET, "--seed", "6", "-j", "2"))


@pytest.mark.slow
def test_dropout_repeats_with_the_same_seed(runs):
    # The model really draws at random in training: SqueezeNet 1.1's classifier drops out half its inputs.
    model = build_model("squeezenet1_1", num_classes=3, image_size=32)
    assert [module.p for module in model.modules() if isinstance(module, nn.Dropout)] == [0.5]
    # -j 0: the images' augmentation and the model's dropout both draw from the training process's generator.
    first = runs("imagenet_nd.py", *SQUEEZENET, "--seed", "5", "-j", "0")
    assert_same_run(first, runs("imagenet_nd.py", *SQUEEZENET, "--seed", "5", "-j", "0", copy=1))


@pytest.mark.slow
def test_deterministic_changes_nothing_on_the_cpu_and_is_recorded(runs):
    plain = runs("imagenet_nd.py", *SQUEEZENET, "--seed", "5", "-j", "0")
    deterministic = runs("imagenet_nd.py", *SQUEEZENET, "--seed", "5", "-j", "0", "--deterministic")
    assert options(plain)["deterministic"] is False
    assert options(deterministic)["deterministic"] is True
    assert_same_run(plain, deterministic)


@pytest.mark.slow  # three two-process runs
def test_two_process_ddp_runs_repeat_with_the_same_seed_only(runs):
    # gloo on the CPU; each rank crops, flips and drops out with its own draws (-j 0: in the rank itself).
    ddp = [*SQUEEZENET, "--nproc-per-node", "2", "-j", "0"]
    first = runs("imagenet_ddp.py", *ddp, "--seed", "5")
    assert json.loads((first / "config.json").read_text())["environment"]["world_size"] == 2
    assert [row["images"] for row in results(first)] == ["24", "9", "24", "9"]
    assert_same_run(first, runs("imagenet_ddp.py", *ddp, "--seed", "5", copy=1))
    assert_other_run(first, runs("imagenet_ddp.py", *ddp, "--seed", "6"))


@pytest.mark.slow
def test_deterministic_sets_every_switch_a_gpu_run_needs():
    # In a process of its own: the switches are process-wide.
    code = ("import os, torch\nfrom common.engine import seed_everything\nseed_everything(3, True)\n"
            "print(torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,"
            " torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),"
            " os.environ['CUBLAS_WORKSPACE_CONFIG'], torch.initial_seed())")
    result = run_script(["-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False", "True", "True", ":4096:8", "3"]
