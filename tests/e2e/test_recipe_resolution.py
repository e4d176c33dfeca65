"""Resolution and sampling end to end (docs/recipes.md): a run with
progressive resizing, repeated augmentation, a validation crop of its own
and test-time flip, resumed mid-epoch, ends on the uninterrupted run's
weights and rows; --evaluate repeats its last validation."""
import pytest

import imagenet_nd
from common.rundir import CHECKPOINT_NAME
from helpers import DETERMINISTIC_COLUMNS, load_checkpoint, max_abs_diff, metrics_rows, single_run_dir, weights

# SqueezeNet 1.1 (its checkpoints are 5 MB, ResNet-18's 90), its dropout seeded per step; one data-loading
# worker, which must get each epoch's size.
ARGS = ["-a", "squeezenet1_1", "-b", "4", "-j", "1", "-p", "100"]


def said(output: str, fragment: str) -> list:
    return [line for line in output.splitlines() if fragment in line]


@pytest.mark.slow
def test_a_progressive_repeated_flipped_run_resumed_mid_epoch_ends_on_the_uninterrupted_weights(tiny_data, tmp_path,
                                                                                                  capsys):
    # 24 training images (24 px), 6 steps an epoch; crops of 24 then 32 px; each drawn image twice an epoch
    # (12 images), each copy its own crop; validation at 32 of 40 px, mirrored too.
    command = [str(tiny_data), *ARGS, "--epochs", "2", "--image-size", "32", "--progressive-resizing", "24", "32",
               "0", "1", "--progressive-step", "8", "--val-resize-size", "40", "--val-crop-size", "32", "--val-flip",
               "--ra-sampler", "--ra-reps", "2", "--checkpoint-every", "4steps", "--keep-checkpoints", "10",
               "--logdir", str(tmp_path / "runs")]
    imagenet_nd.main(command)
    run_dir = single_run_dir(tmp_path / "runs")
    uninterrupted, rows = weights(run_dir), metrics_rows(run_dir)
    assert said(capsys.readouterr().out, "training crop") == ["epoch 0: training crop 24 px",
                                                              "epoch 1: training crop 32 px"]
    assert [(row["split"], row["image_size"], row["images"]) for row in rows] == [
        ("train", "24", "24"), ("val", "32", "9"), ("train", "32", "24"), ("val", "32", "9")]

    # After 4 of epoch 0's 6 steps (16 of its 24 images), resumed by a fresh run of the same command: the
    # rest of epoch 0's order at 24 px, then epoch 1 at 32.
    mid_epoch = run_dir / "checkpoint-epoch000-images00000016.pth.tar"
    assert load_checkpoint(mid_epoch)["images_done"] == 16
    imagenet_nd.main([*command, "--resume", str(mid_epoch)])
    output = capsys.readouterr().out
    assert f"resumed from {mid_epoch} (epoch 0 after 4 steps (16 images)" in output
    assert said(output, "training crop") == ["epoch 0: training crop 24 px", "epoch 1: training crop 32 px"]
    assert max_abs_diff(weights(run_dir), uninterrupted) <= 1e-6
    resumed = metrics_rows(run_dir)
    columns = [*DETERMINISTIC_COLUMNS, "image_size"]
    assert [{column: row[column] for column in columns if column != "loss"} for row in resumed] == \
        [{column: row[column] for column in columns if column != "loss"} for row in rows]
    assert all(float(ours["loss"]) == pytest.approx(float(theirs["loss"]), abs=1e-6)
               for ours, theirs in zip(resumed, rows))

    # --evaluate with the same sizes and flip: the last epoch's validation again.
    imagenet_nd.main([*command, "--evaluate", "--resume", str(run_dir / CHECKPOINT_NAME)])
    (line,) = said(capsys.readouterr().out, "validation:")
    assert f"loss {float(rows[-1]['loss']):.4f}" in line and f"top1 {float(rows[-1]['top1']):.2f}%" in line
