"""--model-ema end to end: a run resumed mid-epoch ends on the uninterrupted
run's weights and its average's, with the average's val_ema rows in
metrics.csv and the best checkpoint's source recorded."""
import pytest

import imagenet_nd
from common.rundir import BEST_NAME, CHECKPOINT_NAME
from helpers import FAST_ARGS, load_checkpoint, make_image_folder, max_abs_diff, metrics


def _best(rows: list) -> tuple:
    """(top-1, epoch, source) of the best epoch: each epoch's better top-1 of the model ("val") and its
    average ("val_ema"), the model's on a tie; the first epoch of the highest."""
    best = (float("-inf"), None, None)
    for epoch in sorted({int(row["epoch"]) for row in rows}):
        top1 = {row["split"]: float(row["top1"]) for row in rows if int(row["epoch"]) == epoch}
        better = (top1["val_ema"], epoch, "ema") if top1["val_ema"] > top1["val"] else (top1["val"], epoch, "model")
        if better[0] > best[0]:
            best = better
    return best


@pytest.mark.slow
def test_a_run_with_model_ema_resumed_mid_epoch_ends_on_the_uninterrupted_weights_and_average(tmp_path):
    # 21 images, global batch 4: 5 steps an epoch, so updates every 2 steps counted over the run fall on
    # steps 0, 2, 4 of epoch 0 and 1, 3 of epoch 1. Decay 0.9 adjusted: 1 - 0.1 x 4 x 2 / 2 = 0.6 per update.
    data = make_image_folder(tmp_path / "data", classes=3, train_per_class=7, val_per_class=3)
    run = [str(data), *FAST_ARGS, "-j", "0", "--epochs", "2", "--lr", "0.5", "--model-ema", "--model-ema-steps", "2",
           "--model-ema-decay", "0.9", "--checkpoint-every", "2steps", "--keep-checkpoints", "10",
           "--logdir", str(tmp_path / "runs"), "--run-name", "r"]
    imagenet_nd.main(run)
    run_dir = tmp_path / "runs" / "r"
    uninterrupted = load_checkpoint(run_dir / CHECKPOINT_NAME)
    uninterrupted_metrics = metrics(run_dir)
    average = uninterrupted["model_ema"]
    assert average["n_averaged"] == 5 and average["decay"] == pytest.approx(0.6)
    assert max_abs_diff(average["state_dict"], uninterrupted["state_dict"]) > 1e-4  # not the weights
    assert [(row["epoch"], row["split"]) for row in uninterrupted_metrics] == [
        ("0", "train"), ("0", "val"), ("0", "val_ema"), ("1", "train"), ("1", "val"), ("1", "val_ema")]
    assert [row["images"] for row in uninterrupted_metrics if row["split"] != "train"] == ["9"] * 4
    best_top1, best_epoch, best_source = _best(uninterrupted_metrics)
    assert (uninterrupted["best_acc1"], uninterrupted["best_epoch"], uninterrupted["best_source"]) == \
        pytest.approx((best_top1, best_epoch, best_source))
    assert load_checkpoint(run_dir / BEST_NAME)["best_source"] == best_source

    # After 3 steps of epoch 1 (8 in all: updates after steps 0, 2, 4, 6; the resumed run's first step,
    # the 9th, updates again).
    (mid_epoch,) = run_dir.glob("checkpoint-epoch001-images00000012.pth.tar")
    assert load_checkpoint(mid_epoch)["model_ema"]["n_averaged"] == 4
    imagenet_nd.main([*run, "--resume", str(mid_epoch)])
    resumed = load_checkpoint(run_dir / CHECKPOINT_NAME)
    assert max_abs_diff(resumed["state_dict"], uninterrupted["state_dict"]) <= 1e-6
    assert max_abs_diff(resumed["model_ema"]["state_dict"], average["state_dict"]) <= 1e-6
    assert resumed["model_ema"]["n_averaged"] == 5
    resumed_metrics = metrics(run_dir)
    assert [{**row, "loss": None} for row in resumed_metrics] == [{**row, "loss": None} for row in uninterrupted_metrics]
    assert all(float(ours["loss"]) == pytest.approx(float(theirs["loss"]), abs=1e-6)
               for ours, theirs in zip(resumed_metrics, uninterrupted_metrics))
    assert (resumed["best_epoch"], resumed["best_source"]) == (best_epoch, best_source)
