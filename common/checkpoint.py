"""Checkpoints: what one holds, writing it, loading it safely, resuming from it.

A checkpoint holds everything needed to continue as if never stopped: the
unwrapped model (so any of the four scripts can load it), optimizer,
precision-policy state (the loss scaler), the position (epoch, steps and
images of it done: the LR schedule is a function of the position), the
training split's sums and times so far (so the epoch's metrics row counts
every step once), best top-1, seed, world size, global batch and LR, RNG
states, class names and the run's options. The Checkpointer writes them
for a run and keeps track of the best epoch and the newest file; where the
files go, their names and which are kept is common.rundir's. Loading checks the
file first (a format torch.save writes; for its zip archive, every record's
CRC-32, which torch.load leaves unchecked), then uses
torch.load(weights_only=True): a checkpoint cannot run code; --resume auto
checks each file and falls back to the previous one when the newest cannot
be read or is damaged.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import pickle
import random
import re
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn
from torch.optim import Optimizer

from common import rundir
from common.comm import CommHook
from common.config import RECIPE_OPTIONS, Config
from common.distributed import Context, broadcast_from_primary, decided_by_primary
from common.ema import ModelEMA
from common.errors import UsageError, error_summary
from common.models import unwrap
from common.rundir import CHECKPOINT_NAME, kept_checkpoints

FORMAT = "imagenet-reference-checkpoint/2"  # /2: a position within the epoch (step, images_done, partial_epoch)


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
                   seed: int, comm_hook: Optional[dict] = None, model_ema: Optional[dict] = None,
                   best_source: Optional[str] = None) -> dict:
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
        "comm_hook": comm_hook,  # DDP's communication hook and its state per process (common.comm); None: no DDP
        "best_acc1": best_acc1,
        "best_epoch": best_epoch,
        "best_source": best_source,  # which top-1 made best_acc1: "model", or "ema" (--model-ema's average)
        # --model-ema: common.ema.ModelEMA.state_dict(), its weights' names plain as the model's; None: none kept
        "model_ema": None if model_ema is None else {**model_ema,
                                                     "state_dict": _plain_state_dict(model_ema["state_dict"])},
        "classes": list(classes),
        "world_size": world_size,  # model replicas
        "global_batch": global_batch,
        "lr": lr,  # the peak rate after linear scaling
        "seed": seed,
        "rng": capture_rng_state(),
        "config": config,
    }


def expected_bytes(model: nn.Module, optimizer: Optimizer, ema: Optional[ModelEMA] = None) -> int:
    """About how large this run's checkpoint files will be, before training
    has created the optimizer's state: the weights and buffers (twice with
    --model-ema's average), plus one buffer per parameter for each of SGD's
    momentum and Adam's two moments (the rest, RNG states and the config, is
    a few kilobytes)."""
    weights = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
    weights *= 2 if ema is not None else 1
    parameters = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    defaults = optimizer.defaults
    buffers = 2 if "betas" in defaults else 1 if defaults.get("momentum") else 0
    return weights + buffers * parameters


def save(state: dict, run_dir: Path, is_best: bool, keep: int = 3) -> Path:
    """Save `state` as its own file in `run_dir` (common.rundir names it,
    links checkpoint.pth.tar and model_best.pth.tar, and keeps the newest
    `keep`). Call on the primary process only. Returns the new file's path."""
    return rundir.add_checkpoint(Path(run_dir), state["epoch"], state.get("images_done", 0),
                                 lambda handle: torch.save(state, handle), is_best, keep)


# How the files torch.save writes begin: a zip archive (PyTorch 1.6 and later), or, before, the
# pickled magic number of torch.serialization (MAGIC_NUMBER, pickle protocol 2).
_ZIP_HEAD = b"PK\x03\x04"
_LEGACY_HEAD = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)
_NOT_PYTORCH = "is not a PyTorch checkpoint"
_DAMAGED = "is not a readable checkpoint (damaged: "


def _sentence(text: str, limit: int = 160) -> str:
    """The first sentence of a message's first line, whole, or cut at a word
    and marked so: a quoted reason never ends mid-word."""
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    sentence = re.split(r"(?<=[.!?])\s", line, maxsplit=1)[0].rstrip(".")
    return sentence if len(sentence) <= limit else sentence[:limit].rsplit(" ", 1)[0] + " ..."


# Bytes no text holds (a NUL, the other C0 controls but tab, line breaks, form feed and escape).
_BINARY_BYTES = bytes(set(range(32)) - {9, 10, 12, 13, 27})


def _foreign_kind(head: bytes) -> str:
    if head.startswith(b"\x80"):
        return "a plain pickle, not the zip archive torch.save writes"
    if any(byte in _BINARY_BYTES for byte in head):
        return "not the zip archive torch.save writes"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as error:
        if error.start < len(head) - 3:  # not just a character cut by the end of what was read
            return "not the zip archive torch.save writes"
    return "text, not the zip archive torch.save writes"


def _zero_bytes(handle, head: bytes) -> Optional[int]:
    """The file's size when every byte of it is zero (what a crash or a full
    disk can leave of a file whose space was reserved but never written);
    None at its first other byte. Read in 1 MiB pieces: memory bounded,
    time that of reading the file once."""
    size = len(head)
    while head:
        if head.count(0) != len(head):
            return None
        head = handle.read(1 << 20)
        size += len(head)
    return size


def _container_problem(path: str) -> Optional[str]:
    """What makes `path` other than an intact file of torch.save, told
    before anything is unpickled; None when it is one. The zip archive
    torch.save writes holds a CRC-32 of each record (data.pkl and every
    tensor's bytes), and torch.load checks none of them: a flipped bit in a
    tensor loads silently. Checking them reads the file once more: 0.06 s for
    100 MB from the page cache, against 0.31 s for torch.load itself
    (measured on 2 cores). The format before PyTorch 1.6 has no checksums."""
    with open(path, "rb") as handle:
        head = handle.read(512)
        if not head:
            return _DAMAGED + "the file is empty)"
        if head.startswith(_LEGACY_HEAD):
            return None
        if not head.startswith(_ZIP_HEAD):
            zeros = _zero_bytes(handle, head)
            if zeros is not None:
                return (f"{_NOT_PYTORCH} (a file of {zeros:,} zero bytes: space reserved but never written, as a "
                        f"crash or a full disk leaves it)")
            return f"{_NOT_PYTORCH} ({_foreign_kind(head)})"
        handle.seek(0)
        try:
            with zipfile.ZipFile(handle) as archive:
                if not any(name.rsplit("/", 1)[-1] == "data.pkl" for name in archive.namelist()):
                    return f"{_NOT_PYTORCH} (a zip archive without the data.pkl torch.save writes)"
                failed = archive.testzip()
        except zipfile.BadZipFile as error:
            if "not a zip file" in str(error):  # its directory, at the end of the file, is missing
                return _DAMAGED + "cut short, its zip directory is missing)"
            return _DAMAGED + f"{_sentence(str(error))})"
        except (EOFError, ValueError, NotImplementedError, RuntimeError) as error:  # zipfile's other refusals
            return _DAMAGED + f"{_sentence(str(error)) or type(error).__name__})"
    if failed is not None:
        record = failed.split("/", 1)[-1]  # inside the archive's one folder: data.pkl, or data/<n>, a tensor's
        return _DAMAGED + f"the bytes of {record} fail their CRC-32 check)"
    return None


def load(path: str, flag: str = "--resume") -> dict:
    """Read a checkpoint without executing code, after checking it is an
    intact file of torch.save (_container_problem); a foreign, damaged or
    code-holding file is a UsageError naming `flag` and the path."""
    try:
        problem = _container_problem(path)
    except OSError as error:
        raise UsageError(f"argument {flag}: {path} is not a readable checkpoint ({error.strerror})") from None
    if problem is not None:
        raise UsageError(f"argument {flag}: {path} {problem}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols, meant for its own developers
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a pickle with code, or damage the checksums did not cover: unreadable to us
        # torch's own text advises loading the file unsafely: quote the refused callable, or the cause.
        refused = re.search(r"GLOBAL ([\w.]+)", str(error))
        if refused:
            raise UsageError(f"argument {flag}: {path} holds code ({refused.group(1)}, which loading it would "
                             f"call); refused") from None
        cause = error.__context__ if isinstance(error, pickle.UnpicklingError) and error.__context__ else error
        raise UsageError(f"argument {flag}: {path} {_DAMAGED}{_sentence(str(cause)) or type(cause).__name__})") \
            from None
    if not isinstance(state, dict) or "state_dict" not in state:
        raise UsageError(f"argument {flag}: {path} is not a training checkpoint (it has no 'state_dict')")
    return state


def newest_readable(run_dir: Path) -> Tuple[Optional[Path], List[str]]:
    """The newest checkpoint of `run_dir` that loads, by position (the kept
    files; checkpoint.pth.tar, normally one of them, only when it is not:
    a run directory of an older version, or a copy), and a warning for each
    newer one that does not. (None, []) when there is none at all;
    (None, warnings) when every one is unreadable."""
    path, warnings, _ = _newest_loaded(run_dir)
    return path, warnings


def _newest_loaded(run_dir: Path) -> Tuple[Optional[Path], List[str], Optional[dict]]:
    """newest_readable, with the state it loaded: --resume auto restores from
    it instead of reading the file again (100 MB and more per restart)."""
    run_dir = Path(run_dir)
    newest = run_dir / CHECKPOINT_NAME
    candidates = kept_checkpoints(run_dir)
    if newest.is_file() and not any(os.path.samefile(newest, path) for path in candidates):
        candidates.append(newest)
    warnings = []
    for path in candidates:
        try:
            state = load(str(path))
        except UsageError as error:
            also = f" ({newest})" if newest.is_file() and os.path.samefile(newest, path) and path != newest else ""
            warnings.append(f"{path}{also} " + str(error).split(f"{path} ", 1)[1])  # without "argument --resume: "
            continue
        return path, warnings, state
    return None, warnings, None


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
    best_source: Optional[str] = None  # whose top-1 best_acc1 is: "model" or "ema" (--model-ema)
    has_ema: bool = False  # the checkpoint held a --model-ema average, now restored


def _choose_checkpoint(cfg: Config, ctx: Context, log,
                       auto_dir: Optional[Path]) -> Tuple[Optional[str], Optional[dict]]:
    """The file --resume names; for `auto`, the primary's choice in `auto_dir`
    (the run directory, on the primary), on every process, or None to start
    from scratch. With it, the state the primary loaded to choose it (None elsewhere)."""
    if cfg.resume != "auto":
        return cfg.resume, None
    loaded = {}  # the primary's loaded state: kept here, not broadcast

    def choose() -> Optional[str]:
        path, warnings, loaded["state"] = _newest_loaded(auto_dir) if auto_dir.is_dir() else (None, [], None)
        for warning in warnings if path is not None else []:
            print(f"warning: {warning}; using the previous checkpoint {path}", file=sys.stderr, flush=True)
        if path is None and warnings:
            raise UsageError(f"argument --resume: no checkpoint in {auto_dir} can be read (the last tried: "
                             f"{warnings[-1]}); move the damaged files away to start from scratch")
        if path is None:
            log.info(f"--resume auto: no checkpoint in {auto_dir} yet; starting from scratch")
        return None if path is None else str(path)

    return decided_by_primary(choose, ctx), loaded.get("state")


def _changed_recipe(saved: dict, now: dict) -> str:
    """'--lr 0.2 (was 0.1), --epochs 100 (was 90)' for the recipe options that differ."""
    def plain(value):
        return list(value) if isinstance(value, (list, tuple)) else value

    return ", ".join(f"--{name.replace('_', '-')} {plain(now.get(name))} (was {plain(saved[name])})"
                     for name in RECIPE_OPTIONS if name in saved and plain(saved[name]) != plain(now.get(name)))


def resume(cfg: Config, ctx: Context, model: nn.Module, optimizer: Optimizer, precision, classes: List[str], log, *,
           global_batch: int, lr: float, auto_dir: Optional[Path], comm_hook: Optional[CommHook] = None,
           ema: Optional[ModelEMA] = None) -> ResumePoint:
    """Where to start: --start-epoch without --resume; otherwise restore model,
    optimizer, precision policy and RNG states from the checkpoint --resume
    names (or, with `auto`, the newest readable one of `auto_dir`, the run
    directory, which the primary has opened and locked) and continue at its position. A checkpoint of another world size continues
    the same epoch with this run's global batch and LR, and says so. `ema`:
    --model-ema's average (or, for --evaluate, one to restore a saved one into)."""
    path, state = _choose_checkpoint(cfg, ctx, log, auto_dir)
    if path is None:
        return ResumePoint(start_epoch=cfg.start_epoch)
    state = state if state is not None else load(path)  # --resume auto's primary has read it already
    blurred = bool((state.get("config") or {}).get("blurpool", False))
    if blurred != cfg.blurpool:  # the models' modules differ: said before their weights fail to fit
        raise UsageError(f"argument --resume: {path} holds a model trained {'with' if blurred else 'without'} "
                         f"--blurpool; {'add' if blurred else 'leave out'} --blurpool")
    load_model_weights(state, model, cfg.arch, classes, "--resume", path)
    if state.get("seed", cfg.seed) != cfg.seed:
        raise UsageError(f"argument --seed: {cfg.seed} is not the seed of {path} ({state['seed']}); an exact "
                         f"resume replays that seed's order and crops: pass --seed {state['seed']}")
    if "optimizer" in state:
        _load_optimizer_state(optimizer, state["optimizer"], path)
    precision.load_state_dict(state.get("precision") or {})
    if comm_hook is not None:
        note = comm_hook.load_state_dict(state.get("comm_hook"), ctx, ctx.device)
        if note:
            log.info(note)
    if "rng" in state:
        restore_rng_state(state["rng"])
    has_ema = _restore_ema(state, ema, model, path, log, evaluating=cfg.evaluate)
    best = state.get("best_acc1", 0.0)
    start = ResumePoint(
        start_epoch=int(state.get("epoch", 0)),
        best_acc1=float(best.item() if isinstance(best, torch.Tensor) else best),
        best_epoch=state.get("best_epoch"),
        step=int(state.get("step", 0)),
        images_done=int(state.get("images_done", 0)),
        partial_epoch=state.get("partial_epoch"),
        path=path,
        best_source=state.get("best_source"),
        has_ema=has_ema,
    )
    _say_where(cfg, ctx, state, start, log, global_batch, lr)
    return start


# What this run's flags set in each parameter group, and its device (fused on a GPU, foreach or not): a
# resume keeps them, not the saved groups' values (torch's load_state_dict would take those).
_RUN_GROUP_KEYS = ("weight_decay", "momentum", "nesterov", "fused", "foreach")


def _load_optimizer_state(optimizer: Optimizer, saved: dict, path: str) -> None:
    """The saved optimizer state (momentum buffers) into `optimizer`, whose
    parameter groups (common.engine.parameter_groups: --norm-weight-decay,
    --bias-weight-decay) must be the saved ones: torch matches parameters by
    their position in the groups, so another grouping would give one
    parameter's momentum to another."""
    def kinds(groups) -> list:
        return [str(group.get("group", "all")) if isinstance(group, dict) else "?" for group in groups]

    saved_kinds = kinds((saved.get("param_groups") if isinstance(saved, dict) else None) or [])
    kinds_now = kinds(optimizer.param_groups)
    if saved_kinds != kinds_now:
        raise UsageError(f"argument --resume: the optimizer state in {path} has the parameter groups "
                         f"{', '.join(saved_kinds)}, this run's are {', '.join(kinds_now)}; give the "
                         f"--norm-weight-decay and --bias-weight-decay of the checkpoint's run (given or not)")
    own = [{key: group[key] for key in _RUN_GROUP_KEYS if key in group} for group in optimizer.param_groups]
    try:
        optimizer.load_state_dict(saved)
    except (ValueError, KeyError, RuntimeError) as error:
        raise UsageError(f"argument --resume: the optimizer state in {path} does not fit this run's "
                         f"optimizer ({error_summary(error)})") from None
    for group, values in zip(optimizer.param_groups, own):
        group.update(values)


def _restore_ema(state: dict, ema: Optional[ModelEMA], model: nn.Module, path: str, log, evaluating: bool) -> bool:
    """Restore the checkpoint's --model-ema average into `ema`; whether it
    held one. Training with --model-ema from a checkpoint without one starts
    the average from its weights; one held without --model-ema is dropped.
    Each said in a line (--evaluate says only what it validates)."""
    saved = state.get("model_ema")
    if saved is not None and ema is not None:
        try:
            ema.load_state_dict(saved, lambda module, plain: _load_plain_state_dict(module, _plain_state_dict(plain)))
        except (RuntimeError, KeyError, TypeError) as error:
            raise UsageError(f"argument --resume: the model EMA in {path} does not fit this model "
                             f"({error_summary(error, line=-1)})") from None
        return True
    if saved is not None:
        log.info(f"note: {path} holds a model EMA; without --model-ema it is dropped (this run's checkpoints hold "
                 f"none)")
    elif ema is not None and not evaluating:
        ema.start_from(model)
        log.info(f"note: {path} holds no model EMA: --model-ema starts the average from its weights")
    return False


def _say_where(cfg: Config, ctx: Context, state: dict, start: ResumePoint, log, global_batch: int, lr: float) -> None:
    """resume()'s lines: where it continues, the recipe options that differ
    from the checkpoint's run, and a change of world size."""
    steps = f"{start.step} step" + ("s" if start.step != 1 else "")
    where = f"epoch {start.start_epoch}" + (f" after {steps} ({start.images_done} images)" if start.step else "")
    how = "--resume auto: continuing" if cfg.resume == "auto" else "resumed from"
    best_so_far = (f", best top-1 {start.best_acc1:.2f}% at epoch {start.best_epoch}{of_source(start.best_source)}"
                   if start.best_epoch is not None else "")
    log.info(f"{how} {start.path} ({where}{best_so_far})")
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


def of_source(source: Optional[str]) -> str:
    """' (the EMA's)' after a top-1 that --model-ema's average scored; empty for the model's."""
    return " (the EMA's)" if source == "ema" else ""


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What a checkpoint records about the run besides the training state."""

    arch: str
    config: dict
    global_batch: int
    lr: float  # the peak rate after linear scaling
    seed: int
    keep_checkpoints: int = 3

    @staticmethod
    def of(cfg: Config, global_batch: int, lr: float) -> "RunFacts":
        return RunFacts(arch=cfg.arch, config=cfg.to_dict(), global_batch=global_batch, lr=lr, seed=cfg.seed,
                        keep_checkpoints=cfg.keep_checkpoints)


class Checkpointer:
    """The checkpoints of one run: the best validation top-1 so far, where
    the newest file is, and writing a new one into the run directory (the
    primary's; the others only keep count). Every process calls save() at
    the same position, so what it keeps is the same everywhere but the path."""

    def __init__(self, model: nn.Module, optimizer: Optimizer, precision, ctx: Context, facts: RunFacts,
                 classes: List[str], start: ResumePoint, run_dir: Optional[Path],
                 check_weights: Callable[[nn.Module, str], None] = lambda model, where: None,
                 comm_hook: Optional[CommHook] = None, ema: Optional[ModelEMA] = None):
        self.model, self.optimizer, self.precision, self.ctx = model, optimizer, precision, ctx
        self.comm_hook, self.ema = comm_hook, ema
        # Raises when a weight is not finite on some process (loss_guard.LossGuard.check_weights, a collective):
        # a checkpoint is never written of weights a NaN has reached.
        self.check_weights = check_weights
        self.facts, self.classes, self.run_dir = facts, list(classes), run_dir
        self.best_acc1, self.best_epoch, self.best_source = start.best_acc1, start.best_epoch, start.best_source
        self.last_path: Optional[Path] = Path(start.path) if start.path else None  # on the primary
        # (epoch, images done) of the newest checkpoint, the same on every process; None before any.
        self._last_position = (start.start_epoch, start.images_done) if start.path else None

    def validated(self, top1: float, epoch: int, source: str = "model") -> bool:
        """Note an epoch's validation top-1 (`source`'s: "model", or "ema",
        --model-ema's average, where it scored better); whether it is the best so far."""
        is_best = top1 > self.best_acc1
        if is_best:
            self.best_acc1, self.best_epoch, self.best_source = top1, epoch, source
        return is_best

    def holds(self, epoch: int, images_done: int) -> bool:
        """Whether the newest checkpoint is already at this position (a stop
        right after a checkpoint needs none of its own)."""
        return self._last_position == (epoch, images_done)

    def save(self, epoch: int, step: int, images_done: int, partial_epoch: Optional[dict],
             is_best: bool) -> Optional[Path]:
        """Write the state at step `step` (`images_done` images) of `epoch`
        (after an epoch: the next one at step 0). The new file's path on the
        primary, None elsewhere. A write that fails (a full disk) raises
        OSError on every process (a collective: all learn it from the primary),
        and the position is not taken for saved: a stop there writes anew."""
        self.check_weights(self.model, f"the checkpoint at epoch {epoch} step {step}")
        # Every process's hook state, on the primary (a collective for PowerSGD's).
        comm_hook = self.comm_hook.state_dict(self.ctx) if self.comm_hook is not None else None
        failure = None
        if self.ctx.is_primary:
            facts = self.facts
            state = training_state(
                model=self.model, optimizer=self.optimizer, precision_state=self.precision.state_dict(), epoch=epoch,
                step=step, images_done=images_done, partial_epoch=partial_epoch, best_acc1=self.best_acc1,
                best_epoch=self.best_epoch, arch=facts.arch, classes=self.classes, config=facts.config,
                world_size=self.ctx.replicas, global_batch=facts.global_batch, lr=facts.lr, seed=facts.seed,
                comm_hook=comm_hook, model_ema=self.ema.state_dict() if self.ema is not None else None,
                best_source=self.best_source,
            )
            try:
                self.last_path = save(state, self.run_dir, is_best, keep=facts.keep_checkpoints)
            except OSError as error:
                failure = error
        if broadcast_from_primary(failure is not None, self.ctx):
            raise failure or OSError(errno.EIO, "the primary process could not write the checkpoint")
        self._last_position = (epoch, images_done)
        return self.last_path if self.ctx.is_primary else None

    def save_mid_epoch(self, epoch: int, step: int, images_done: int, partial_epoch: dict, steps: int,
                       stopping: bool, log) -> Optional[Path]:
        """The checkpoint at step `step` of `epoch`'s `steps`: its path (on the
        primary), or the previous one's when that is at this position already
        (a stop right after a checkpoint). A periodic one (not `stopping`)
        that cannot be written is a warning: training goes on."""
        if self.holds(epoch, images_done):  # decided alike on every process
            return self.last_path
        try:
            path = self.save(epoch, step, images_done, partial_epoch, is_best=False)
        except OSError as error:  # a full disk, say (every process learns it in save)
            if stopping:
                raise
            log.info(f"warning: could not write the checkpoint of epoch {epoch} step {step} ({error}); "
                     f"training goes on, and the next checkpoint tries again")
            log.write_failed("checkpoints", error.strerror or str(error), later=None)  # marked in the closing lines
            return self.last_path if self.ctx.is_primary else None
        if not stopping:
            log.info(f"checkpoint: epoch {epoch} step {step}/{steps} saved to {path}")
        return path
