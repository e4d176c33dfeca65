"""On a CUDA GPU (skipped elsewhere): the single-device script picks the GPU by itself."""
import csv
import json
import math

import pytest

from conftest import REPO, run_script


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [[], ["--channels-last"]])
def test_synthetic_steps_on_the_gpu(tmp_path, extra):
    result = run_script([REPO / "imagenet_nd.py", "--synthetic", "-a", "resnet18", "-b", "64", "--epochs", "1",
                         "--steps-per-epoch", "3", "--logdir", tmp_path / "runs", *extra],
                        env_extra={"CUDA_VISIBLE_DEVICES": "0"}, timeout=600)
    assert result.returncode == 0, result.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert "_gpux1_" in run_dir.name
    config = json.loads((run_dir / "config.json").read_text())
    assert config["environment"]["device"] != "cpu" and config["environment"]["gpus_visible"] >= 1
    with open(run_dir / "metrics.csv", newline="") as handle:
        train = next(row for row in csv.DictReader(handle) if row["split"] == "train")
    assert int(train["images"]) == 3 * 64 and math.isfinite(float(train["loss"]))
