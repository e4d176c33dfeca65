"""-a timm/NAME end to end: every script trains timm's tiny test models on the
digits as it trains torchvision's (bf16 for the Apex script on the CPU), the
checkpoint loads into plain timm, and a DDP run of two processes resumed
mid-epoch, channels-last with stochastic depth, ends on the uninterrupted
run's weights; SyncBN under DDP where there is a GPU."""
import json
import math

import pytest

from common import engine, models
from helpers import (ENV, REPO, load_checkpoint, make_image_folder, max_abs_diff, metrics, run_script,
                     single_run_dir, weights)

timm = pytest.importorskip("timm", reason="timm is optional: pip install -r requirements-timm.txt")

TIMM = ["--image-size", "32", "--val-resize", "32", "-b", "4", "-j", "0", "-p", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("timm") / "data")  # 24 training images, 9 val, 3 classes


@pytest.mark.parametrize("script, extra, world", [
    ("imagenet_nd.py", [], 1),
    pytest.param("imagenet_dp.py", [], 1, marks=pytest.mark.slow),
    pytest.param("imagenet_ddp.py", ["--nproc-per-node", "2"], 2, marks=pytest.mark.slow),
    pytest.param("imagenet_ddp_apex.py", ["--opt-level", "O1", "--amp-dtype", "bf16"], 1, marks=pytest.mark.slow),
])
def test_each_script_trains_a_timm_model_that_plain_timm_loads(data, tmp_path, script, extra, world):
    arch = "timm/test_efficientnet" if script == "imagenet_ddp_apex.py" else "timm/test_resnet"
    result = run_script([REPO / script, data, "-a", arch, *TIMM, "--epochs", "1", "--steps-per-epoch", "3",
                         "--drop-path", "0.1", "--logdir", tmp_path, *extra], env_extra=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = single_run_dir(tmp_path)
    assert f"_{arch.replace('/', '-')}_cpux{world}_b4_" in run_dir.name
    train = next(row for row in metrics(run_dir) if row["split"] == "train")
    assert (int(train["steps"]), int(train["images"])) == (3, 3 * 4 * world) and math.isfinite(float(train["loss"]))
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["options"]["arch"], config["options"]["drop_path"]) == (arch, 0.1)

    engine.seed_everything(0)  # the scripts' initialisation, to show the 3 steps moved the weights
    initial = models.build_model(arch, 3, image_size=32).state_dict()
    trained = weights(run_dir)
    assert trained.keys() == initial.keys() and max_abs_diff(trained, initial) > 1e-4
    plain = timm.create_model(arch.split("/")[1], num_classes=3)
    plain.load_state_dict(trained)  # strict: the checkpoint is timm's own model, nothing of this project


@pytest.mark.slow
def test_ddp_run_resumed_mid_epoch_ends_on_the_uninterrupted_weights(data, tmp_path):
    # 24 images, global batch 8: 3 steps an epoch; a checkpoint every 2 steps, so one after epoch 1's first step.
    run = [REPO / "imagenet_ddp.py", data, "-a", "timm/test_efficientnet", *TIMM, "--nproc-per-node", "2",
           "--epochs", "2", "--lr", "0.5", "--drop-path", "0.2", "--channels-last", "--checkpoint-every", "2steps",
           "--keep-checkpoints", "10", "--logdir", tmp_path, "--run-name", "r"]
    result = run_script(run, env_extra=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "r"
    uninterrupted, uninterrupted_metrics = load_checkpoint(run_dir / "checkpoint.pth.tar"), metrics(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["resolved"]["channels_last"] is True and config["environment"]["world_size"] == 2

    (mid_epoch,) = run_dir.glob("checkpoint-epoch001-images00000008.pth.tar")
    result = run_script([*run, "--resume", mid_epoch], env_extra=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = load_checkpoint(run_dir / "checkpoint.pth.tar")
    assert resumed["arch"] == "timm/test_efficientnet" and resumed["epoch"] == uninterrupted["epoch"] == 2
    assert max_abs_diff(resumed["state_dict"], uninterrupted["state_dict"]) == 0.0
    assert [{**row, "loss": None} for row in metrics(run_dir)] == \
        [{**row, "loss": None} for row in uninterrupted_metrics]


@pytest.mark.gpu
def test_sync_bn_under_ddp_trains_a_timm_model_with_fused_norms_on_the_gpu(tmp_path):
    result = run_script([REPO / "imagenet_ddp.py", "--synthetic", "-a", "timm/test_efficientnet", "-b", "16",
                         "--image-size", "64", "--epochs", "1", "--steps-per-epoch", "3", "--sync-bn",
                         "--channels-last", "--logdir", tmp_path], env_extra={"CUDA_VISIBLE_DEVICES": "0"},
                        timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    train = next(row for row in metrics(single_run_dir(tmp_path)) if row["split"] == "train")
    assert int(train["steps"]) == 3 and math.isfinite(float(train["loss"]))
