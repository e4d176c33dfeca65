"""The optimiser's and the schedule's recipe options end to end (docs/recipes.md, "Optimiser and
schedules"): a run with all of them at once, resumed mid-epoch in a fresh process, ends on the
uninterrupted run's weights."""
import pytest

import imagenet_nd
from helpers import FAST_ARGS, load_checkpoint, max_abs_diff, metrics, run_script, single_run_dir, weights

# Every flag of the piece: groups other, norm and bias; Nesterov; a clip the gradients of ResNet-18 pass at
# first; FFCV's linear ramp after a constant warm-up, down to a floor; BlurPool.
OPTIONS = ["--norm-weight-decay", "0", "--bias-weight-decay", "0.0005", "--nesterov", "--clip-grad-norm", "0.5",
           "--lr", "0.4", "--lr-scheduler", "linear", "--lr-warmup-epochs", "1", "--lr-warmup-method", "constant",
           "--lr-warmup-decay", "0.5", "--lr-min", "0.05", "--blurpool"]


@pytest.mark.slow
def test_a_run_with_every_optimiser_option_resumed_mid_epoch_ends_as_the_uninterrupted_one(tiny_data, tmp_path):
    # 24 images, -b 4: 6 steps an epoch, a checkpoint every 2; crops and flips drawn in the process (-j 0).
    run = [str(tiny_data), *FAST_ARGS, "-j", "0", "--epochs", "2", "--checkpoint-every", "2steps",
           "--keep-checkpoints", "10", "--logdir", str(tmp_path / "runs"), *OPTIONS]
    imagenet_nd.main(run)
    run_dir = single_run_dir(tmp_path / "runs")
    uninterrupted, uninterrupted_metrics = weights(run_dir), metrics(run_dir)
    mid_epoch = run_dir / "checkpoint-epoch001-images00000008.pth.tar"  # after 2 of epoch 1's 6 steps
    state = load_checkpoint(mid_epoch)
    assert (state["epoch"], state["step"]) == (1, 2)
    groups = state["optimizer"]["param_groups"]
    assert [(group["group"], group["weight_decay"], group["nesterov"]) for group in groups] == \
        [("other", 1e-4, True), ("norm", 0.0, True), ("bias", 0.0005, True)]
    assert any(key.endswith(".1.weight") for key in state["state_dict"])  # convolutions behind their blur

    rest = run_script(["imagenet_nd.py", *run, "--resume", mid_epoch])
    assert rest.returncode == 0, rest.stderr
    assert f"resumed from {mid_epoch} (epoch 1 after 2 steps (8 images)" in rest.stdout
    # The peak 0.4 x 4/256 and the floor 0.05 x 4/256, said once.
    assert rest.stdout.count("lr 0.4 x 4/256 = 0.00625, linear schedule from the peak after warm-up to 0.00078125 at "
                             "the last step; constant warm-up over 1 epoch(s), per step, at 0.5 x the rate") == 1
    assert "gradients clipped to norm 0.5" in rest.stdout
    assert max_abs_diff(weights(run_dir), uninterrupted) <= 1e-6
    resumed = metrics(run_dir)
    assert [{**row, "loss": None} for row in resumed] == [{**row, "loss": None} for row in uninterrupted_metrics]
    assert [row["lr"] for row in resumed if row["split"] == "train"] == ["0.003125", "0.00078125"]
    for ours, theirs in zip(resumed, uninterrupted_metrics):
        assert float(ours["loss"]) == pytest.approx(float(theirs["loss"]), abs=1e-6)
