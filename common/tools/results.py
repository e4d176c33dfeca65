"""RESULTS.md from run directories: every number read from the runs' logs.

    python -m common.tools.results RUN_DIRS... [--upstream results/upstream] [--figures figures] > RESULTS.md

RUN_DIRS are this project's run directories (or folders holding them). The
output is Markdown on stdout and depends only on the inputs (no date of
generation), so regenerating it from the same runs changes nothing. The
derived numbers (training time, throughput, scaling efficiency, time to
--desired-acc) come from common.tools.plots, the one place that defines them.
"""
from __future__ import annotations

import argparse
import collections
import math
import re
import shlex
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from common import provenance, recipes
from common.arguments import Parser
from common.errors import UsageError, error_summary, run_main, without_credentials
from common.tools import plots, results_summary
from common.tools.bench import flops, report, targets
from common.tools.bench.report import as_number
from common.tools.results_summary import folded, number, portable_path, table

FIGURE_NAMES = [*plots.ACCURACY_FIGURES, "training_throughput", "scaling_efficiency", "training_time", "IO",
                "data_wait"]


# A run's interpreter, however it was called (/opt/venv/bin/python3.11): shown as `python`.
_PYTHON = re.compile(r"python[0-9.]*")
# What a shell reads as one word without quotes (shlex.quote's set), and the ellipsis of an elided path.
_PLAIN_WORD = re.compile(r"[\w@%+=:,./…-]+")


def portable_command(command: str) -> str:
    """A recorded command as a user would type it: the program by its name
    (the interpreter as `python`), scripts by their name, absolute paths elided (portable_path),
    --flag=/abs/path included."""
    try:
        words = shlex.split(command)
    except ValueError:  # not shell syntax (an older log): shown as recorded
        return command
    if words:  # the program: found on PATH by its name when typed
        words[0] = "python" if _PYTHON.fullmatch(Path(words[0]).name) else Path(words[0]).name
    shown = []
    for word in words:
        flag, equals, value = word.partition("=")
        if word.endswith(".py") and word.startswith("/"):
            word = Path(word).name  # the entry script, run from elsewhere
        elif equals and flag.startswith("--"):
            word = f"{flag}={portable_path(value)}"
        else:
            word = portable_path(word)
        shown.append(word if _PLAIN_WORD.fullmatch(word) else shlex.quote(word))
    return " ".join(shown)


def duration(seconds: float) -> str:
    """'5 h 48 min 25 s (20,904.5 s)'."""
    if seconds is None or math.isnan(seconds):
        return "—"
    whole = int(round(seconds))
    hours, minutes, rest = whole // 3600, whole // 60 % 60, whole % 60
    text = (f"{hours} h " if hours else "") + (f"{minutes} min " if hours or minutes else "") + f"{rest} s"
    return f"{text} ({seconds:,.1f} s)"


def per_gpu_word(run: plots.Run) -> str:
    return "per CPU process" if run.device_kind == "cpu" else "per GPU"


def best(run: plots.Run, column: str) -> str:
    values = run.epochs[column].dropna()
    return f"{values.max():.2f}% (epoch {values.idxmax()})" if len(values) else "—"


def run_section(run: plots.Run) -> str:
    """Everything about one run: command, options, hardware, times, accuracy, epochs."""
    config = run.config or {}
    options, resolved = config.get("options") or {}, config.get("resolved") or {}
    # A dash where the log does not record a value (older run directories, TensorBoard logs).
    env = collections.defaultdict(lambda: "—", {key: setting for key, setting in
                                                (config.get("environment") or {}).items() if setting is not None})
    epochs = run.epochs
    last_epoch, last_top1, last_top5 = plots.last_validation(run)
    images_per_second = plots.mean_images_per_second(run)
    # An older run's config.json may hold what the command line refuses now: a password in a URL.
    command = (f"`{without_credentials(portable_command(config['command']))}`" if config.get("command")
               else "not recorded (no config.json)")
    lines = [f"### `{run.name}`", "",
             f"- **Command:** {command}",
             f"- **Started:** {config.get('started', '—')} at epoch {config.get('start_epoch', '—')}"]
    for resume in run.resumes:
        lines.append(f"- **Resumed:** {resume.get('started')} at epoch {resume.get('start_epoch')}: "
                     f"`{portable_command(resume.get('command') or '')}`" + other_code(resume, config))
    lines += [
        f"- **Hardware:** {plots.count_label(run.replicas, run.device_kind)}; device {env['device']}; CPU "
        f"{env['cpu_model']} ({env['cpu_count']} cores); host {env['host']}; {env['world_size']} process(es), "
        f"launcher {env['launcher']}",
        f"- **Versions:** Python {env['python']}, torch {env['torch']}, torchvision {env['torchvision']}, "
        f"CUDA {env['cuda']}, cuDNN {env['cudnn']}; {env['platform']}",
        *code_line(config),
        "- **Resolved:** " + (", ".join(f"{key.replace('_', ' ')} {setting}" for key, setting in resolved.items())
                              or "—"),
        f"- **Training time:** {duration(plots.training_seconds(run))} over {len(epochs)} epoch(s), " + (
            "each epoch from its training start to its validation end" if epochs["train_start"].notna().any()
            else "(last - first end-of-epoch wall time) + one mean epoch"),
        "- **Last val top-1 / top-5:** " + (f"{last_top1:.2f}% / {last_top5:.2f}% (epoch {last_epoch})"
                                              if last_epoch is not None else "—"),
        f"- **Best val top-1:** {best(run, 'val_top1')}; **best val top-5:** {best(run, 'val_top5')}",
        f"- **Mean training throughput:** {number(images_per_second, 1)} images/s global, "
        f"{number(images_per_second / run.replicas, 1)} {per_gpu_word(run)} (mean over epochs)",
    ]
    target = options.get("desired_acc")
    if target is not None:
        reached = plots.time_to_accuracy(run, target)
        lines.append(f"- **Time to --desired-acc {target:g}%:** " + (
            f"reached at epoch {reached[0]} after {duration(reached[1])}" if reached
            else f"not reached (best val top-1 {best(run, 'val_top1')})"))
    if options:
        lines += ["", "<details><summary>All options</summary>", "",
                  table(["option", "value"],
                        [[key, f"`{portable_path(setting)}`"] for key, setting in options.items()]),
                  "", "</details>"]
    rows = [[epoch, number(row["train_loss"], 4), number(row["train_top1"]), number(row["val_loss"], 4),
             number(row["val_top1"]), number(row["val_top5"]), number(row["images_per_second"], 1),
             number(100 * row["data_wait_fraction"], 1)] for epoch, row in epochs.iterrows()]
    lines += ["", table(["epoch", "train loss", "train top-1 (%)", "val loss", "val top-1 (%)", "val top-5 (%)",
                         "train images/s", "data wait (%)"], rows)]
    return "\n".join(lines)


def code_line(record: dict) -> List[str]:
    """The Code bullet of a run whose config.json says which code ran (none
    for runs from before it did)."""
    environment = record.get("environment") or {}
    return [f"- **Code:** {provenance.describe(environment)}"] if "git_commit" in environment else []


def other_code(resume: dict, config: dict) -> str:
    """', other code: commit ...' where a resume ran other code than the run's start."""
    now, before = resume.get("environment") or {}, config.get("environment") or {}
    if "git_commit" not in now or all(now.get(field) == before.get(field) for field in provenance.PROVENANCE_FIELDS):
        return ""
    return f", other code: {provenance.describe(now)}"


def across_runs(runs: Sequence[plots.Run]) -> str:
    rows = []
    for run in runs:
        _, top1, top5 = plots.last_validation(run)
        images_per_second = plots.mean_images_per_second(run)
        rows.append([f"`{run.name}`", plots.count_label(run.replicas, run.device_kind), run.series, len(run.epochs),
                     number(plots.training_seconds(run), 1), number(images_per_second, 1),
                     number(images_per_second / run.replicas, 1), number(top1), number(top5)])
    return table(["run", "scale", "hardware: model, opt level", "epochs", "training time (s)", "train images/s",
                  "per GPU (or process)", "last val top-1 (%)", "last val top-5 (%)"], rows)


def summary_table(summary) -> str:
    rows = [[row["series"], row["gpus"], row["runs"], row["epochs"], number(row["training_seconds"], 0),
             number(row["images_per_second"], 0), number(row["images_per_second_per_gpu"], 0),
             number(row["scaling_efficiency_percent"], 1), number(row["last_val_top1"]), number(row["last_val_top5"])]
            for _, row in summary.iterrows()]
    return table(["source / hardware", "GPUs (or processes)", "runs", "epochs", "training time (s)",
                  "mean train images/s", "per GPU", "scaling efficiency (%)", "last val top-1 (%)",
                  "last val top-5 (%)"], rows)


def load_runs(path: str) -> List[plots.Run]:
    runs = plots.load([path]).runs
    if not runs:
        raise UsageError(f"{path}: no runs found (run directories hold config.json and metrics.csv)")
    return runs


def bench_section(paths: Sequence[str]) -> str:
    """One table per benchmark CSV (python -m common.tools.bench), with the
    machine and versions it ran on and the ratios of its targets. The columns
    that the harness has written since issue 19 (repeats and spread, MFU, the
    GPU's clock, power and temperature) are shown for the CSVs that have them."""
    tables = read_bench(paths)
    parts = ["## Benchmarks", "",
             "Measured by `python -m common.tools.bench` (`make bench`): every configuration in a fresh process, warm-up "
             "steps left out, all of one table in one run of the harness on one machine, so ratios within a table "
             "are side by side. The reference rows are the plain PyTorch loop and input pipeline "
             "(common/tools/bench/measurements.py). No GPU figure appears unless a GPU table is below: none is "
             "estimated."
             + (" Where a table has a spread column, each configuration was measured that many times (repeats, "
                "each in a fresh process, round-robin over the configurations): images/s and ms/step are the "
                "medians, the spread is (max - min) / median of its images/s."
                if any(_present(rows, "repeats") for _, rows in tables) else "")]
    for path, rows in tables:
        first = rows[0]
        speed = [row for row in rows if row["section"] not in ("data-scale", "comm", "scaling", "storage")]
        scale = [row for row in rows if row["section"] == "data-scale"]
        comm = [row for row in rows if row["section"] == "comm"]
        split = [row for row in rows if row["section"] == "scaling"]
        storage = [row for row in rows if row["section"] == "storage"]
        body = [f"torch {first['torch']}, torchvision {first['torchvision']}"
                f"{', CUDA ' + str(first['cuda']) if first['cuda'] else ''}, {first['cpu_threads']} CPU threads, "
                f"host `{first['host']}`; {_half_support(first)}"
                + (f"; {provenance.describe(first)}" if first.get("git_commit") else "") + ".", ""]
        if speed:
            columns = _bench_columns(speed)
            body += [table([header for header, _ in columns], [[cell(row) for _, cell in columns] for row in speed]),
                     ""]
        body += _section_tables(scale, comm, split, storage)
        body += [f"- {line}" for line in _bench_notes(speed) + targets.ratios(speed)
                 + targets.data_scale_lines(scale) + targets.comm_lines(comm) + targets.storage_lines(storage)]
        parts += ["", folded(f"{first['device_name']}, {first['date']} "
                             f"(<code>{portable_path(Path(path).as_posix())}</code>)", "\n".join(body))]
    return "\n".join(parts)


def read_bench(paths: Sequence[str]) -> List[tuple]:
    """(path, rows) of each benchmark CSV that has rows; an unreadable one is one line naming --bench."""
    tables = []
    for path in paths:
        try:
            rows = report.read_csv(path)
        except (OSError, ValueError) as error:
            raise UsageError(f"argument --bench: cannot read {path} ({error_summary(error)})") from None
        if rows:
            tables.append((path, rows))
    return tables


def _section_tables(scale: List[dict], comm: List[dict], split: List[dict], storage: List[dict]) -> List[str]:
    """The tables of the sections with columns of their own: data-scale, comm, scaling and storage."""
    parts: List[str] = []
    if scale:  # the data-scale section (common/tools/bench/data_scale.py): its own columns
        parts += [table(["data-scale", "seconds", "list (MiB)", "a forked reader's copy (MiB)"],
                        [[row["config"] + _note(row), number(as_number(row.get("seconds")), 2),
                          number(as_number(row.get("list_mib")), 1),
                          number(as_number(row.get("worker_copied_mib")), 2)] for row in scale]), ""]
    if comm:  # the comm section (common/tools/bench/comm_bench.py): nccl-tests' algbw and busbw
        parts += [table(["all-reduce", "processes", "backend", "time (µs)", "algbw (GB/s)", "busbw (GB/s)"],
                        [[row["config"] + _note(row), row["world_size"], row["backend"],
                          number(as_number(row.get("time_us")), 1),
                          number(as_number(row.get("algbw_gbytes_per_s")), 3),
                          number(as_number(row.get("busbw_gbytes_per_s")), 3)] for row in comm]), ""]
    if split:  # the scaling section: a DDP step split into compute, exposed communication and data wait
        parts += [table(["DDP step", "model", "batch per process", "ms/step", "compute (ms)",
                         "exposed communication (ms)", "data wait (ms)"],
                        [[row["config"] + _note(row), f"{row['arch']} at {row['image_size']} px", row["batch_size"],
                          number(as_number(row.get("ms_per_step")), 1), number(as_number(row.get("compute_ms")), 1),
                          number(as_number(row.get("exposed_comm_ms")), 1),
                          number(as_number(row.get("data_wait_ms")), 1)] for row in split]), ""]
    if storage:  # the storage section (common/tools/bench/storage_section.py): where an epoch's bytes come from
        parts += [storage_table(storage), ""]
    return parts


def storage_table(rows: List[dict]) -> str:
    """The storage section's rows: per storage profile and configuration, the read stage's images/s, MB/s and
    files opened per second, the megabytes from the source and from the cache (the decoded rows: images/s only)."""
    def figure(row: dict, column: str, digits: int) -> str:
        return number(as_number(row.get(column)), digits) if as_number(row.get(column)) is not None else "—"

    return table(["storage", "configuration", "workers", "images/s", "spread (repeats)", "MB/s", "files opened/s",
                  "from the source (MB)", "from the cache (MB)"],
                 [[row.get("storage") or "—", row["config"], row["workers"],
                   figure(row, "images_per_second", 1) + _note(row),
                   _spread(row),
                   figure(row, "mb_per_second", 1), figure(row, "opens_per_second", 0), figure(row, "source_mb", 1),
                   figure(row, "cache_mb", 1)] for row in rows])


def _bench_columns(rows: List[dict]) -> list:
    """(header, cell of a row) of a benchmark table: those of every CSV, and
    the newer ones where the CSV has them."""
    columns = [("section", lambda row: row["section"]), ("configuration", lambda row: row["config"]),
               ("precision", lambda row: row["precision"] or "—"),
               ("memory format", lambda row: row["memory_format"] or "—"), ("data", lambda row: row["data_backend"]),
               ("workers", lambda row: row["workers"]),
               ("images/s", lambda row: number(as_number(row["images_per_second"]), 1) + _note(row))]
    if _present(rows, "repeats"):
        columns.append(("spread (repeats)", _spread))
    columns += [("images/s per worker", lambda row: number(as_number(row["images_per_second_per_worker"]), 1)),
                ("ms/step", lambda row: number(as_number(row["ms_per_step"]), 1))]
    if _present(rows, "mfu_percent"):
        columns.append(("MFU", lambda row: f"{number(as_number(row['mfu_percent']), 1)}%"
                        if as_number(row.get("mfu_percent")) is not None else "—"))
    columns.append(("peak memory (MiB)", lambda row: number(as_number(row["peak_memory_mib"]), 0)))
    if _present(rows, "sm_clock_mhz"):
        columns += [("SM clock (MHz)", lambda row: number(as_number(row.get("sm_clock_mhz")), 0)),
                    ("power (W)", lambda row: number(as_number(row.get("power_w")), 0)),
                    ("max temp. (°C)", lambda row: number(as_number(row.get("temperature_c")), 0)),
                    ("throttle reasons", lambda row: row.get("throttle_reasons") or "—")]
    return columns


def _spread(row: dict) -> str:
    """A row's spread of its repeats' images/s, and how many repeats: '3.2% (3)'; '—' without one."""
    spread = as_number(row.get("spread_percent"))
    return (f"{number(spread, 1)}%" if spread is not None else "—") + (
        f" ({row['repeats']})" if row.get("repeats") != "" else "")


def _bench_notes(rows: List[dict]) -> List[str]:
    """What the MFU and GPU-state columns of a table are, with the FLOPs and peaks its rows used."""
    notes = []
    measured = [row for row in rows if as_number(row.get("mfu_percent")) is not None]
    if measured:
        counted = sorted({(row["arch"], row["image_size"], as_number(row["gflop_per_image"])) for row in measured})
        peaks = sorted({(row["precision"], as_number(row["peak_tflops"])) for row in measured})
        from_datasheets = all(flops.gpu_peak_tflops(str(row["device_name"]), row["precision"]) ==
                              as_number(row["peak_tflops"]) for row in measured)
        notes.append("MFU: the model's FLOP/s at the row's median images/s over the device's peak for the row's "
                     "precision; " + ", ".join(f"{gflop:.3g} GFLOP per training image of {arch} at {size} px"
                                               for arch, size, gflop in counted)
                     + " (forward and backward, as torch.utils.flop_counter counts them); peak "
                     + ", ".join(f"{peak:g} TFLOP/s for {precision}" for precision, peak in peaks)
                     + (" (NVIDIA's datasheets, dense, TF32 for fp32 rows from Ampere on: "
                        "common/tools/bench/flops.py GPU_PEAK_TFLOPS)" if from_datasheets
                        else " (given to the harness with --peak-tflops)"))
    if _present(rows, "sm_clock_mhz"):
        notes.append("GPU state: nvidia-smi read every 0.5 s while the row's processes ran, the samples with a "
                     "kernel running (utilization above 0) counted: median SM clock and power, highest "
                     "temperature, and every clock event (throttle) reason seen but gpu_idle")
    return notes


def _present(rows: List[dict], column: str) -> bool:
    """Whether any row of a CSV has a value in `column` (older CSVs lack it)."""
    return any(row.get(column, "") != "" for row in rows)


def recipes_section(folder: str, runs: Sequence[plots.Run]) -> str:
    """The named recipes (common/recipes/*.toml): the ImageNet figures their
    sources published, in one table, and this project's runs that used one,
    in another: the sources' numbers and measured ones are never mixed."""
    found = recipes.names(Path(folder))
    if not found:
        raise UsageError(f"argument --recipes: no recipe file (NAME.toml) in {folder}")
    published = []
    for name in found:
        recipe = recipes.read(name, Path(folder))
        figures = recipe.published
        published.append([f"`{name}`", recipe.flags.get("arch", "—"), f"{figures['top1']}%", figures["epochs"],
                          figures["hardware"], figures["wall_time"],
                          f"[recipe]({recipe.source}), [figure]({figures['stated_in']})"])
    measured = []
    for run in runs:
        name = ((run.config or {}).get("options") or {}).get("recipe")
        if name:
            last_epoch, top1, _ = plots.last_validation(run)
            environment = (run.config or {}).get("environment") or {}
            versions = ", ".join(f"{key} {environment[key]}" for key in ("cpu_model", "cpu_capability", "torch")
                                 if environment.get(key))  # the machine and versions each figure was measured on
            measured.append([f"`{run.name}`", f"`{name}`", plots.count_label(run.replicas, run.device_kind),
                             versions or "—", len(run.epochs), f"{number(top1)}% (epoch {last_epoch})"
                             if last_epoch is not None else "—", number(plots.training_seconds(run), 1)])
    return "\n".join([
        "### Recipes", "",
        f"**Published by their sources, not measured by this project:** each recipe's ImageNet top-1 as its source "
        f"states it, with the source's hardware and wall time (read from `{portable_path(folder)}/*.toml`; "
        f"`--recipe NAME` sets a recipe's flags, docs/recipes.md).", "",
        table(["recipe", "model", "published top-1 (the source's)", "epochs", "hardware (the source's)",
               "wall time (the source's)", "source"], published), "",
        "#### Runs of a recipe measured by this project", "",
        table(["run", "recipe", "scale", "hardware and versions", "epochs", "last val top-1", "training time (s)"],
              measured) if measured
        else "None among the runs above."])


SCALING_GPU_COUNTS = ("64",)  # the model's rows RESULTS.md shows (its CSV has 1 to 1,024 GPUs)


def scaling_section(paths: Sequence[str], figures: Path) -> str:
    """The scaling model's CSVs (python -m common.tools.scaling) and Validation
    B's (python -m common.tools.link_validation), a table each: predictions
    beside the measured efficiencies where the CSV has them, else the rows at
    SCALING_GPU_COUNTS GPUs."""
    import csv

    parts = ["## Scaling model", "",
             "Predicted by `python -m common.tools.scaling` (docs/scaling.md: how, and what each input is); "
             "measured figures beside the predictions where there are some. Regenerate the CSVs, do not edit."]
    if (figures / "scaling_model.png").is_file():
        parts += ["", f"![scaling model]({(figures / 'scaling_model.png').as_posix()})"]
    for path in paths:
        try:
            with open(path, newline="") as handle:
                rows = list(csv.DictReader(handle))
        except OSError as error:
            raise UsageError(f"argument --scaling: cannot read {path} ({error.strerror})") from None
        parts += ["", f"### `{portable_path(Path(path).as_posix())}`", ""]
        if rows and "tbf_rate_mbit" in rows[0]:  # Validation B: DDP steps over a rate-limited link
            parts += [table(["link (tbf)", "gloo all-reduce (Mbit/s)", "hook", "compute (ms)", "measured (ms/step)",
                             "predicted (ms/step)", "difference", "within"],
                            [[row["link"], number(as_number(row["allreduce_busbw_mbit"]), 0), row["hook"],
                              number(as_number(row["compute_ms"]), 1), number(as_number(row["measured_ms"]), 1),
                              number(as_number(row["predicted_ms"]), 1),
                              f"{as_number(row['difference_percent']):+.1f}%",
                              f"{as_number(row['tolerance_percent']):g}%: {row['within_tolerance']}"]
                             for row in rows])]
            continue
        measured = [row for row in rows if row.get("measured_efficiency_percent")]
        if measured:  # a validation against measured runs
            parts += [table(["scenario", "hook", "GPUs", "measured efficiency", "predicted efficiency",
                             "predicted − measured", "predicted step (ms)"],
                            [[row["scenario"], row["hook"], row["gpus"],
                              f"{as_number(row['measured_efficiency_percent']):.1f}%",
                              f"{as_number(row['efficiency_percent']):.1f}%",
                              f"{as_number(row['difference_pp']):+.1f} pp", number(as_number(row["step_ms"]), 1)]
                             for row in measured])]
            continue
        shown = [row for row in rows if row["gpus"] in SCALING_GPU_COUNTS]
        parts += [table(["scenario", "hook", "GPUs", "step (ms)", "exposed communication (ms)", "data wait (ms)",
                         "images/s per GPU", "efficiency"],
                        [[row["scenario"], row["hook"], row["gpus"], number(as_number(row["step_ms"]), 2),
                          number(as_number(row["exposed_comm_ms"]), 2), number(as_number(row["data_wait_ms"]), 2),
                          number(as_number(row["images_per_second_per_gpu"]), 0),
                          f"{as_number(row['efficiency_percent']):.1f}%"] for row in shown])]
    return "\n".join(parts)


def _half_support(row: dict) -> str:
    """'capability AVX2: bf16 emulated, fp16 emulated', from the columns bench
    has written since issue 25 (older CSVs: not recorded; results/NOTES.md says)."""
    if not row.get("capability"):
        return "half-precision support not recorded by this version of the harness"

    def said(column):
        return "native" if str(row.get(column)).lower() == "true" else "emulated"

    return f"capability {row['capability']}: bf16 {said('bf16_native')}, fp16 {said('fp16_native')}"


def _note(row: dict) -> str:
    return f" ({row['note']})" if row.get("note") else ""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m common.tools.results", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories, or folders holding them")
    parser.add_argument("--upstream", metavar="DIR", help="reference logs to compare with (e.g. results/upstream)")
    parser.add_argument("--notes", metavar="FILE",
                        help="Markdown appended under 'Notes': context no log holds (how the runs were "
                             "made, what to read from them); numbers belong in the logs, not here")
    parser.add_argument("--bench", nargs="+", metavar="CSV", default=None,
                        help="CSV files of python -m common.tools.bench: a benchmark section, one table per file")
    parser.add_argument("--scaling", nargs="+", metavar="CSV", default=None,
                        help="CSV files of python -m common.tools.scaling and common.tools.link_validation: the "
                             "scaling model's section, one table per file")
    parser.add_argument("--profiles", nargs="+", metavar="FILE", default=None,
                        help="summary.txt files of --profile-steps, an env.txt (date, then nvidia-smi) beside each: "
                             "their step times in the summary, with the GPU and the date")
    parser.add_argument("--recipe-runs", nargs="+", metavar="RUN_DIR", default=None,
                        help="run directories (or folders of them) of recipes measured here on other data than the "
                             "runs above (the demo's digits): listed only in the recipes section, apart from the "
                             "scaling tables")
    parser.add_argument("--recipes", metavar="DIR", default=None,
                        help="folder of the recipe files (common/recipes): a recipes section, the figures their "
                             "sources published apart from the runs of a recipe measured here")
    parser.add_argument("--figures", default="figures", metavar="DIR",
                        help="folder of the figures (python -m common.tools.plots); links to those that exist")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    runs = sorted((run for path in args.runs for run in load_runs(path)),
                  key=lambda run: (run.series, run.replicas, run.name))
    upstream = load_runs(args.upstream) if args.upstream else []
    generated_by = portable_command(shlex.join(["python", "-m", "common.tools.results", *argv]))
    out = ["# Results", "",
           f"Generated by `{generated_by}` from the runs' own logs (config.json, "
           f"metrics.csv): every number below is read from them or derived by `common/tools/plots.py`. Regenerate, "
           f"do not edit. Epochs count from 0. Throughput is global training images/s, averaged over epochs.", "",
           results_summary.summary(read_bench(args.bench or ()), upstream, args.scaling or (), Path(args.figures),
                                   args.profiles or ())]
    if args.recipes:
        recipe_runs = [run for path in (args.recipe_runs or ()) for run in load_runs(path)]
        out += ["", recipes_section(args.recipes, [*runs, *recipe_runs])]
    out += ["", "## Across runs", "", across_runs(runs)]
    grouped = ("Grouped by hardware and GPU count: runs of the same count are averaged; scaling efficiency is "
               "per-GPU throughput relative to the smallest count of the same hardware (CPU processes that share "
               "one machine's cores are no scaling: the figures' titles say so).")
    if not upstream:
        out += ["", grouped, "", summary_table(plots.summarize(runs))]
    if upstream:
        out += ["", "## Upstream reference numbers, regenerated from its logs", "",
                f"**The `{upstream[0].series.split(':')[0]}` rows are not this project's:** they are another "
                f"project's 2020 run on NVIDIA V100 GPUs, read from its logs in `{portable_path(args.upstream)}` "
                f"(TensorBoard "
                f"exports; see the README there). The other rows are this project's runs (each one under Runs, below), side by side. "
                f"Hardware differs between the groups: compare within a group. Training time of TensorBoard logs is "
                f"(last - first end-of-epoch wall time) + one mean epoch, so the first epoch counts; a figure "
                f"quoted as last - first leaves it out. {grouped}", "",
                summary_table(plots.summarize([*upstream, *runs]))]
    out += figures_section(Path(args.figures), bool(upstream))
    if args.scaling:
        out += ["", scaling_section(args.scaling, Path(args.figures))]
    out += ["", "## Runs", "", "Each run's command, hardware, options and epochs, read from its run directory.", "",
            "\n\n".join(folded(f"<code>{run.name}</code>: {plots.count_label(run.replicas, run.device_kind)}, "
                                f"{len(run.epochs)} epoch(s)", run_section(run)) for run in runs)]
    if args.bench:
        out += ["", bench_section(args.bench)]
    if args.notes:
        try:
            out += ["", "## Notes", "", Path(args.notes).read_text().strip()]
        except OSError as error:
            raise UsageError(f"argument --notes: cannot read {args.notes} ({error.strerror})") from None
    text = "\n".join(out) + "\n"
    sys.stdout.write(text)
    return text


def figures_section(figures: Path, with_upstream: bool) -> List[str]:
    """The figures that exist, this project's and beside them the upstream logs'
    (python -m common.tools.plots UPSTREAM --out FIGURES/upstream)."""
    folders = {"this project": figures, "upstream": figures / "upstream"}
    if not with_upstream:
        del folders["upstream"]
    cells = {(name, who): f"![{who} {name}]({(folder / (name + '.png')).as_posix()})"
             for name in FIGURE_NAMES for who, folder in folders.items() if (folder / (name + ".png")).is_file()}
    shown = [name for name in FIGURE_NAMES if any((name, who) in cells for who in folders)]
    if not shown:
        return []
    return ["", "## Figures", "", "Drawn by `python -m common.tools.plots` into " +
            " and ".join(f"`{folder.as_posix()}/` ({who})" for who, folder in folders.items()) + ".", "",
            table(["figure", *folders], [[name, *(cells.get((name, who), "—") for who in folders)]
                                         for name in shown])]


if __name__ == "__main__":
    run_main(main)
