"""The command line of every entry script, parsed (the parser and its flags:
common/flags.py) and checked across flags, and the wrapper that turns a
user's mistake into one line and exit status 2.

`parse(mode, argv)` returns a frozen `Config`: every option resolved and
checked, nothing left for later code to second-guess. Flags keep the
spellings users know from the ImageNet reference scripts (pytorch/examples).

Importing this module, --help and every mistake but one import no torch
(seconds and hundreds of MiB): the architecture names come from
common.architectures' cache, the choices from common.config, and `run`'s
launcher reading from common.launcher. The one exception is -b 1 in
training, checked last by running the model on the meta device.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
from pathlib import Path
from typing import Callable, Optional, Sequence

from common import launcher, process_signals
from common.architectures import available_architectures
from common.arguments import check_batch_fits, check_fits_in_memory, memory_bytes
from common.config import Config
from common.errors import UsageError, error_summary, run_main
from common.flags import build_parser

__all__ = ["build_parser", "parse", "run"]


def parse(mode: str, argv: Optional[Sequence[str]] = None) -> Config:
    """Parse and check the command line of the `mode` entry script."""
    parser = build_parser(mode)
    ns = parser.parse_args(argv)
    _check_values(ns)
    values = vars(ns)  # argparse destinations are the Config field names
    values.pop("multiprocessing_distributed", None)  # a no-op kept for pytorch/examples command lines
    values.update(lr_steps=tuple(ns.lr_steps), crop_scale=tuple(ns.crop_scale))  # frozen: tuples, not lists
    values["checkpoint_every_steps"], values["checkpoint_every_minutes"] = values.pop("checkpoint_every")
    return Config(mode=mode, **values)


def _check_values(ns: argparse.Namespace) -> None:
    """Checks across flags and on paths: each failure names its flag or path.
    The one check that needs torch comes last, so that every other mistake is
    reported without importing it."""
    _check_architecture(ns.arch)
    _check_distributed_flags(ns)
    _check_training_flags(ns)
    _check_machine_fits(ns)
    _check_output_paths(ns)
    if not ns.synthetic:
        _check_dataset(ns)
    if ns.batch_size == 1 and not ns.evaluate:
        # Runs the model on the meta device, so it imports torch and torchvision; only -b 1 pays for it.
        from common.models import check_one_image_per_step
        check_one_image_per_step(ns.arch, ns.image_size)


def _check_architecture(arch: str) -> None:
    archs = available_architectures()
    if arch not in archs:
        close = difflib.get_close_matches(arch, archs, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise UsageError(f"argument -a/--arch: unknown architecture {arch!r}{hint} (see --help for the list)")


def _check_distributed_flags(ns: argparse.Namespace) -> None:
    """The flags of imagenet_ddp.py and imagenet_ddp_apex.py (absent from the other scripts' namespaces)."""
    if getattr(ns, "rank", None) is not None and ns.rank >= (ns.world_size or 1):
        raise UsageError(f"argument --rank: node rank {ns.rank} is not below --world-size {ns.world_size or 1} "
                         f"(ranks count from 0)")
    if getattr(ns, "dist_url", None) is not None and not ns.dist_url.startswith("tcp://"):
        raise UsageError(f"argument --dist-url: expected tcp://HOST:PORT of node 0, got {ns.dist_url!r} "
                         f"(under torchrun, launch or srun leave it unset)")
    if getattr(ns, "dist_url", None) is not None:
        launcher.tcp_address(ns.dist_url)  # its form, now: before anything quotes or records it
    hook = getattr(ns, "ddp_comm_hook", "none")
    for flag, value in (("--powersgd-rank", getattr(ns, "powersgd_rank", None)),
                        ("--powersgd-start-step", getattr(ns, "powersgd_start_step", None))):
        if value is not None and hook != "powersgd":
            raise UsageError(f"argument {flag}: only with --ddp-comm-hook powersgd (this run: {hook})")
    if getattr(ns, "static_graph", False) and ns.accum_steps > 1:
        # DDP's static graph expects every backward to exchange gradients; torch 2.14 fails an internal
        # assertion at the first no_sync() backward (pytorch/pytorch#187732).
        raise UsageError(f"argument --static-graph: not with --accum-steps {ns.accum_steps} (DDP's static graph "
                         f"cannot skip the exchange of the micro-batches before the last)")
    if (getattr(ns, "powersgd_start_step", None) or 2) < 2:
        raise UsageError("argument --powersgd-start-step: 1 is below 2 (DDP settles its buckets in the first "
                         "steps, before PowerSGD can keep state for them)")


def _check_training_flags(ns: argparse.Namespace) -> None:
    """Epochs, image sizes, crops and the schedule, against each other."""
    if ns.start_epoch >= ns.epochs:
        raise UsageError(f"argument --start-epoch: {ns.start_epoch} is not below --epochs {ns.epochs}")
    if ns.val_resize < ns.image_size:
        raise UsageError(f"argument --val-resize: {ns.val_resize} is smaller than --image-size {ns.image_size}")
    if ns.crop_scale[0] > ns.crop_scale[1]:
        raise UsageError(f"argument --crop-scale: MIN {ns.crop_scale[0]:g} is above MAX {ns.crop_scale[1]:g}")
    if list(ns.lr_steps) != sorted(set(ns.lr_steps)):
        raise UsageError(f"argument --lr-steps: epochs must be increasing, got {' '.join(map(str, ns.lr_steps))}")
    if ns.warmup_epochs > ns.epochs:
        raise UsageError(f"argument --warmup-epochs: {ns.warmup_epochs:g} is more than --epochs {ns.epochs}")
    if ns.lr_min > ns.lr:
        raise UsageError(f"argument --lr-min: {ns.lr_min:g} is above --lr {ns.lr:g} (both per 256 images): the "
                         f"floor must not be above the peak")
    if ns.nesterov and ns.momentum == 0:
        raise UsageError("argument --nesterov: Nesterov momentum needs a --momentum above 0 (this run: 0)")


def _check_machine_fits(ns: argparse.Namespace) -> None:
    """Sizes and counts this machine could never hold, told before anything
    is allocated or started (a value of 10**15 included): one image and one
    process's batch as the float32 input the model takes, a validation
    image resized to --val-resize, the node's processes (launcher)."""
    memory = memory_bytes()
    check_batch_fits(ns.batch_size, ns.image_size, memory)
    check_fits_in_memory("--val-resize", 3 * ns.val_resize ** 2,
                         f"one validation image resized to {ns.val_resize}x{ns.val_resize} pixels", memory)
    # The flags' process count; the launcher checks the real one (GPUs, torchrun's) again before starting.
    launcher.check_node_processes(getattr(ns, "nproc_per_node", None) or 1, ns.workers, ns.batch_size,
                                  ns.image_size, share_cores=ns.device == "cpu", memory=memory)


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _check_output_paths(ns: argparse.Namespace) -> None:
    """--run-name, --resume and --report-dir: names and files a run reads or must not overwrite."""
    for flag, value in (("DATA", ns.data), ("--logdir", ns.logdir), ("--resume", ns.resume),
                        ("--file-list", ns.file_list), ("--report-dir", ns.report_dir)):
        # Taken for a path, s3://KEY:SECRET@bucket would become local folders named after the secret.
        if value is not None and _URL.match(value):
            where = flag if flag == "DATA" else f"argument {flag}"
            raise UsageError(f"{where}: {value!r} is a URL; give a path on a local or mounted file system")
    if ns.run_name is not None and (not ns.run_name or os.sep in ns.run_name or ns.run_name in (".", "..")):
        raise UsageError(f"argument --run-name: {ns.run_name!r} must be a plain folder name")
    if ns.resume is not None and ns.resume != "auto":
        resume = Path(ns.resume)
        if _is(resume, Path.is_dir, "--resume"):
            newest = resume / "checkpoint.pth.tar"  # what a run directory's newest checkpoint is called
            give = (f"give a file in it (its newest: {newest})" if _is(newest, Path.is_file, "--resume") else
                    f"give a checkpoint file (it holds no {newest.name}, a run directory's newest)")
            raise UsageError(f"argument --resume: {resume} is a directory, not a checkpoint file; {give}, or --resume "
                             f"auto --logdir {resume.parent} --run-name {resume.name} to continue the run there")
        if not _is(resume, Path.is_file, "--resume"):
            raise UsageError(f"argument --resume: no such checkpoint file: {resume}")
        if not os.access(resume, os.R_OK):
            raise UsageError(f"argument --resume: cannot read {resume} (permission denied)")
    if ns.report_dir is not None:
        if not ns.evaluate:
            raise UsageError("argument --report-dir: only with --evaluate (training writes its per-class report "
                             "into the run directory)")
        for name in ("val_report.csv", "confusion_matrix.npy"):
            if _is(Path(ns.report_dir) / name, Path.exists, "--report-dir"):
                raise UsageError(f"argument --report-dir: {Path(ns.report_dir) / name} exists; "
                                 f"choose another folder (nothing is overwritten)")


def _check_dataset(ns: argparse.Namespace) -> None:
    """DATA and --file-list, unless --synthetic."""
    if ns.data is None:
        raise UsageError("DATA: missing; give the dataset folder (holding train/ and val/), or use --synthetic")
    root = Path(ns.data)
    if not _is(root, Path.is_dir, "DATA"):
        what = "not a directory" if _is(root, Path.exists, "DATA") else "no such directory"
        raise UsageError(f"DATA {root}: {what} (the dataset folder, holding train/ and val/)")
    for split in ("train", "val"):
        if not _is(root / split, Path.is_dir, "DATA"):
            raise UsageError(f"DATA {root}: no {split}/ folder (expected {root / split}/<class>/<images>)")
    if ns.file_list is not None and not _is(Path(ns.file_list), Path.is_file, "--file-list"):
        if _is(Path(ns.file_list), Path.is_dir, "--file-list"):
            raise UsageError(f"argument --file-list: {ns.file_list} is a directory; give the list file "
                             f"(python -m common.tools.filelist DATA PATH writes one)")
        raise UsageError(f"argument --file-list: no such file: {ns.file_list}")


def _is(path: Path, test: Callable[[Path], bool], flag: str) -> bool:
    """`test(path)` (is_file, is_dir, exists), where an OSError other than
    "no such file" (a name too long, a folder on the way that cannot be
    entered) is the user's to fix: a UsageError naming `flag` and the path."""
    try:
        return test(path)
    except OSError as error:
        where = f"argument {flag}" if flag.startswith("-") else flag
        raise UsageError(f"{where}: cannot look at {path} ({error.strerror or error_summary(error)})") from None


def run(main: Callable[[], object]) -> None:
    """Run an entry script's main(): a UsageError becomes one line on stderr
    and exit status 2, Ctrl-C exit status 130, neither with a traceback
    (errors.exit_status)."""
    process_signals.ignore_stop_signals_until_training()
    run_main(main, *launcher.launched_identity())
