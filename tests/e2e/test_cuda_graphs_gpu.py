"""--cuda-graphs on a CUDA GPU (skipped elsewhere; tests/unit/test_cuda_graphs.py has the logic on the CPU and
the step against eager steps in one process): the scripts as a user runs them, DDP included."""
import math

import pytest

from helpers import REPO, max_abs_diff, metrics_rows, run_script, single_run_dir, weights

# Synthetic ResNet-18 steps, small enough for a few seconds: 20 steps, so DDP's 11 eager steps come first.
ARGS = ["--synthetic", "-a", "resnet18", "--image-size", "64", "--val-resize", "64", "-b", "32", "--epochs", "1",
        "--steps-per-epoch", "20", "-p", "1", "--seed", "3", "--deterministic"]


def train_row(run_dir):
    return next(row for row in metrics_rows(run_dir) if row["split"] == "train")


def run(tmp_path, script, name, *extra):
    logdir = tmp_path / name
    result = run_script([REPO / script, *ARGS, "--logdir", logdir, *extra], env_extra={"CUDA_VISIBLE_DEVICES": "0"},
                        timeout=600)
    assert result.returncode == 0, result.stderr
    return result, single_run_dir(logdir)


@pytest.mark.gpu
@pytest.mark.parametrize("script, extra, warmup", [
    ("imagenet_nd.py", [], 3),
    ("imagenet_ddp_apex.py", ["--opt-level", "O2"], 11),  # DDP (one process), fp16 with its GradScaler
])
def test_a_run_with_graphs_ends_near_the_run_without_and_says_what_the_capture_cost(tmp_path, script, extra, warmup):
    graphed, graphed_dir = run(tmp_path, script, "on", "--cuda-graphs", "on", *extra)
    eager, eager_dir = run(tmp_path, script, "off", "--cuda-graphs", "off", *extra)
    ddp = " (DDP)" if warmup == 11 else ""
    assert (f"--cuda-graphs on: the training step captured in a CUDA graph after {warmup} eager steps{ddp}, then "
            f"replayed; a batch of another shape and validation run eagerly") in graphed.stdout
    (capture,) = [line for line in graphed.stdout.splitlines() if line.startswith("cuda graphs: training step")]
    assert capture.startswith(f"cuda graphs: training step captured at epoch 0 step {warmup} for batches of "
                              f"32x3x64x64 in ")
    assert capture.endswith("more GPU memory reserved")
    assert "cuda graphs" not in eager.stdout
    on_row, off_row = train_row(graphed_dir), train_row(eager_dir)
    assert int(on_row["steps"]) == int(off_row["steps"]) == 20
    assert math.isclose(float(on_row["loss"]), float(off_row["loss"]), rel_tol=2e-2)
    assert max_abs_diff(weights(graphed_dir), weights(eager_dir)) < 5e-2


@pytest.mark.gpu
def test_what_cannot_be_captured_trains_eagerly_and_says_why(tmp_path):
    result, run_dir = run(tmp_path, "imagenet_nd.py", "accum", "--cuda-graphs", "on", "--accum-steps", "2")
    assert ("--cuda-graphs on: every training step eager, for --accum-steps 2 (micro-batches, the first under "
            "DDP's no_sync)") in result.stdout
    assert "captured at" not in result.stdout
    assert int(train_row(run_dir)["steps"]) == 20


@pytest.mark.gpu
def test_auto_stays_eager_until_measured(tmp_path):
    result, _ = run(tmp_path, "imagenet_nd.py", "auto")
    assert "cuda graphs: off (--cuda-graphs auto stays eager until run_scripts/gpu_check.sh" in result.stdout
