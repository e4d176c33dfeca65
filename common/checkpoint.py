"""Checkpoints: atomic save, safe load, full-state resume.

A checkpoint holds everything needed to continue as if never stopped: the
unwrapped model (so any of the four scripts can load it), optimizer,
precision-policy state, next epoch, best top-1, RNG states, class names and
the run's options. Files are written to a temporary name and renamed, so a
crash mid-write leaves the previous checkpoint intact. Loading uses
torch.load(weights_only=True): a checkpoint cannot run code.
"""
from __future__ import annotations

import dataclasses
import os
import random
import shutil
from pathlib import Path
from typing import BinaryIO, Callable, Dict, List, Optional

import numpy as np
import torch
from torch import nn
from torch.optim import Optimizer

from common.cli import UsageError, error_summary
from common.models import unwrap

FORMAT = "imagenet-reference-checkpoint/1"
CHECKPOINT_NAME = "checkpoint.pth.tar"  # the newest epoch's state (names as in pytorch/examples)
BEST_NAME = "model_best.pth.tar"  # the state of the epoch with the best validation top-1


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


def training_state(*, model: nn.Module, optimizer: Optimizer, precision_state: dict, next_epoch: int,
                   best_acc1: float, best_epoch: Optional[int], arch: str, classes: List[str],
                   config: dict) -> dict:
    """The checkpoint contents after an epoch (`next_epoch` is the one to run next)."""
    return {
        "format": FORMAT,
        "arch": arch,
        "epoch": next_epoch,
        "state_dict": _plain_state_dict(unwrap(model).state_dict()),  # also inner wrappers (DataParallel features)
        "optimizer": optimizer.state_dict(),
        "precision": precision_state,
        "best_acc1": best_acc1,
        "best_epoch": best_epoch,
        "classes": list(classes),
        "rng": capture_rng_state(),
        "config": config,
    }


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


def save(state: dict, run_dir: Path, is_best: bool) -> Path:
    """Save `state` as run_dir/checkpoint.pth.tar (and model_best.pth.tar when
    it is the best so far), atomically. Call on the primary process only."""
    path = Path(run_dir) / CHECKPOINT_NAME
    _atomic_write(path, lambda handle: torch.save(state, handle))
    if is_best:
        with open(path, "rb") as source:
            _atomic_write(path.with_name(BEST_NAME), lambda handle: shutil.copyfileobj(source, handle))
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


_WRAPPER_NAMES = {"module", "_orig_mod"}  # what DataParallel / DDP and torch.compile insert in parameter names


def _plain_state_dict(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Drop the 'module.' and '_orig_mod.' components that wrappers add,
    wherever they stand: pytorch/examples wraps only AlexNet's and VGG's
    `features` (features.module.0.weight), so checkpoints of other trainers load too."""
    return {".".join(part for part in key.split(".") if part not in _WRAPPER_NAMES): value
            for key, value in state_dict.items()}


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
        unwrap(model).load_state_dict(_plain_state_dict(state["state_dict"]))
    except RuntimeError as error:
        raise UsageError(f"argument {flag}: {path} does not fit the {arch} model "
                         f"({error_summary(error, line=-1)})") from None


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where training starts: the epoch, and the best validation top-1 so far."""

    start_epoch: int
    best_acc1: float = float("-inf")  # -inf before any validation: the first epoch is the best so far
    best_epoch: Optional[int] = None


def resume(path: str, model: nn.Module, optimizer: Optimizer, precision, arch: str,
           classes: List[str]) -> ResumePoint:
    """Restore model, optimizer, precision policy and RNG states from `path`;
    returns where to continue. The LR schedule is a function of the epoch,
    so restoring the epoch restores it."""
    state = load(path)
    load_model_weights(state, model, arch, classes, "--resume", path)
    if "optimizer" in state:
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as error:
            raise UsageError(f"argument --resume: the optimizer state in {path} does not fit this run's "
                             f"optimizer ({error_summary(error)})") from None
    precision.load_state_dict(state.get("precision") or {})
    if "rng" in state:
        restore_rng_state(state["rng"])
    best = state.get("best_acc1", 0.0)
    return ResumePoint(
        start_epoch=int(state.get("epoch", 0)),
        best_acc1=float(best.item() if isinstance(best, torch.Tensor) else best),
        best_epoch=state.get("best_epoch"),
    )
