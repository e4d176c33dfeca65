"""common.tools.plots: the derived numbers on upstream's real logs (the acceptance
figures) and on run directories with hand-computed values; the figures'
files and axis labels; the notebook that draws the same figures."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from common.tools import plots
from helpers import REPO, START, UPSTREAM, epoch_rows, make_runs, write_run

# Acceptance figures from upstream's RESULTS.md and README (global images/s, mean over epochs).
UPSTREAM_IMAGES_PER_SECOND = {2: 1582, 4: 3003, 8: 5804, 16: 11232, 32: 19477, 64: 32938}
# Upstream's training times where its table counts every epoch (plus ~15-25 s of start-up)...
UPSTREAM_TRAINING_SECONDS = {8: 20904, 16: 10969, 32: 6653, 64: 4071}
# ...and where it quotes last - first end-of-epoch wall time, which leaves the first epoch out.
UPSTREAM_LAST_MINUS_FIRST_SECONDS = {4: 39536, 2: 66790}


def test_upstream_acceptance_numbers():
    """Upstream's published throughput, training time and scaling efficiency
    follow from its CSV logs with the one definition in common.tools.plots."""
    runs = plots.load([UPSTREAM]).runs
    summary = plots.summarize(runs).set_index("gpus")
    assert sorted(summary.index) == [2, 4, 8, 16, 32, 64] and set(summary["runs"]) == {1}
    for gpus, images_per_second in UPSTREAM_IMAGES_PER_SECOND.items():
        assert summary.loc[gpus, "images_per_second"] == pytest.approx(images_per_second, rel=0.01)
    for gpus, seconds in UPSTREAM_TRAINING_SECONDS.items():  # (last - first) + one mean epoch
        assert summary.loc[gpus, "training_seconds"] == pytest.approx(seconds, rel=0.01)
    assert summary.loc[8, "training_seconds"] == pytest.approx(20888.5, abs=1)
    # Upstream's 4- and 2-GPU figures are exactly last - first: counted in full, the runs took one epoch more.
    for gpus, seconds in UPSTREAM_LAST_MINUS_FIRST_SECONDS.items():
        run = next(run for run in runs if run.replicas == gpus)
        ends = run.epochs["end_time"]
        span = ends.iloc[-1] - ends.iloc[0]
        assert span == pytest.approx(seconds, abs=1)
        assert summary.loc[gpus, "training_seconds"] == pytest.approx(span * len(ends) / (len(ends) - 1))
    assert summary.loc[2, "epochs"] == "81" and summary.loc[64, "epochs"] == "90"
    assert summary.loc[2, "images_per_second_per_gpu"] == pytest.approx(791, rel=0.01)
    assert summary.loc[64, "images_per_second_per_gpu"] == pytest.approx(515, rel=0.01)
    assert summary.loc[64, "scaling_efficiency_percent"] == pytest.approx(65, abs=1)
    assert summary.loc[2, "scaling_efficiency_percent"] == pytest.approx(100)
    assert summary.loc[8, "last_val_top1"] == pytest.approx(76.29, abs=0.01)


def test_derived_numbers_of_synthetic_runs(tmp_path):
    made = make_runs(tmp_path / "runs")
    logs = plots.load([tmp_path / "runs"])
    two = next(run for run in logs.runs if run.replicas == 2)
    assert two.device_kind == "cpu" and list(two.epochs.index) == [0, 1, 2]
    assert plots.training_seconds(two) == pytest.approx(360.0)  # the 4,640 s gap excluded
    assert plots.mean_images_per_second(two) == pytest.approx(50.0)  # 999 was overwritten by the later row
    assert plots.time_to_accuracy(two) == (1, pytest.approx(240.0))  # desired 50%: epoch 1 (55%)
    assert plots.time_to_accuracy(two, 99.0) is None
    summary = plots.summarize(logs.runs).set_index("gpus")
    assert summary.loc[4, "runs"] == 2 and summary.loc[4, "images_per_second"] == pytest.approx(160.0)
    assert summary.loc[4, "images_per_second_per_gpu"] == pytest.approx(40.0)
    assert summary.loc[4, "training_seconds"] == pytest.approx(240.0)
    assert summary.loc[4, "scaling_efficiency_percent"] == pytest.approx(100 * 40 / 25)  # baseline: 25 at 2
    # io.csv: the two nodes' reads add up; the missing counters stay missing, never 0.
    (trace,) = logs.io
    assert list(trace.frame["read_bytes_per_second"]) == [3e6, 3e6, 3e6]
    assert list(trace.frame["elapsed_seconds"]) == [0.0, 10.0, 20.0]
    assert trace.frame[["write_bytes_per_second", "read_ops_per_second"]].isna().all().all()
    assert made["two"].name == two.name


def test_tensorboard_event_directory(tmp_path):
    """A directory of TensorBoard events alone: grouped by gpux<N> in its name;
    training time = (last - first epoch end) + one mean epoch."""
    from torch.utils.tensorboard import SummaryWriter

    run_dir = tmp_path / "Nov23_10-00-00_node_resnet50_gpux8_b208_cpu20_optO2"
    writer = SummaryWriter(str(run_dir))
    for step, (speed, top1) in enumerate([(1000.0, 10.0), (1100.0, 20.0), (1200.0, 30.0)], start=1):
        end = START + 100 * step  # epochs end every 100 s: 3 epochs took 300 s
        writer.add_scalar("Throughput/train", speed, step, walltime=end - 10)
        writer.add_scalar("Top1/val", top1, step, walltime=end)
        writer.add_scalar("Data/wait_fraction", 0.25, step, walltime=end - 10)
    writer.close()
    (run,) = plots.load([tmp_path]).runs
    assert (run.replicas, run.device_kind) == (8, "gpu")
    assert plots.mean_images_per_second(run) == pytest.approx(1100.0)
    assert plots.training_seconds(run) == pytest.approx(300.0)
    assert plots.time_to_accuracy(run, 20.0) == (1, pytest.approx(200.0))
    assert list(run.epochs["data_wait_fraction"]) == [0.25] * 3


def test_storage_monitor_pairs():
    """bandwidth_<key> pairs with iops_<key>; a bandwidth file without a partner stands alone."""
    traces = {trace.label: trace for trace in plots.load([UPSTREAM / "IO"]).io}
    assert sorted(traces) == ["storage monitor gpux64_cpu20_aprl30", "storage monitor gpux64_cpu20_feb"]
    april = traces["storage monitor gpux64_cpu20_aprl30"].frame
    february = traces["storage monitor gpux64_cpu20_feb"].frame
    assert april.loc[0, "read_bytes_per_second"] == pytest.approx(746905.6)
    assert april.loc[0, "read_ops_per_second"] == pytest.approx(0.9166666666666666)
    assert list(april["elapsed_seconds"][:3]) == [0.0, 60.0, 120.0]  # one row a minute
    assert february["read_ops_per_second"].isna().all() and len(february) == 76


AXIS_UNIT = re.compile(r"\(.+\)|epoch|GPUs|process")  # a unit in brackets, or what is counted


def assert_labelled(figure):
    for ax in figure.axes:
        for label in (ax.get_xlabel(), ax.get_ylabel()):
            assert label and AXIS_UNIT.search(label), f"axis label without a unit: {label!r}"


def test_figures_written_with_labelled_axes(tmp_path, capsys):
    """Upstream and this project's CPU runs together: every figure has data,
    is written as PNG and PDF, and each hardware is its own scaling series."""
    make_runs(tmp_path / "runs")
    written = plots.main([str(UPSTREAM), str(tmp_path / "runs"), "--out", str(tmp_path / "figures"),
                          "--smooth", "0.6"])
    names = ["top1_train", "top1_val", "top5_train", "top5_val", "training_throughput", "scaling_efficiency",
             "training_time", "IO", "data_wait"]
    assert sorted(written) == sorted(tmp_path / "figures" / (name + suffix) for name in names
                                     for suffix in (".png", ".pdf"))
    assert all(path.stat().st_size > 1000 for path in written)
    assert capsys.readouterr().out.count(".png, .pdf") == len(names)
    figures = plots.make_figures(plots.load([UPSTREAM, tmp_path / "runs"]), smooth=0.6)
    for figure in figures.values():
        assert_labelled(figure)
    throughput = figures["training_throughput"].axes[0]
    series = [line.get_label() for line in throughput.get_lines() if "ideal" not in line.get_label()]
    assert series == ["CPU (Test CPU 9000): resnet18 optO0 (mean of 1/2 runs)", "upstream: resnet50 optO2"]
    assert [tick for tick in throughput.get_xticks()] == [2, 4, 8, 16, 32, 64]
    assert throughput.get_xlabel() == "GPUs or CPU processes"
    legend = [text.get_text() for text in figures["top1_val"].axes[0].get_legend().get_texts()]
    assert "CPU (Test CPU 9000): resnet18 optO0: 4 CPU processes #2" in legend
    assert "upstream: resnet50 optO2: 64 GPUs" in legend
    # The 2-GPU upstream run's 81 epochs are annotated on the training-time figure.
    assert any("81 epochs" in text.get_text() for text in figures["training_time"].axes[0].texts)


def test_figures_without_data_are_not_written(tmp_path, capsys):
    """Upstream logs have no data-wait share; a run whose io.csv has no counters has no IO figure."""
    rows = epoch_rows(0, START, 40, 30.0) + epoch_rows(1, START + 120, 50, 55.0)
    write_run(tmp_path / "runs", "Nov23_10-00-00_h_resnet18_cpux1_b4_cpu1_optO0", 1, rows,
              io_rows=[(START, "h", "", "", "", "", ""), (START + 5, "h", "", "", "", "", "")])
    figures = plots.make_figures(plots.load([tmp_path / "runs"]))
    assert figures["IO"] == "no block-device counters in any I/O log"
    plots.main([str(UPSTREAM / "Top1_val"), "--out", str(tmp_path / "figures")])
    out = capsys.readouterr().out
    assert "data_wait: not written (no input has a data-wait share" in out
    assert "training_throughput: not written" in out
    # Validation top-1 alone: its wall times still give the training time.
    assert sorted(path.name for path in (tmp_path / "figures").iterdir()) == [
        "top1_val.pdf", "top1_val.png", "training_time.pdf", "training_time.png"]


@pytest.mark.slow
def test_user_errors_exit_2_with_one_line(tmp_path):
    for argv, message in (([str(tmp_path / "missing")], "missing: no such file or directory"),
                          ([str(tmp_path)], "no run directories, TensorBoard logs or storage-monitor CSVs"),
                          ([str(UPSTREAM), "--smooth", "1.5"], "argument --smooth")):
        done = subprocess.run([sys.executable, "-m", "common.tools.plots", *argv, "--out", str(tmp_path / "f")],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr
        assert done.stderr.startswith("python -m common.tools.plots: error: ")
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.slow
def test_notebook_draws_the_figures(tmp_path):
    """figures/figures.ipynb, its code cells run in order in a fresh Python
    (no Jupyter), writes the figures of results/runs to $FIGURES_OUT and
    those of the upstream logs to $FIGURES_OUT/upstream."""
    notebook = json.loads((REPO / "figures" / "figures.ipynb").read_text())
    assert notebook["nbformat"] == 4
    code = [("".join(cell["source"])) for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert not any(line.lstrip().startswith(("%", "!")) for cell in code for line in cell.splitlines())
    runner = ("import json, sys\nnamespace = {'__name__': '__main__'}\n"
              "for index, cell in enumerate(json.load(sys.stdin)):\n"
              "    exec(compile(cell, f'cell {index}', 'exec'), namespace)\n")
    out = tmp_path / "figures"
    env = dict(os.environ, MPLBACKEND="Agg", FIGURES_OUT=str(out))
    done = subprocess.run([sys.executable, "-c", runner], input=json.dumps(code), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # The upstream logs' figures in upstream/; this project's committed runs' figures beside it.
    for folder, names in ((out / "upstream", ("top1_train", "top1_val", "top5_train", "top5_val",
                                              "training_throughput", "scaling_efficiency", "training_time", "IO")),
                          (out, ("top1_val", "training_throughput", "scaling_efficiency", "data_wait"))):
        for name in names:
            for suffix in (".png", ".pdf"):
                assert (folder / (name + suffix)).stat().st_size > 1000, folder / (name + suffix)


def test_labels_say_what_is_counted():
    assert plots.count_label(1, "gpu") == "1 GPU" and plots.count_label(8, "gpu") == "8 GPUs"
    assert plots.count_label(2, "cpu") == "2 CPU processes" and plots.count_label(1, "cpu") == "1 CPU process"
    assert plots._arch_and_opt("Feb08_13-47-09_hal11_wide_resnet50_2_gpux8_b208_cpu20_optO2") == "wide_resnet50_2 optO2"
    assert math.isnan(plots.training_seconds(plots.Run("r", "p", 1, "gpu", "s", "h", plots.pd.DataFrame(
        {"end_time": [1.0], "train_start": [math.nan]}))))


def test_runs_in_progress_and_data_parallel_runs(tmp_path):
    """A run still validating its last epoch counts only its validated epochs; one not past its first
    epoch and an io.csv not yet written are skipped; imagenet_dp.py's "4 x <GPU>" is that GPU's series."""
    validating = epoch_rows(0, START, 100.0, 50.0) + epoch_rows(1, START + 200, 120.0, 60.0)[:1]
    two = write_run(tmp_path, "Nov01_00-00-00_h_resnet18_gpux2_b4_cpu1_optO0", 2, validating, device="2 x NVIDIA H100")
    (two / "io.csv").write_text("")
    four = write_run(tmp_path, "Nov01_00-00-01_h_resnet18_gpux4_b4_cpu1_optO0", 4, epoch_rows(0, START, 180.0, 50.0),
                     device="4 x NVIDIA H100")
    (tmp_path / "just-started").mkdir()
    (tmp_path / "just-started" / "config.json").write_text("{}")
    logs = plots.load([tmp_path])
    assert [run.name for run in logs.runs] == [two.name, four.name] and logs.io == []
    assert list(logs.runs[0].epochs.index) == [0] and plots.mean_images_per_second(logs.runs[0]) == 100.0
    table = plots.summarize(logs.runs)
    assert table["series"].tolist() == ["NVIDIA H100: resnet18 optO0"] * 2
    assert table["scaling_efficiency_percent"].tolist() == [100.0, 90.0]  # 50 and 45 images/s per GPU


def cut_last_line_in_a_number(path, column: str) -> str:
    """Cut `path`'s last line in the middle of its `column` value, as a process killed mid-append leaves
    it (no line break at the end); returns the cut line."""
    lines = path.read_text().splitlines(keepends=True)
    header = lines[0].rstrip().split(",")
    fields = lines[-1].rstrip().split(",")
    value = fields[header.index(column)]
    cut = ",".join(fields[:header.index(column)] + [value[:len(value) // 2]])
    path.write_text("".join(lines[:-1]) + cut)
    return cut


def test_a_run_whose_last_rows_a_crash_cut_is_read_to_its_whole_rows_and_the_rest_named(tmp_path, capsys):
    rows = epoch_rows(0, START, 40, 30.0) + epoch_rows(1, START + 120, 50, 55.0) + epoch_rows(2, START + 240, 60, 60.0)
    io_rows = [(START + t, "a", "sda", 1e6, "", "", "") for t in (0, 10, 20)]
    run_dir = write_run(tmp_path, "Nov23_10-00-00_node-a_resnet18_cpux2_b4_cpu1_optO0", 2, rows, io_rows=io_rows)
    # Epoch 2's val row cut inside its wall time: read, it would end epoch 2 at a time 8 digits short.
    assert cut_last_line_in_a_number(run_dir / "metrics.csv", "wall_time").startswith("2,val,1.5,60.0,")
    cut_last_line_in_a_number(run_dir / "io.csv", "read_bytes_per_second")
    logs = plots.load([tmp_path])
    (run,) = logs.runs
    assert list(run.epochs.index) == [0, 1] and list(run.epochs["val_top1"]) == [30.0, 55.0]
    assert plots.training_seconds(run) == pytest.approx(240.0)
    assert list(logs.io[0].frame["read_bytes_per_second"]) == [1e6, 1e6]
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {run_dir / 'metrics.csv'}: 1 row(s) not whole (cut short by a crash, or damaged), not read: "
        f"line(s) 7; read the 5 whole row(s)",
        f"warning: {run_dir / 'io.csv'}: 1 row(s) not whole (cut short by a crash, or damaged), not read: "
        f"line(s) 4; read the 2 whole row(s)"]


def test_rows_with_too_many_or_too_few_fields_or_no_number_are_named_and_the_rest_read(tmp_path, capsys):
    rows = epoch_rows(0, START, 40, 30.0) + epoch_rows(1, START + 120, 50, 55.0) + epoch_rows(2, START + 240, 60, 60.0)
    run_dir = write_run(tmp_path, "Nov23_10-00-00_node-a_resnet18_cpux2_b4_cpu1_optO0", 2, rows)
    lines = (run_dir / "metrics.csv").read_text().splitlines(keepends=True)
    not_a_number = lines[3].replace(",90.0,", ",9x.0,")  # epoch 1's train row
    glued = lines[4].rstrip("\r\n")[:20] + lines[5]  # epoch 1's val row cut, epoch 2's train row appended to it
    short = "2,train,1.9\r\n"  # too few fields
    (run_dir / "metrics.csv").write_text("".join(lines[:3] + [not_a_number, glued, short, lines[6]]))
    (run,) = plots.load([tmp_path]).runs
    assert list(run.epochs.index) == [0, 2] and list(run.epochs["val_top1"]) == [30.0, 60.0]
    assert run.epochs.loc[0, "train_top1"] == 25.0 and math.isnan(run.epochs.loc[2, "train_top1"])
    assert capsys.readouterr().err == (f"warning: {run_dir / 'metrics.csv'}: 3 row(s) not whole (cut short by a crash, "
                                       f"or damaged), not read: line(s) 4, 5, 6; read the 3 whole row(s)\n")


# --- issue 40: CPU processes on one machine are no scaling; the upstream's scaling beside the model's ---

def test_a_figure_of_cpu_processes_sharing_one_machines_cores_says_so_and_not_scaling(tmp_path):
    """1, 2 and 4 CPU processes started by one launcher share one machine's cores:
    the figures' titles say so, and the per-process figure is not titled as scaling."""
    made = make_runs(tmp_path / "runs")
    for run_dir in [made["two"], *made["four"]]:
        config = json.loads((run_dir / "config.json").read_text())
        config["environment"]["cpu_count"] = 2
        (run_dir / "config.json").write_text(json.dumps(config))
    figures = plots.make_figures(plots.load([tmp_path / "runs"]))
    shared = "CPU processes sharing one machine's 2 cores, not scaling"
    efficiency = figures["scaling_efficiency"].axes[0]
    assert efficiency.get_title() == "Per-process images/s relative to the smallest count:\n" + shared
    assert efficiency.get_ylabel() == "per-process images/s relative to the smallest count (%)"
    assert "scaling" not in efficiency.get_ylabel().lower()
    assert figures["training_throughput"].axes[0].get_title() == f"Mean training throughput per epoch\n({shared})"
    # Beside GPU runs (the upstream's), the GPU series keep their scaling title; the CPU series are named.
    both = plots.make_figures(plots.load([UPSTREAM, tmp_path / "runs"]))["scaling_efficiency"].axes[0]
    assert both.get_title() == ("Scaling efficiency: per-GPU images/s relative to the smallest count\n"
                                f"(the CPU series: {shared})")
    # GPU runs alone: the title it always had.
    alone = plots.make_figures(plots.load([UPSTREAM]))["scaling_efficiency"].axes[0]
    assert alone.get_title() == "Scaling efficiency: per-GPU images/s relative to the smallest count"
    plots.plt.close("all")


def test_the_upstreams_scaling_from_its_logs_is_drawn_beside_the_scaling_models_prediction(tmp_path, capsys):
    import csv

    model_csv = REPO / "results" / "scaling" / "upstream-v100-hal.csv"
    written = plots.main([str(UPSTREAM), "--out", str(tmp_path), "--scaling-model", str(model_csv)])
    assert tmp_path / "scaling_vs_model.png" in written and tmp_path / "scaling_vs_model.pdf" in written
    predictions = ("results/scaling/upstream-v100-hal.csv", list(csv.DictReader(model_csv.open())))
    figure = plots.make_figures(plots.load([UPSTREAM]), predictions=predictions)["scaling_vs_model"]
    assert_labelled(figure)
    ax = figure.axes[0]
    assert "NVIDIA V100" in ax.get_title() and "fp16 gradients" in ax.get_title()
    lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    # Measured: the upstream's throughput logs, per GPU, over the 2-GPU run's (the acceptance figures above).
    measured = lines["measured: upstream: resnet50 optO2 (its logs)"]
    per_gpu = {gpus: speed / gpus for gpus, speed in UPSTREAM_IMAGES_PER_SECOND.items()}
    assert list(measured.get_xdata()) == [2, 4, 8, 16, 32, 64]
    assert list(measured.get_ydata()) == pytest.approx([100 * per_gpu[gpus] / per_gpu[2] for gpus in per_gpu],
                                                       abs=0.6)
    # Predicted: each scenario of the CSV for the hook it compared with measured figures, as the CSV says.
    fp16 = [row for row in predictions[1] if row["hook"] == "fp16"]
    scenarios = sorted({row["scenario"] for row in fp16})
    drawn = sorted(label for label in lines if label.startswith("predicted: "))
    assert len(drawn) == len(scenarios) == 4
    first = lines[f"predicted: {fp16[0]['scenario']}"]
    assert list(first.get_ydata()) == [float(row["efficiency_percent"]) for row in fp16
                                       if row["scenario"] == fp16[0]["scenario"]]
    (tmp_path / "bad.csv").write_text("gpus,speed\n2,1\n")
    with pytest.raises(plots.UsageError, match=r"^argument --scaling-model: .*bad.csv is no CSV of python -m "
                                               r"common.tools.scaling"):
        plots.main([str(UPSTREAM), "--out", str(tmp_path), "--scaling-model", str(tmp_path / "bad.csv")])
    with pytest.raises(plots.UsageError, match=r"^argument --scaling-model: cannot read .*missing.csv"):
        plots.main([str(UPSTREAM), "--out", str(tmp_path), "--scaling-model", str(tmp_path / "missing.csv")])
    plots.plt.close("all")
