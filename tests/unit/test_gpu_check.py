"""run_scripts/gpu_check.py, the GPU record in one call, on the CPU: the parts' order, the deadline
arithmetic (a step skipped when its least time is not left, stopped with its process group when it
runs past), the summary, the run directories copied without checkpoints, the archive the device tool
brings back, and gpu_demo_matrix.sh's deadline. What needs a GPU (the parts' commands themselves) is
run by a GPU session (docs/tests.md#the-gpu-record-in-one-call)."""
from __future__ import annotations

import csv
import datetime
import importlib.util
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from common.tools import results_summary
from helpers import REPO, running

# As `python3 run_scripts/gpu_check.py` finds its products' module: run_scripts/ first on sys.path, not a package.
if str(REPO / "run_scripts") not in sys.path:
    sys.path.insert(0, str(REPO / "run_scripts"))
import gpu_check  # noqa: E402
import gpu_check_outputs  # noqa: E402

H100 = "NVIDIA H100 80GB HBM3"
MATRIX_RUNS = ["nd", "dp", "ddp", "apex-O0", "apex-O1-fp16", "apex-O2-fp16", "apex-O3-fp16", "apex-O1-bf16",
               "apex-O2-bf16", "apex-O3-bf16"]


def dry_run(tmp_path, *arguments, graphs=False, monkeypatch=None):
    """main() as a dry run into tmp_path with an H100 named: (exit status, printed lines, summary file)."""
    if monkeypatch is not None:
        monkeypatch.setattr(gpu_check, "has_cuda_graphs_flag", lambda: graphs)
    lines = []
    status = gpu_check.main(["--dry-run", "--out", str(tmp_path), *arguments], gpu_name=lambda: H100,
                            show=lines.append)
    summaries = list(tmp_path.glob("summary-*.txt"))
    assert len(summaries) == 1 and sorted(tmp_path.iterdir()) == summaries  # a dry run writes its summary only
    return status, lines, summaries[0]


def table_rows(summary: Path) -> list:
    """(part, status, seconds) of the summary's table."""
    lines = summary.read_text().splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith("part "))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append((line[:8].strip(), line[10:42].strip(), int(line[44:51])))
    return rows


# --- the order of the parts and the deadline arithmetic ---

def test_the_parts_run_in_the_order_named_after_env(tmp_path, monkeypatch):
    status, lines, summary = dry_run(tmp_path, "--seconds", "2000", "bench", "tests", "bench",
                                     monkeypatch=monkeypatch)
    assert status == 0 and summary.name == "summary-bench-tests.txt"
    assert [row[0] for row in table_rows(summary)] == ["env", "bench", "tests"]
    steps = [line.split("] ")[1].split(":")[0] for line in lines if line.startswith("[")]
    assert steps == ["env", "bench", "tests"]


def test_the_default_order_is_most_valuable_first(tmp_path, monkeypatch):
    _, _, summary = dry_run(tmp_path, "--seconds", "5000", graphs=True, monkeypatch=monkeypatch)
    assert summary.name == "summary-tests-profile-graphs-bench-decode-matrix.txt"
    # Each step takes its estimate: env 5, tests 180, profile 2 x 40, graphs 3 pairs x 60, bench 420, decode 90,
    # matrix 420.
    assert table_rows(summary) == [("env", "would run", 5), ("tests", "would run", 180),
                                   ("profile", "would run", 80), ("graphs", "would run", 180),
                                   ("bench", "would run", 420), ("decode", "would run", 90),
                                   ("matrix", "would run", 420)]
    assert summary.read_text().splitlines()[-1] == "skipped: nothing"


def test_a_step_without_its_least_time_left_is_skipped_and_named_at_the_end(tmp_path, monkeypatch):
    # 300 s less 20 kept: env (5) and tests (180) leave 95 s, short of bench's least 150 but not of matrix's 60,
    # whose estimate (420) the deadline would cut.
    status, lines, summary = dry_run(tmp_path, "--seconds", "300", "tests", "bench", "matrix",
                                     monkeypatch=monkeypatch)
    assert status == 0
    assert table_rows(summary) == [("env", "would run", 5), ("tests", "would run", 180), ("bench", "skipped", 0),
                                   ("matrix", "would stop at the deadline", 95)]
    assert summary.read_text().splitlines()[-1] == "skipped: bench (bench needs at least 150 s, 95 s left)"
    assert "[ 185 s] bench: skipped: bench needs at least 150 s, 95 s left" in lines


def test_a_deadline_too_short_for_anything_skips_every_part(tmp_path, monkeypatch):
    _, _, summary = dry_run(tmp_path, "--seconds", "100", "tests", monkeypatch=monkeypatch)
    assert table_rows(summary) == [("env", "would run", 5), ("tests", "skipped", 0)]
    assert summary.read_text().splitlines()[-1] == "skipped: tests (tests needs at least 90 s, 75 s left)"


def test_a_part_cut_short_names_the_steps_it_left(tmp_path, monkeypatch):
    # 180 s less 20 kept, less env's 5: 155 s for three pairs of graphs runs of 60 s: two start, the last has 35 s.
    _, lines, summary = dry_run(tmp_path, "--seconds", "180", "graphs", graphs=True, monkeypatch=monkeypatch)
    assert table_rows(summary)[1] == ("graphs", "partial (2 of 3 steps)", 120)
    assert summary.read_text().splitlines()[-1] == "skipped: graphs: graphs pair 3 needs at least 60 s, 35 s left"
    pairs = [line.split("--cuda-graphs ")[1].split()[0] for line in lines if "--cuda-graphs" in line]
    assert pairs == ["off", "on", "off", "on"]  # whole pairs, eager first


def test_the_dry_run_prints_each_steps_exact_command(tmp_path, monkeypatch):
    _, lines, _ = dry_run(tmp_path, "bench", "matrix", monkeypatch=monkeypatch)
    python = sys.executable
    bench = next(lines[index + 1] for index, line in enumerate(lines) if "] bench:" in line)
    assert bench.split() == [python, "-m", "common.tools.bench", "--device", "cuda", "--sections", "train",
                             "end-to-end", "--configs", "'ddp_apex", "O2", "channels_last'", "--repeats", "3",
                             "--csv", str(tmp_path.resolve() / "bench.csv")]
    matrix = next(lines[index + 1] for index, line in enumerate(lines) if "] matrix:" in line).split()
    assert matrix[0] == f"PYTHON={python}" and matrix[-5:] == [
        "RUN_SECONDS=40", "FIRST_RUN_SECONDS=60", "MATRIX_DEADLINE=<deadline>", "bash", "run_scripts/gpu_demo_matrix.sh"]


def test_the_tests_part_collects_only_the_files_that_mark_gpu_tests(tmp_path, monkeypatch):
    files = gpu_check.gpu_test_files()
    assert {"tests/e2e/test_gpu.py", "tests/e2e/test_dali.py"} <= set(files)
    assert "tests/unit/test_gpu_check.py" not in files and "tests/unit/test_cli.py" not in files
    assert all("\n@pytest.mark.gpu\n" in (REPO / file).read_text() for file in files)
    _, lines, _ = dry_run(tmp_path, "tests", monkeypatch=monkeypatch)
    command = next(lines[index + 1] for index, line in enumerate(lines) if "] tests:" in line)
    assert command.split() == [sys.executable, "-m", "pytest", *files, "-m", "gpu", "-q", "-p", "no:randomly", "-p",
                               "no:cacheprovider", "--continue-on-collection-errors"]


def test_graphs_and_profile_pair_eager_and_graphed_only_where_the_flag_exists(tmp_path, monkeypatch):
    _, lines, summary = dry_run(tmp_path / "without", "profile", "graphs", monkeypatch=monkeypatch)
    commands = [line for line in lines if line.startswith("    ") and "imagenet_ddp_apex.py" in line]
    assert len(commands) == 1 and "--cuda-graphs" not in commands[0] and "--profile-steps 10" in commands[0]
    assert summary.read_text().splitlines()[-1] == \
        "skipped: graphs (imagenet_ddp_apex.py has no --cuda-graphs flag here)"

    _, lines, _ = dry_run(tmp_path / "with", "profile", "graphs", graphs=True, monkeypatch=monkeypatch)
    modes = [line.split("--cuda-graphs ")[1].split()[0] if "--cuda-graphs" in line else "default"
             for line in lines if line.startswith("    ") and "imagenet_ddp_apex.py" in line]
    assert modes == ["off", "on"] + ["off", "on"] * 3  # the profiles, then the graphs part's pairs
    assert [line.split("--run-name ")[1] for line in lines if "--profile-steps" in line] == [
        "eager --cuda-graphs off", "graphs --cuda-graphs on"]


def test_the_decode_part_is_skipped_at_once_where_dali_is_not_installed(tmp_path, monkeypatch):
    """The device tool's GPU image has no DALI: the decode part says so and leaves its time to the matrix."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name.startswith("nvidia") else real_find_spec(name, *rest))
    status, lines, summary = dry_run(tmp_path, "--seconds", "500", "decode", "matrix", monkeypatch=monkeypatch)
    assert status == 0 and table_rows(summary) == [("env", "would run", 5), ("decode", "skipped", 0),
                                                   ("matrix", "would run", 420)]
    assert summary.read_text().splitlines()[-1] == (f"skipped: decode (NVIDIA DALI is not installed for "
                                                    f"{sys.executable} (requirements-dali.txt))")


def test_the_scripts_flag_is_looked_up_in_their_parser():
    from common import flags

    has_it = any("--cuda-graphs" in action.option_strings for action in flags.build_parser("ddp_apex")._actions)
    assert gpu_check.has_cuda_graphs_flag() is has_it


# --- mistakes and no GPU ---

def test_the_script_finds_its_outputs_module_from_any_folder(tmp_path):
    """run_scripts/ is no package: started from another folder, with python's safe path on (-P: no script folder
    first on sys.path), gpu_check.py still imports gpu_check_outputs.py beside it."""
    result = subprocess.run([sys.executable, REPO / "run_scripts" / "gpu_check.py", "--help"], cwd=tmp_path,
                            capture_output=True, text=True, env=dict(os.environ, PYTHONSAFEPATH="1"), timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: gpu_check.py ") and f"{gpu_check_outputs.MAX_TRANSFER_FILES} files at" \
        in " ".join(result.stdout.split())


def test_without_a_gpu_only_the_dry_run_goes_on(tmp_path):
    with pytest.raises(gpu_check.UsageError, match=r"^no CUDA GPU is visible to .*--dry-run shows what would run$"):
        gpu_check.main(["--out", str(tmp_path)], gpu_name=lambda: None, show=lambda line: None)
    assert list(tmp_path.iterdir()) == []
    lines = []
    assert gpu_check.main(["--dry-run"], gpu_name=lambda: None, show=lines.append) == 0
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    assert f"output: {REPO}/results/gpu-unknown-{today}" in lines[0]
    assert lines[-1].splitlines()[-1].startswith("skipped: ")
    assert not (REPO / "results" / f"gpu-unknown-{today}").exists()  # nothing written


def test_without_torch_a_run_and_a_dry_run_are_one_line(tmp_path, monkeypatch):
    """gpu_check.sh's python3 where there is no .venv may have no torch: one line, before anything is written."""
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    for dry_run in ([], ["--dry-run"]):
        with pytest.raises(gpu_check.UsageError) as raised:
            gpu_check.main([*dry_run, "--out", str(tmp_path / "out")], show=lambda line: None)
        assert str(raised.value) == \
            f"torch is not installed for {sys.executable} (gpu_check.sh: set PYTHON to a python that has it)"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("arguments, message", [
    (["benchmark"], "argument PART: unknown part 'benchmark' (choose from tests, profile, graphs, bench, decode, matrix)"),
    (["--seconds", "0"], "argument --seconds: expected whole seconds from 1 to 86400, got '0'"),
    (["--seconds", "10**15"], "argument --seconds: expected whole seconds from 1 to 86400, got '10**15'"),
])
def test_mistakes_are_one_line(arguments, message):
    with pytest.raises(gpu_check.UsageError) as raised:
        gpu_check.main(arguments, gpu_name=lambda: H100)
    assert str(raised.value) == f"{message} (see --help)"


def test_a_kind_names_a_folder_and_nothing_more(tmp_path):
    with pytest.raises(gpu_check.UsageError, match=r"^argument --kind: expected lower-case letters and digits like "
                                                   r"h100, got '\.\./\.\./etc' \(see --help\)$"):
        gpu_check.main(["--dry-run", "--kind", "../../etc"], gpu_name=lambda: H100)
    lines = []
    gpu_check.main(["--dry-run", "--kind", "h100nvl"], gpu_name=lambda: H100, show=lines.append)
    assert f"output: {REPO}/results/gpu-h100nvl-" in lines[0]


def test_an_out_that_cannot_be_a_folder_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "has_cuda_graphs_flag", lambda: False)
    (tmp_path / "file").write_text("")
    for out, message in ((tmp_path / "file", f"argument --out: {tmp_path / 'file'} is a file, not a folder"),
                         (tmp_path / "file" / "below", f"argument --out: cannot create {tmp_path / 'file' / 'below'} "
                                                       f"(Not a directory)")):
        with pytest.raises(gpu_check.UsageError) as raised:
            gpu_check.main(["--out", str(out), "tests"], gpu_name=lambda: H100, show=lambda line: None)
        assert str(raised.value) == message


@pytest.mark.parametrize("name, kind", [(H100, "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"),
                                        ("Tesla V100-SXM2-16GB", "v100"), ("NVIDIA GeForce RTX 4090", "rtx")])
def test_the_folder_is_named_by_the_gpus_kind(name, kind):
    assert gpu_check.gpu_kind(name) == kind


# --- running steps: statuses, the deadline, the process group ---

def fake_step(label, code, least=0.0, log="fake.log"):
    return gpu_check.Step(label, ((sys.executable, "-c", code),), log, 1, least)


def test_a_steps_status_is_its_exit_status(tmp_path):
    clock = gpu_check.Clock(600, dry_run=False)
    part = gpu_check.Part("fake", (fake_step("one", "print('hello')"), fake_step("two", "raise SystemExit(3)"),
                                   fake_step("three", "raise SystemExit(75)")))
    outcome = gpu_check.run_part(part, clock, tmp_path, show=lambda line: None)
    assert outcome.status == "failed (exit 3)"
    assert gpu_check.run_step(part.steps[2], clock, tmp_path) == "stopped at the deadline"  # the matrix's 75
    missing = gpu_check.Step("missing", (("no-such-command-here",),), "fake.log", 1, 0)
    assert gpu_check.run_step(missing, clock, tmp_path) == "failed (exit 127)"
    log = (tmp_path / "fake.log").read_text()
    assert log.count("$ ") == 5 and "hello\n" in log
    assert log.endswith("$ no-such-command-here\n(could not start: No such file or directory)\n")


def test_a_step_past_the_deadline_is_stopped_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    # 2 s of the deadline are left for the parts; the child would sleep 2 minutes.
    clock = gpu_check.Clock(gpu_check.RESERVE_SECONDS + 2, dry_run=False)
    step = gpu_check.Step("sleeps", (("bash", "-c", f"sleep 120 & echo $! > {pid_file}; wait"),), "sleeps.log", 1, 0)
    outcome = gpu_check.run_part(gpu_check.Part("sleeps", (step,)), clock, tmp_path, show=lambda line: None)
    assert outcome.status == "stopped at the deadline" and outcome.seconds < 100
    assert not running(int(pid_file.read_text()))
    assert "(stopped at the deadline, after 2 s)" in (tmp_path / "sleeps.log").read_text()


def test_a_real_run_writes_env_and_the_summary_and_fails_with_a_failed_part(tmp_path, monkeypatch):
    """main() as on a GPU, its parts' commands replaced by stand-ins."""
    monkeypatch.setattr(gpu_check, "env_step", lambda settings: fake_step("env", "print('NVIDIA-SMI')", log="env.txt"))
    monkeypatch.setattr(gpu_check, "tests_part", lambda settings: gpu_check.Part(
        "tests", (fake_step("tests", "print('1 failed, 2 passed'); raise SystemExit(1)", log="tests.log"),)))
    monkeypatch.setattr(gpu_check, "has_cuda_graphs_flag", lambda: False)
    status = gpu_check.main(["--out", str(tmp_path), "tests", "graphs"], gpu_name=lambda: H100, show=lambda line: None)
    assert status == 1
    env = (tmp_path / "env.txt").read_text().splitlines()
    datetime.datetime.strptime(env[0], "%a %b %d %I:%M:%S %p %Z %Y")  # the date first, as results_summary reads it
    assert env[1:] == ["$ " + shlex.join([sys.executable, "-c", "print('NVIDIA-SMI')"]), "NVIDIA-SMI"]
    rows = table_rows(tmp_path / "summary-tests-graphs.txt")
    assert [row[:2] for row in rows] == [("env", "ran"), ("tests", "failed (exit 1)"), ("graphs", "skipped")]


def test_the_deadline_counts_the_time_torch_takes_to_find_the_gpu(tmp_path, monkeypatch):
    """The device tool's timeout_s counts from the command's start: so does --seconds, the seconds that
    importing torch and starting CUDA take on a cold machine (to name the GPU) included."""
    now, real_clock, ran = [1000.0], gpu_check.Clock, []
    monkeypatch.setattr(gpu_check, "Clock", lambda seconds, dry_run: real_clock(seconds, dry_run, now=lambda: now[0]))
    monkeypatch.setattr(gpu_check, "run_command", lambda command, env, log, timeout: ran.append(command[0]) or 0)

    def slow_gpu_name():
        now[0] += 100.0
        return H100

    lines = []
    assert gpu_check.main(["--out", str(tmp_path), "--seconds", "200", "tests"], gpu_name=slow_gpu_name,
                          show=lines.append) == 0
    assert "tests needs at least 90 s, 80 s left" in (tmp_path / "summary-tests.txt").read_text()
    assert sys.executable in ran and "-m" not in ran and ran.count("nvidia-smi") == 3  # env's commands alone


def test_env_txt_dates_the_profiles_in_results(tmp_path):
    """results_summary reads the GPU and the date of a profile from the env.txt beside it."""
    moment = datetime.datetime(2026, 11, 28, 13, 5, 9, tzinfo=datetime.timezone.utc)
    assert gpu_check_outputs.session_date(moment) == "Sat Nov 28 01:05:09 PM UTC 2026"
    (tmp_path / "env.txt").write_text(gpu_check_outputs.session_date(moment) + "\n$ nvidia-smi\n"
                                      "|   0  NVIDIA H100 80GB HBM3          On  |   00000000:00:06.0 Off |\n")
    (tmp_path / "profile-resnet50-b256-default-summary.txt").write_text(
        "10 step(s) profiled: 41.5 ms per step; the GPU ran no kernel or copy 8.2% of that time\n")
    table = results_summary.profiles([str(tmp_path / "profile-resnet50-b256-default-summary.txt")])
    assert f"| {H100} | 2026-11-28 |" in table and "| 41.5 | 8.2% |" in table


# --- the products ---

def make_run_dir(root: Path) -> Path:
    run = root / "apex-O2-bf16"
    (run / "steps").mkdir(parents=True)
    (run / "profile-x").mkdir()
    for name in ("config.json", "metrics.csv", "val_report.csv", "io.csv", "events.out.tfevents.1.vm.2.0",
                 "steps/steps.csv", "profile-x/summary.txt"):
        (run / name).write_text(name)
    for name in ("checkpoint-epoch007-images00011264.pth.tar", "run.lock", "profile-x/trace.json"):
        (run / name).write_text("large or locked")
    os.link(run / "checkpoint-epoch007-images00011264.pth.tar", run / "checkpoint.pth.tar")
    os.link(run / "checkpoint-epoch007-images00011264.pth.tar", run / "model_best.pth.tar")
    with open(run / "confusion_matrix.npy", "wb") as handle:
        handle.truncate(gpu_check_outputs.MAX_COPIED_FILE_BYTES + 1)
    return run


def test_run_directories_are_copied_without_checkpoints(tmp_path):
    make_run_dir(tmp_path / "scratch")
    runs, left = gpu_check_outputs.copy_run_logs(tmp_path / "scratch", tmp_path / "copy")
    copied = sorted(path.relative_to(tmp_path / "copy").as_posix() for path in (tmp_path / "copy").rglob("*")
                    if path.is_file())
    assert runs == ["apex-O2-bf16"]
    assert copied == [f"apex-O2-bf16/{name}" for name in ("config.json", "events.out.tfevents.1.vm.2.0", "io.csv",
                                                          "metrics.csv", "profile-x/summary.txt", "steps/steps.csv",
                                                          "val_report.csv")]
    assert sorted(left) == [f"apex-O2-bf16/{name}" for name in (
        "checkpoint-epoch007-images00011264.pth.tar", "checkpoint.pth.tar", "confusion_matrix.npy",
        "model_best.pth.tar", "profile-x/trace.json", "run.lock")]
    assert (tmp_path / "copy" / "apex-O2-bf16" / "metrics.csv").read_text() == "metrics.csv"
    assert gpu_check_outputs.copy_note((runs, left)) == "1 run directory copied, 6 file(s) left behind"
    assert gpu_check_outputs.copy_run_logs(tmp_path / "none", tmp_path / "copy2") == ([], [])


def test_the_archive_holds_everything_at_the_repositorys_paths(tmp_path):
    out, runs_copy = tmp_path / "out", tmp_path / "results" / "runs" / "gpu-2026-11-28"
    make_run_dir(tmp_path / "scratch")
    gpu_check_outputs.copy_run_logs(tmp_path / "scratch", runs_copy)
    out.mkdir()
    names = ["env.txt", "tests.log", "profile.log", "graphs.log", "graphs.csv", "bench.log", "bench.csv",
             "profile-resnet50-b256-default-summary.txt", "profile-resnet50-b256-eager-summary.txt"]
    for name in names:
        (out / name).write_text(name)
    summary = out / "summary-tests-bench.txt"
    summary.write_text("summary")
    archive = gpu_check_outputs.pack(out, summary, runs_copy, "gpu-h100-2026-11-28")
    assert archive.name == "gpu-check-tests-bench.tar.gz"
    assert sorted(out.iterdir()) == [archive, summary]  # within the device tool's 8 files
    with tarfile.open(archive) as tar:
        members = {member.name for member in tar.getmembers() if member.isfile()}
    assert members == {f"results/gpu-h100-2026-11-28/{name}" for name in [*names, summary.name]} | {
        f"results/runs/gpu-2026-11-28/apex-O2-bf16/{name}" for name in (
            "config.json", "events.out.tfevents.1.vm.2.0", "io.csv", "metrics.csv", "profile-x/summary.txt",
            "steps/steps.csv", "val_report.csv")}


def test_graphs_rows_and_their_medians(tmp_path):
    table = tmp_path / "graphs.csv"
    for mode, repeat, rate in (("off", 1, 4100.0), ("on", 1, 5900.0), ("off", 2, 4300.0), ("on", 2, 6100.0),
                               ("off", 3, 4200.0), ("on", 3, 5000.0)):
        run_dir = tmp_path / f"{mode}-{repeat}"
        run_dir.mkdir()
        (run_dir / "metrics.csv").write_text(
            "epoch,split,images_per_second,peak_memory_mib\n"
            f"0,train,{rate},20480\n0,val,9000.0,4096\n")
        assert gpu_check_outputs.add_throughput_row(table, run_dir, mode, repeat) == \
            f"--cuda-graphs {mode}: {rate:,.0f} images/s"
    with open(table, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["cuda_graphs"], row["images_per_second"], row["peak_memory_mib"]) for row in rows[:2]] == [
        ("off", "4100.0", "20480"), ("on", "5900.0", "20480")]
    assert gpu_check_outputs.graphs_note(table) == ("--cuda-graphs off: median 4,200 images/s of 3; "
                                            "--cuda-graphs on: median 5,900 images/s of 3; on/off 1.405")
    assert gpu_check_outputs.add_throughput_row(table, tmp_path / "missing", "on", 4).startswith("no training row in ")


def test_a_profile_summary_is_copied_under_its_variants_name(tmp_path):
    (tmp_path / "run" / "profile-20261128").mkdir(parents=True)
    (tmp_path / "run" / "profile-20261128" / "summary.txt").write_text("10 step(s) profiled: 41.5 ms per step\nrest\n")
    target = tmp_path / "profile-resnet50-b256-eager-summary.txt"
    assert gpu_check_outputs.copy_profile(tmp_path / "run", target) == \
        "profile-resnet50-b256-eager-summary.txt: 10 step(s) profiled: 41.5 ms per step"
    assert target.read_text().startswith("10 step(s) profiled")
    assert gpu_check_outputs.copy_profile(tmp_path / "none", target).startswith("no profile summary in ")


# --- gpu_demo_matrix.sh's deadline ---

def fake_python(tmp_path) -> Path:
    """A PYTHON for which every command succeeds (a GPU is 'visible'), so the shell script's logic runs alone."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    return python


def test_the_matrix_starts_no_run_past_its_deadline(tmp_path):
    result = subprocess.run(["bash", REPO / "run_scripts" / "gpu_demo_matrix.sh"], capture_output=True, text=True,
                            env=dict(os.environ, PYTHON=str(fake_python(tmp_path)), LOGDIR=str(tmp_path / "runs"),
                                     MATRIX_DEADLINE="1000", RUN_SECONDS="40"), timeout=60)
    assert result.returncode == 75, (result.stdout, result.stderr)
    assert result.stdout.splitlines()[-1] == f"not run before the deadline: {' '.join(MATRIX_RUNS)}"
    assert "==" not in result.stdout


def run_matrix(tmp_path, seconds_left: int, **variables) -> subprocess.CompletedProcess:
    """gpu_demo_matrix.sh with the stand-in PYTHON and MATRIX_DEADLINE `seconds_left` from now."""
    deadline = int(datetime.datetime.now(datetime.timezone.utc).timestamp()) + seconds_left
    return subprocess.run(["bash", REPO / "run_scripts" / "gpu_demo_matrix.sh"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=str(fake_python(tmp_path)), LOGDIR=str(tmp_path / "runs"),
                                   MATRIX_DEADLINE=str(deadline), **variables), timeout=60)


def test_the_matrixs_first_run_starts_only_with_its_own_allowance_left(tmp_path):
    """The first run also writes the digits and starts CUDA cold: FIRST_RUN_SECONDS (default 60) must fit before
    the deadline, not only RUN_SECONDS, or no run starts; once it fits, every run does (the stand-ins end at once).
    The margins are minutes, so a slow machine's seconds change nothing."""
    for seconds_left, variables in ((300, {"RUN_SECONDS": "40", "FIRST_RUN_SECONDS": "900"}),
                                    (50, {"RUN_SECONDS": "40"})):  # the default's 60 s do not fit in 50
        result = run_matrix(tmp_path, seconds_left, **variables)
        assert result.returncode == 75, (result.stdout, result.stderr)
        assert result.stdout.splitlines() == [f"not run before the deadline: {' '.join(MATRIX_RUNS)}"]
    result = run_matrix(tmp_path, 300, RUN_SECONDS="40", FIRST_RUN_SECONDS="200")
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert [line.split(":")[0] for line in result.stdout.splitlines()] == [f"== {name}" for name in MATRIX_RUNS]


def test_the_matrix_part_hands_its_deadline_to_the_matrix_and_packs_its_runs(tmp_path, monkeypatch):
    """The matrix part as on a GPU: gpu_demo_matrix.sh gets PYTHON, LOGDIR, both allowances and the deadline;
    with a run's seconds past what is left, it starts the first run alone, on its own allowance, and lists the
    others as not run (75: stopped, not failed); the archive holds its log."""
    monkeypatch.setattr(sys, "executable", str(fake_python(tmp_path)))  # the interpreter of every step
    monkeypatch.setattr(gpu_check, "MATRIX_RUN_SECONDS", 10 ** 6)
    monkeypatch.setattr(gpu_check, "env_step", lambda settings: fake_step("env", "", log="env.txt"))
    monkeypatch.setattr(gpu_check, "has_cuda_graphs_flag", lambda: False)
    out = tmp_path / "out"
    assert gpu_check.main(["--out", str(out), "--pack", "matrix"], gpu_name=lambda: H100,
                          show=lambda line: None) == 0
    summary = out / "summary-matrix.txt"
    assert sorted(path.name for path in out.iterdir()) == ["gpu-check-matrix.tar.gz", summary.name]
    lines = summary.read_text().splitlines()
    assert lines[4].startswith("matrix    stopped at the deadline ") and lines[4].endswith(
        f"not run before the deadline: {' '.join(MATRIX_RUNS[1:])}; 0 run directories copied, 0 file(s) left behind")
    with tarfile.open(out / "gpu-check-matrix.tar.gz") as tar:
        today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
        log = tar.extractfile(f"results/gpu-h100-{today}/matrix.log").read().decode()
    assert log.startswith("$ bash run_scripts/gpu_demo_matrix.sh\n== nd: imagenet_nd.py \n")
    assert log.count("== ") == 1


@pytest.mark.parametrize("variable", ["MATRIX_DEADLINE", "RUN_SECONDS", "FIRST_RUN_SECONDS"])
def test_the_matrix_takes_only_whole_seconds(tmp_path, variable):
    marker = tmp_path / "ran"
    result = subprocess.run(["bash", REPO / "run_scripts" / "gpu_demo_matrix.sh"], capture_output=True, text=True,
                            env=dict(os.environ, PYTHON=str(fake_python(tmp_path)),
                                     **{variable: f"a[$(touch {marker})]"}), timeout=60)
    assert result.returncode == 2 and not marker.exists()
    assert result.stderr.splitlines() == [
        f"gpu_demo_matrix.sh: error: {variable} must be whole seconds, got 'a[$(touch {marker})]'"]
