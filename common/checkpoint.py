"""Checkpoints: atomic save, rotation, safe load, full-state and mid-epoch resume.

A checkpoint holds everything needed to continue as if never stopped: the
unwrapped model (so any of the four scripts can load it), optimizer,
precision-policy state (the loss scaler), the position (epoch, steps and
images of it done: the LR schedule is a function of the position), the
training split's sums and times so far (so the epoch's metrics row counts
every step once), best top-1, seed, world size, global batch and LR, RNG
states, class names and the run's options.

In a run directory each checkpoint is a file of its own,
checkpoint-epoch<E>-images<N>.pth.tar (E: the epoch in progress, N: its
images done, all processes together); checkpoint.pth.tar is always the newest (a hard link, or a copy where
the file system has none), model_best.pth.tar the best epoch's, and only the
newest --keep-checkpoints files are kept. Files are written to a temporary
name, flushed and renamed, so a crash mid-write leaves the previous
checkpoint intact; --resume auto still checks each file and falls back to
the previous one when the newest cannot be read. Loading uses
torch.load(weights_only=True): a checkpoint cannot run code.
"""
from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import BinaryIO, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch
from torch import nn
from torch.optim import Optimizer

from common.cli import Config, UsageError, error_summary
from common.distributed import Context, broadcast_from_primary
from common.models import unwrap

FORMAT = "imagenet-reference-checkpoint/2"  # /2: a position within the epoch (step, images_done, partial_epoch)
CHECKPOINT_NAME = "checkpoint.pth.tar"  # the newest state (names as in pytorch/examples)
BEST_NAME = "model_best.pth.tar"  # the state of the epoch with the best validation top-1
_KEPT_NAME = re.compile(r"^checkpoint-epoch(\d+)-images(\d+)\.pth\.tar$")


def kept_name(epoch: int, images_done: int) -> str:
    """The file name of the checkpoint taken with `images_done` images of epoch
    `epoch` trained on. Images, not steps: a resume with another global batch
    numbers its steps differently, but names must keep sorting by progress."""
    return f"checkpoint-epoch{epoch:03d}-images{images_done:08d}.pth.tar"


def capture_rng_state() -> dict:
    """RNG states of torch (CPU and CUDA), Python and NumPy, as plain types."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), position, has_gauss, cached_gaussian],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This process's GPU only: a resume may see fewer GPUs, and touching the others would
        # create a CUDA context on each of them.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))
    if "cuda" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])


def training_state(*, model: nn.Module, optimizer: Optimizer, precision_state: dict, epoch: int, step: int,
                   images_done: int, partial_epoch: Optional[dict], best_acc1: float, best_epoch: Optional[int],
                   arch: str, classes: List[str], config: dict, world_size: int, global_batch: int, lr: float,
                   seed: int) -> dict:
    """The checkpoint contents with `step` steps (`images_done` images, all
    processes) of epoch `epoch` done; after an epoch, the next epoch at step 0."""
    return {
        "format": FORMAT,
        "arch": arch,
        "epoch": epoch,
        "step": step,
        "images_done": images_done,
        "partial_epoch": partial_epoch,  # the training split's sums and timing up to `step` (engine.Trainer)
        "state_dict": _plain_state_dict(unwrap(model).state_dict()),  # also inner wrappers (DataParallel features)
        "optimizer": optimizer.state_dict(),
        "precision": precision_state,
        "best_acc1": best_acc1,
        "best_epoch": best_epoch,
        "classes": list(classes),
        "world_size": world_size,  # model replicas
        "global_batch": global_batch,
        "lr": lr,  # the peak rate after linear scaling
        "seed": seed,
        "rng": capture_rng_state(),
        "config": config,
    }


def expected_bytes(model: nn.Module, optimizer: Optimizer) -> int:
    """About how large this run's checkpoint files will be, before training
    has created the optimizer's state: the weights and buffers, plus one
    buffer per parameter for each of SGD's momentum and Adam's two moments
    (the rest, RNG states and the config, is a few kilobytes)."""
    weights = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
    parameters = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    defaults = optimizer.defaults
    buffers = 2 if "betas" in defaults else 1 if defaults.get("momentum") else 0
    return weights + buffers * parameters


def _atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write to a temporary file beside `path`, flush it to disk, then rename it
    over `path`: readers see the old file or the new one, never half of one."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()


def _link_atomically(source: Path, destination: Path) -> None:
    """Make `destination` the same file as `source` (a hard link: no second
    copy on disk; a copy where links are not supported), replacing it at once."""
    temporary = destination.with_name(f".{destination.name}.tmp-{os.getpid()}")
    try:
        try:
            os.link(source, temporary)
        except OSError:
            with open(source, "rb") as original:
                _atomic_write(temporary, lambda handle: shutil.copyfileobj(original, handle))
        os.replace(temporary, destination)
    finally:
        if temporary.exists():
            temporary.unlink()


def position_of(path: Path) -> Optional[Tuple[int, int]]:
    """(epoch, images done) of a checkpoint-epoch<E>-images<N>.pth.tar file; None for other names."""
    match = _KEPT_NAME.match(Path(path).name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def kept_checkpoints(run_dir: Path) -> List[Path]:
    """The run directory's checkpoint-epoch*-images*.pth.tar files, newest first."""
    found = [path for path in Path(run_dir).iterdir() if position_of(path) is not None]
    return sorted(found, key=position_of, reverse=True)


def save(state: dict, run_dir: Path, is_best: bool, keep: int = 3) -> Path:
    """Save `state` as its own file in `run_dir`, make checkpoint.pth.tar (and,
    when it is the best so far, model_best.pth.tar) that file, and delete all
    but the newest `keep` checkpoint files. Call on the primary process only.
    Returns the new file's path."""
    run_dir = Path(run_dir)
    path = run_dir / kept_name(state["epoch"], state.get("images_done", 0))
    _atomic_write(path, lambda handle: torch.save(state, handle))
    _link_atomically(path, run_dir / CHECKPOINT_NAME)
    if is_best:
        _link_atomically(path, run_dir / BEST_NAME)
    for old in kept_checkpoints(run_dir)[keep:]:
        old.unlink()
    return path


def load(path: str, flag: str = "--resume") -> dict:
    """Read a checkpoint without executing code; a foreign or damaged file is
    a UsageError naming `flag` and the path."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # damaged zip, truncated file, pickle with code: all unreadable to us
        raise UsageError(f"argument {flag}: {path} is not a readable checkpoint ({error_summary(error)})") from None
    if not isinstance(state, dict) or "state_dict" not in state:
        raise UsageError(f"argument {flag}: {path} is not a training checkpoint (it has no 'state_dict')")
    return state


def newest_readable(run_dir: Path) -> Tuple[Optional[Path], List[str]]:
    """The newest checkpoint of `run_dir` that loads, by position (the kept
    files; checkpoint.pth.tar, normally one of them, only when it is not:
    a run directory of an older version, or a copy), and a warning for each
    newer one that does not. (None, []) when there is none at all;
    (None, warnings) when every one is unreadable."""
    run_dir = Path(run_dir)
    newest = run_dir / CHECKPOINT_NAME
    candidates = kept_checkpoints(run_dir)
    if newest.is_file() and not any(os.path.samefile(newest, path) for path in candidates):
        candidates.append(newest)
    warnings = []
    for path in candidates:
        try:
            load(str(path))
        except UsageError as error:
            also = f" ({newest})" if newest.is_file() and os.path.samefile(newest, path) and path != newest else ""
            warnings.append(f"{path}{also} " + str(error).split(f"{path} ", 1)[1])  # without "argument --resume: "
            continue
        return path, warnings
    return None, warnings


def auto_run_name(cfg: Config, environ: Mapping[str, str] = os.environ) -> str:
    """The run directory's name for --resume auto: one that is the same when
    the job starts again (requeued by Slurm, restarted by torchrun)."""
    if cfg.run_name is not None:
        return cfg.run_name
    if environ.get("SLURM_ARRAY_JOB_ID") and environ.get("SLURM_ARRAY_TASK_ID"):
        return f"slurm-{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
    if environ.get("SLURM_JOB_ID"):
        return f"slurm-{environ['SLURM_JOB_ID']}"
    run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id not in ("", "none"):
        return f"torchrun-{run_id}"
    raise UsageError("argument --resume: auto needs a run directory that stays the same when the job starts "
                     "again: pass --run-name NAME (under Slurm the job id names it)")


_WRAPPER_NAMES = {"module", "_orig_mod"}  # what DataParallel / DDP and torch.compile insert in parameter names


def _plain_name(key: str) -> str:
    return ".".join(part for part in key.split(".") if part not in _WRAPPER_NAMES)


def _plain_state_dict(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Drop the 'module.' and '_orig_mod.' components that wrappers add,
    wherever they stand: pytorch/examples wraps only AlexNet's and VGG's
    `features` (features.module.0.weight), so checkpoints of other trainers load too."""
    return {_plain_name(key): value for key, value in state_dict.items()}


def _load_plain_state_dict(model: nn.Module, plain: Dict[str, torch.Tensor]) -> None:
    """Load plain names into `model`, whose own names may hold wrappers inside
    it (imagenet_dp.py's AlexNet and VGG on GPUs: features.module.0.weight)."""
    target = unwrap(model)
    own_names = {_plain_name(key): key for key in target.state_dict()}
    target.load_state_dict({own_names.get(key, key): value for key, value in plain.items()})


def load_model_weights(state: dict, model: nn.Module, arch: str, classes: List[str], flag: str, path: str) -> None:
    """Load the checkpoint's weights into `model`, after checking they are for
    the same architecture and the same classes as this run."""
    if state.get("arch", arch) != arch:
        raise UsageError(f"argument {flag}: {path} holds a {state['arch']} model, not {arch}; "
                         f"pass -a {state['arch']}")
    saved_classes = state.get("classes")
    if saved_classes is not None and list(saved_classes) != list(classes):
        missing = sorted(set(saved_classes) - set(classes))
        extra = sorted(set(classes) - set(saved_classes))
        detail = ", ".join(part for part in (
            f"not in DATA: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else "") if missing else "",
            f"only in DATA: {', '.join(extra[:5])}" + (" ..." if len(extra) > 5 else "") if extra else "",
        ) if part) or "same names in a different order"
        raise UsageError(f"argument {flag}: {path} was trained on {len(saved_classes)} classes, DATA has "
                         f"{len(classes)} ({detail})")
    try:
        _load_plain_state_dict(model, _plain_state_dict(state["state_dict"]))
    except RuntimeError as error:
        raise UsageError(f"argument {flag}: {path} does not fit the {arch} model "
                         f"({error_summary(error, line=-1)})") from None


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where training starts: the epoch, the steps and images of it already
    done (a mid-epoch checkpoint), and the best validation top-1 so far."""

    start_epoch: int
    best_acc1: float = float("-inf")  # -inf before any validation: the first epoch is the best so far
    best_epoch: Optional[int] = None
    step: int = 0  # steps of start_epoch done before the checkpoint
    images_done: int = 0  # images of start_epoch's order trained on, all processes together
    partial_epoch: Optional[dict] = None  # start_epoch's training sums and timing so far
    path: Optional[str] = None  # the checkpoint resumed from


def _choose_checkpoint(cfg: Config, ctx: Context, log) -> Optional[str]:
    """The file --resume names; for `auto`, the primary's choice in the run
    directory (on every process), or None to start from scratch."""
    if cfg.resume != "auto":
        return cfg.resume
    choice = error = None
    if ctx.is_primary:
        try:
            run_dir = Path(cfg.logdir) / auto_run_name(cfg)
            path, warnings = newest_readable(run_dir) if run_dir.is_dir() else (None, [])
            for warning in warnings if path is not None else []:
                print(f"warning: {warning}; using the previous checkpoint {path}", file=sys.stderr, flush=True)
            if path is None and warnings:
                error = (f"argument --resume: no checkpoint in {run_dir} can be read (the last tried: "
                         f"{warnings[-1]}); move the damaged files away to start from scratch")
            elif path is None:
                log.info(f"--resume auto: no checkpoint in {run_dir} yet; starting from scratch")
            else:
                choice = str(path)
        except UsageError as failure:
            error = str(failure)
    choice, error = broadcast_from_primary((choice, error), ctx)
    if error is not None:
        raise UsageError(error)
    return choice


# The options that make up the training recipe (not where the data or logs are, nor how processes meet).
_RECIPE_OPTIONS = ("epochs", "batch_size", "lr", "momentum", "weight_decay", "label_smoothing", "lr_schedule",
                   "lr_steps", "warmup_epochs", "image_size", "val_resize", "crop_scale", "hflip", "dropout",
                   "steps_per_epoch", "opt_level", "amp_dtype", "memory_format", "sync_bn", "data_backend")


def _changed_recipe(saved: dict, now: dict) -> str:
    """'--lr 0.2 (was 0.1), --epochs 100 (was 90)' for the recipe options that differ."""
    def plain(value):
        return list(value) if isinstance(value, (list, tuple)) else value

    return ", ".join(f"--{name.replace('_', '-')} {plain(now.get(name))} (was {plain(saved[name])})"
                     for name in _RECIPE_OPTIONS if name in saved and plain(saved[name]) != plain(now.get(name)))


def resume(cfg: Config, ctx: Context, model: nn.Module, optimizer: Optimizer, precision, classes: List[str], log, *,
           global_batch: int, lr: float) -> ResumePoint:
    """Where to start: --start-epoch without --resume; otherwise restore model,
    optimizer, precision policy and RNG states from the checkpoint --resume
    names (or, with `auto`, the newest readable one of the run directory) and
    continue at its position. A checkpoint of another world size continues
    the same epoch with this run's global batch and LR, and says so."""
    path = _choose_checkpoint(cfg, ctx, log)
    if path is None:
        return ResumePoint(start_epoch=cfg.start_epoch)
    state = load(path)
    load_model_weights(state, model, cfg.arch, classes, "--resume", path)
    if state.get("seed", cfg.seed) != cfg.seed:
        raise UsageError(f"argument --seed: {cfg.seed} is not the seed of {path} ({state['seed']}); an exact "
                         f"resume replays that seed's order and crops: pass --seed {state['seed']}")
    if "optimizer" in state:
        # The saved groups carry how the saving run stepped (fused on a GPU, foreach or not): this
        # run's device decides that, not the checkpoint's.
        implementation = {key: optimizer.defaults[key] for key in ("fused", "foreach") if key in optimizer.defaults}
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as error:
            raise UsageError(f"argument --resume: the optimizer state in {path} does not fit this run's "
                             f"optimizer ({error_summary(error)})") from None
        for group in optimizer.param_groups:
            group.update(implementation)
    precision.load_state_dict(state.get("precision") or {})
    if "rng" in state:
        restore_rng_state(state["rng"])
    best = state.get("best_acc1", 0.0)
    start = ResumePoint(
        start_epoch=int(state.get("epoch", 0)),
        best_acc1=float(best.item() if isinstance(best, torch.Tensor) else best),
        best_epoch=state.get("best_epoch"),
        step=int(state.get("step", 0)),
        images_done=int(state.get("images_done", 0)),
        partial_epoch=state.get("partial_epoch"),
        path=path,
    )
    steps = f"{start.step} step" + ("s" if start.step != 1 else "")
    where = f"epoch {start.start_epoch}" + (f" after {steps} ({start.images_done} images)" if start.step else "")
    how = "--resume auto: continuing" if cfg.resume == "auto" else "resumed from"
    best_so_far = (f", best top-1 {start.best_acc1:.2f}% at epoch {start.best_epoch}"
                   if start.best_epoch is not None else "")
    log.info(f"{how} {path} ({where}{best_so_far})")
    changed = _changed_recipe(state.get("config") or {}, cfg.to_dict())
    if changed:  # deliberate (a longer schedule), or a sign of continuing someone else's run
        log.info(f"note: options that differ from the checkpoint's run: {changed}")
    saved_world, saved_batch = state.get("world_size"), state.get("global_batch")
    if saved_world is not None and (saved_world, saved_batch) != (ctx.replicas, global_batch):
        log.info(f"the checkpoint was written by {saved_world} replicas (global batch {saved_batch}, lr "
                 f"{state.get('lr', float('nan')):g}); this run has {ctx.replicas}: global batch {global_batch}, "
                 f"lr {lr:g} (linear scaling)"
                 + (f"; epoch {start.start_epoch} goes on after its first {start.images_done} images"
                    if start.images_done else ""))
    return start
