"""`make demo` end to end: real digits, ResNet-18, at least 95% validation top-1."""
import sys
import time

import pytest

from helpers import metrics_rows, run_command


@pytest.mark.slow
def test_demo_trains_digits_to_95_percent(tmp_path):
    started = time.monotonic()
    result = run_command(["bash", "run_scripts/demo.sh"],
                         env_extra={"PYTHON": sys.executable, "DATA": str(tmp_path / "digits"),
                                    "LOGDIR": str(tmp_path / "runs")}, timeout=1200)
    minutes = (time.monotonic() - started) / 60
    assert result.returncode == 0, result.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    for name in ("config.json", "metrics.csv", "checkpoint.pth.tar", "model_best.pth.tar"):
        assert (run_dir / name).is_file(), name
    assert list(run_dir.glob("events.out.tfevents.*"))
    val = [row for row in metrics_rows(run_dir) if row["split"] == "val"]
    assert len(val) == 8 and int(val[-1]["images"]) == 359
    assert float(val[-1]["top1"]) >= 95.0, [row["top1"] for row in val]
    # The closing lines say where everything is.
    assert f"run directory: {run_dir}" in result.stdout
    assert f"tensorboard --logdir {tmp_path / 'runs'}" in result.stdout
    print(f"demo: {minutes:.1f} min, final val top-1 {val[-1]['top1']}%")
