"""Training on shards, end to end: a run on a folder tree's shards ends on
the weights of the run on the tree; two DDP processes on shards, stopped
mid-epoch and resumed, end on the uninterrupted run's weights, validating
every image once; a missing shard is one line, exit status 2."""
from __future__ import annotations

import pytest
import torch

from common.rundir import CHECKPOINT_NAME
from common.tools import pack_shards
from helpers import (DALI_INSTALLED, ENV, REPO, assert_one_line_error, make_image_folder, max_abs_diff, metrics, metrics_rows,
                     run_script, single_run_dir, weights)

# Random crops and flips (the default scale and flip), drawn in a data-loading worker.
TRAIN = ["-a", "squeezenet1_1", "--image-size", "32", "--val-resize", "32", "-b", "4", "-j", "1", "-p", "1"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("e2e-shards") / "data")  # 24 training, 9 (odd) val images


@pytest.fixture(scope="module")
def packed(tree):
    out = tree.parent / "packed"
    pack_shards.main([str(tree), str(out), "--shard-size", "10K"])
    return out


@pytest.mark.slow  # two runs, ~7 s each backend
@pytest.mark.parametrize("backend", ["torchvision", "pil", pytest.param("dali", marks=pytest.mark.skipif(
    not DALI_INSTALLED, reason="NVIDIA DALI is not installed (pip install -r requirements-dali.txt)"))])
def test_a_run_on_the_shards_ends_on_the_weights_of_the_run_on_the_tree(tree, packed, tmp_path, backend):
    """Every backend reads the shards' bytes where it reads a file's (dali: decoded in the training
    process, on the CPU here); the gpu backend's workers are the dali backend's (pipelines.EncodedImages)."""
    for name, data in (("tree", tree), ("shards", packed)):
        done = run_script([REPO / "imagenet_nd.py", data, *TRAIN, "--epochs", "1", "--data-backend", backend,
                           "--logdir", tmp_path / name], env_extra=ENV)
        assert done.returncode == 0, done.stderr
    assert f"shards: 9 in {packed}, images as packed from the source" in done.stdout
    on_tree, on_shards = single_run_dir(tmp_path / "tree"), single_run_dir(tmp_path / "shards")
    assert max_abs_diff(weights(on_tree), weights(on_shards)) == 0.0
    assert metrics(on_shards) == metrics(on_tree)  # every figure but the timings
    assert [row["dataset_bytes"] for row in metrics_rows(on_shards)] == [
        row["dataset_bytes"] for row in metrics_rows(on_tree)]  # the images' bytes, read from shards or files


@pytest.mark.slow  # ~20 s
def test_two_processes_on_shards_resume_mid_epoch_to_the_uninterrupted_weights(packed, tmp_path):
    # 24 images, 2 processes of 4: 3 steps an epoch; a checkpoint every 2 steps of the run gives one after
    # step 1 of epoch 1.
    run = [REPO / "imagenet_ddp.py", packed, *TRAIN, "-j", "0", "--nproc-per-node", "2", "--epochs", "2",
           "--checkpoint-every", "2steps", "--keep-checkpoints", "10", "--logdir", tmp_path / "runs"]
    whole = run_script(run, env_extra=ENV)
    assert whole.returncode == 0, whole.stderr
    run_dir = single_run_dir(tmp_path / "runs")
    uninterrupted, uninterrupted_metrics = weights(run_dir), metrics(run_dir)
    assert [row["images"] for row in uninterrupted_metrics if row["split"] == "val"] == ["9", "9"]  # each image once
    (mid_epoch,) = run_dir.glob("checkpoint-epoch001-images00000008.pth.tar")
    assert max_abs_diff(weights(mid_epoch), uninterrupted) > 1e-4
    rest = run_script([*run, "--resume", mid_epoch], env_extra=ENV)
    assert rest.returncode == 0, rest.stderr
    assert max_abs_diff(weights(run_dir / CHECKPOINT_NAME), uninterrupted) == 0.0
    assert torch.equal(torch.tensor([float(row["loss"]) for row in metrics(run_dir)]),
                       torch.tensor([float(row["loss"]) for row in uninterrupted_metrics]))


def test_a_missing_shard_is_one_line_naming_it(packed, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in packed.iterdir():
        if path.name != "val-000001.tar":
            (copy / path.name).symlink_to(path)
    done = run_script([REPO / "imagenet_nd.py", copy, *TRAIN, "--epochs", "1", "--logdir", tmp_path / "runs"],
                      env_extra=ENV)
    assert done.returncode == 2
    assert_one_line_error(done, f"DATA {copy}: val-000001.tar is missing (named by its manifest)")
