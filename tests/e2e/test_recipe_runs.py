"""Issue 38's pieces together and its recipes by name, end to end: a run with
every recipe flag at once resumed mid-epoch ends on the uninterrupted run's
weights and average; every named recipe starts on the digits (at a small
image size, its flags in config.json as its file sets them); and
torchvision's v2 recipe and an FFCV schedule train the digits to 95%."""
from __future__ import annotations

import json

import pytest
import torch

from common import recipes
from common.flags import build_parser
from helpers import REPO, max_abs_diff, metrics, metrics_rows, run_script, single_run_dir

# Every piece of issue 38 in one command: the optimiser's and the schedule's, the resolution and sampling,
# the augmentation and mixing, the EMA.
EVERY_PIECE = ["--norm-weight-decay", "0", "--bias-weight-decay", "0", "--nesterov", "--clip-grad-norm", "1",
               "--lr-schedule", "linear", "--warmup-epochs", "0.5", "--lr-warmup-decay", "0.01", "--lr-min", "0.01",
               "--blurpool", "--progressive-resizing", "24", "32", "0", "1", "--progressive-step", "8",
               "--val-resize-size", "36", "--val-crop-size", "32", "--val-flip", "--ra-sampler", "--ra-reps", "2",
               "--auto-augment", "ta_wide", "--random-erase", "0.25", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
               "--model-ema", "--model-ema-steps", "2"]


@pytest.mark.slow
def test_a_run_with_every_recipe_piece_resumed_mid_epoch_ends_as_the_uninterrupted_one(tiny_data, tmp_path):
    # ResNet-18, 6 steps of 4 images an epoch (-j 1: the images augmented in a worker); the second epoch
    # trains at 32 px after the first's 24, and a checkpoint every 3 steps gives one inside the second epoch.
    run = [REPO / "imagenet_nd.py", tiny_data, "-a", "resnet18", "--image-size", "32", "-b", "4", "-j", "1",
           "-p", "1", "--epochs", "2", *EVERY_PIECE, "--checkpoint-every", "3steps", "--keep-checkpoints", "10",
           "--logdir", tmp_path / "runs"]
    whole = run_script(run)
    assert whole.returncode == 0, whole.stderr
    assert "epoch 0: training crop 24 px" in whole.stdout and "epoch 1: training crop 32 px" in whole.stdout
    run_dir = single_run_dir(tmp_path / "runs")
    uninterrupted, uninterrupted_metrics = torch.load(run_dir / "checkpoint.pth.tar", map_location="cpu",
                                                      weights_only=False), metrics(run_dir)
    assert [(row["epoch"], row["split"], row["image_size"]) for row in metrics_rows(run_dir)] == [
        ("0", "train", "24"), ("0", "val", "32"), ("0", "val_ema", "32"),
        ("1", "train", "32"), ("1", "val", "32"), ("1", "val_ema", "32")]
    saved_in_epoch_1 = {path: torch.load(path, map_location="cpu", weights_only=False)
                        for path in run_dir.glob("checkpoint-epoch001-images*.pth.tar")}
    (mid_epoch,) = [path for path, saved in saved_in_epoch_1.items() if saved["images_done"] == 12]  # step 3 of 6
    assert max_abs_diff(saved_in_epoch_1[mid_epoch]["state_dict"], uninterrupted["state_dict"]) > 1e-3
    rest = run_script([*run, "--resume", mid_epoch])  # a fresh process, as after a real interruption
    assert rest.returncode == 0, rest.stderr
    resumed = torch.load(run_dir / "checkpoint.pth.tar", map_location="cpu", weights_only=False)
    assert max_abs_diff(resumed["state_dict"], uninterrupted["state_dict"]) <= 1e-6
    assert max_abs_diff(resumed["model_ema"]["state_dict"], uninterrupted["model_ema"]["state_dict"]) <= 1e-6
    rows = metrics(run_dir)
    assert [{**row, "loss": None} for row in rows] == [{**row, "loss": None} for row in uninterrupted_metrics]
    for ours, theirs in zip(rows, uninterrupted_metrics):
        assert float(ours["loss"]) == pytest.approx(float(theirs["loss"]), rel=1e-5, abs=1e-6)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from common.tools.demo_data import write_digits

    root = tmp_path_factory.mktemp("recipes") / "digits"
    write_digits(root)  # make demo's: 1,438 training and 359 validation images of 64 px
    return root


# What every recipe's run here overrides: the image sizes (ImageNet's are the recipes'), the batch and the
# epochs' length, the digits' crops and flips (a mirrored 2 is no 2), the worker count; and the upstream
# tutorial's --opt-level O2, whose bf16 the CPU may emulate at many times fp32's cost.
SMALL = {"train-crop-size": "32", "val-resize-size": "36", "val-crop-size": "32", "batch-size": "8",
         "epochs": "2", "warmup-epochs": "1", "progressive-resizing": ["24", "32", "0", "1"], "progressive-step": "8",
         "hflip": "0", "crop-scale": ["0.5", "1"], "val-flip": None, "opt-level": "O0"}


def _override(recipe: recipes.Recipe) -> list:
    words = []
    for key, value in SMALL.items():
        if key == "progressive-resizing" and key not in recipe.flags:
            continue  # a recipe without it trains at --train-crop-size
        if key == "val-flip":
            words.append("--no-val-flip")
        elif key != "opt-level" or key in recipe.flags:
            words += [f"--{key}", *(value if isinstance(value, list) else [value])]
    return words


def _option(parser, key: str) -> str:
    """The Config field (argparse destination) of a recipe key, a long flag spelling."""
    return parser._option_string_actions[f"--{key}"].dest


@pytest.mark.slow
@pytest.mark.parametrize("name", recipes.names())
def test_every_recipe_starts_on_the_digits_with_its_flags_in_config_json(digits, tmp_path, name):
    recipe = recipes.read(name)
    script = "imagenet_ddp_apex.py" if "opt-level" in recipe.flags else "imagenet_nd.py"
    done = run_script([REPO / script, digits, "--recipe", name, *_override(recipe), "-j", "0",
                       "--steps-per-epoch", "2", "-p", "1", "--logdir", tmp_path], timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = single_run_dir(tmp_path)
    config = json.loads((run_dir / "config.json").read_text())
    parser = build_parser("ddp_apex" if script == "imagenet_ddp_apex.py" else "nd")
    given = {_option(parser, key) for key in SMALL if f"--{key}" in parser._option_string_actions}
    overridden = [key for key in recipe.flags if _option(parser, key) in given]  # under any of its spellings
    assert config["recipe"]["set"] == recipe.flags and config["recipe"]["overridden"] == overridden
    for key, value in recipe.flags.items():
        if key not in overridden:  # the recipe's value, as the run used it
            used = config["options"][_option(parser, key)]
            assert used == value or (isinstance(used, list) and used == list(value)), (key, used, value)
    splits = ["train", "val", "val_ema"] if recipe.flags.get("model-ema") else ["train", "val"]
    assert [(row["epoch"], row["split"]) for row in metrics_rows(run_dir)] == [
        (str(epoch), split) for epoch in range(2) for split in splits]
    assert all(row["images"] == "359" for row in metrics_rows(run_dir) if row["split"] != "train")


# docs/recipes.md's digits commands: the recipe, with the epochs, the image sizes, the batch and the rate made
# for 1,438 images of 32 px, the digits' crops and flips, and (torchvision-v2) an EMA of a horizon of a few
# dozen steps instead of an ImageNet run's thousands.
DIGITS_RUNS = {
    "torchvision-v2": ["-a", "resnet18", "--epochs", "20", "-b", "32", "--lr", "0.4", "--warmup-epochs", "2",
                       "--train-crop-size", "32", "--val-resize-size", "36", "--val-crop-size", "32",
                       "--model-ema-steps", "4", "--model-ema-decay", "0.984"],
    "ffcv-rn18-16": ["--epochs", "10", "-b", "64", "--lr", "0.4", "--progressive-resizing", "24", "32", "4", "7",
                     "--progressive-step", "8", "--image-size", "32", "--val-resize-size", "36", "--val-crop-size",
                     "32", "--no-val-flip"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", DIGITS_RUNS)
def test_a_recipe_trains_the_digits_to_95_percent(digits, tmp_path, name):
    done = run_script([REPO / "imagenet_nd.py", digits, "--recipe", name, *DIGITS_RUNS[name], "--crop-scale", "0.5",
                       "1", "--hflip", "0", "-j", "1", "-p", "100", "--logdir", tmp_path], timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = metrics_rows(single_run_dir(tmp_path))
    last_epoch = rows[-1]["epoch"]
    top1 = {row["split"]: float(row["top1"]) for row in rows if row["epoch"] == last_epoch and row["split"] != "train"}
    print(f"{name}: epoch {last_epoch}, validation top-1 {top1}")  # the model's and, with --model-ema, the EMA's
    assert all(row["images"] == "359" for row in rows if row["split"] != "train")
    assert max(top1.values()) >= 95.0, top1
