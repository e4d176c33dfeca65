"""--auto-augment, --random-erase, --mixup-alpha and --cutmix-alpha together,
end to end: a run resumed mid-epoch ends on the uninterrupted run's weights
(the images' draws are seeded per image, the mixing per step and micro-batch)."""
import json

import pytest
import torch

from helpers import FAST_ARGS, REPO, max_abs_diff, metrics, run_script, single_run_dir, weights

AUGMENTED = ["--auto-augment", "ta_wide", "--random-erase", "0.25", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0"]


@pytest.mark.slow
def test_an_augmented_and_mixed_run_resumed_mid_epoch_ends_as_the_uninterrupted_one(tiny_data, tmp_path):
    # ResNet-18 at 32 px (SqueezeNet's ReLUs die under mixing at once: a dead model resumes equal trivially);
    # two micro-batches of 2 per step, each mixed on its own, 6 steps an epoch, a checkpoint every 3 steps;
    # the images augmented in a data-loading worker (-j 1).
    run = [REPO / "imagenet_nd.py", tiny_data, *FAST_ARGS, "-b", "2", "--accum-steps", "2", "--epochs", "1",
           *AUGMENTED, "--checkpoint-every", "3steps", "--keep-checkpoints", "10", "--logdir", tmp_path / "runs"]
    whole = run_script(run)
    assert whole.returncode == 0, whole.stderr
    assert ("mixing: MixUp alpha 0.2 and CutMix alpha 1, one of the two per batch, soft targets; training "
            "top-1/top-5 count the label with the larger share of each mixed image") in whole.stdout
    run_dir = single_run_dir(tmp_path / "runs")
    options = json.loads((run_dir / "config.json").read_text())["options"]
    assert (options["auto_augment"], options["random_erase"], options["mixup_alpha"], options["cutmix_alpha"]) == (
        "ta_wide", 0.25, 0.2, 1.0)
    uninterrupted, uninterrupted_metrics = weights(run_dir), metrics(run_dir)
    (mid_epoch,) = run_dir.glob("checkpoint-epoch000-images*.pth.tar")  # after step 3 of 6
    assert torch.load(mid_epoch, map_location="cpu", weights_only=False)["images_done"] == 12
    assert max_abs_diff(weights(mid_epoch), uninterrupted) > 1e-3  # the steps after it trained
    rest = run_script([*run, "--resume", mid_epoch])  # a fresh process, as after a real interruption
    assert rest.returncode == 0, rest.stderr
    assert max_abs_diff(weights(run_dir), uninterrupted) <= 1e-6
    resumed = metrics(run_dir)
    assert [{**row, "loss": None} for row in resumed] == [{**row, "loss": None} for row in uninterrupted_metrics]
    for ours, theirs in zip(resumed, uninterrupted_metrics):
        assert float(ours["loss"]) == pytest.approx(float(theirs["loss"]), abs=1e-6)
