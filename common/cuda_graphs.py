"""--cuda-graphs: the training step captured in one CUDA graph and replayed
each step over static input buffers, so the host launches one graph instead
of the forward pass's, the backward pass's and the optimizer's kernels one
by one (ResNet-50 O2 on an H200 spent 63 ms of host time launching a 43 ms
step: RESULTS.md, 2026-11-26).

What the captured step is: common.engine.Trainer's eager step, the same
calls in the same order (forward and loss under the precision policy's
autocast, then its backward_and_step: zero_grad, the scaled backward, the
GradScaler's unscale and inf check, --clip-grad-norm, SGD, the scale's
update) plus the LossGuard's NaN/inf flags (loss_guard.nonfinite_flags). It
has no host synchronisation: the learning rate is a device tensor written
before each replay (the schedule's rate, every step, as eager); SGD is
torch's fused SGD, which takes the GradScaler's scale and found_inf on the
device and leaves the weights and momentum as they were on a skipped step;
its momentum buffers are made (zeros) before the first step, since fused SGD
leaves them uninitialised when that first step is skipped (zeros give the
first step's buffer = gradient, as torch's first step does); the skip count
is added up in place (precision.MixedPrecision.step); the LossGuard reads
the flags a step late, as it does in eager steps.

The first WARMUP_STEPS steps of a shape (DDP_WARMUP_STEPS under DDP) run
eagerly on a side stream, as torch's CUDA-graph notes ask: cuDNN's and
cuBLAS's per-stream workspaces, the scaler's scale and DDP's buckets (rebuilt
after its first iteration; torch's notes ask 11 eager iterations of DDP)
are made before the capture. The next step of that shape is captured and
replayed; a batch of another shape (a progressive-resizing epoch's crop,
any short batch) runs eagerly, and a shape that lasts WARMUP_STEPS steps is
captured in place of the old one. Validation always runs eagerly. A
capture that fails (something in a model's step waits for the host) leaves
every later step eager, said once; under DDP it ends the run instead (one
line, exit status 2), since DDP's reducer stopped mid-backward and every
process must take one path.

Why torch.cuda.graph around the whole step (torch 2.14's sources read):
make_graphed_callables graphs a callable's forward and backward only (the
optimizer and the scaler stay eager, autocast's cache must be off, and it
refuses modules with hooks, which DDP registers); torch.compile's
mode="reduce-overhead" graphs what it compiles (the model; DDP splits it at
its buckets), takes minutes to compile here (--compile) and runs
the optimizer eagerly unless that is compiled too. Torch's own pieces used:
fused SGD's grad_scale/found_inf arguments and its tensor rate (what the
GradScaler gives an optimizer that declares _step_supports_amp_scaling),
torch._amp_update_scale_ inside GradScaler.update, and the CUDA
generator's graph-safe state (a replay starts from the generator's seed and
offset of the moment, so engine.seed_generators' reseed before each step
gives dropout the eager step's draws; read in CUDAGeneratorImpl.h, not yet
seen on a GPU).

What cannot be captured trains eagerly, said once at the start (choose):
the CPU, --accum-steps > 1, MixUp/CutMix, --model-ema,
--max-nonfinite-steps > 0, DataParallel, --compile, a --ddp-comm-hook,
--sync-bn. `auto` is eager until run_scripts/gpu_check.sh has measured
graphs on a GPU against eager steps (nothing has been yet).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Callable, NamedTuple, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from common.config import Config, cuda_graph_blockers
from common.errors import UsageError, error_summary
from common.files import format_bytes
from common.loss_guard import nonfinite_flags

WARMUP_STEPS = 3  # eager steps of a shape before its capture (torch's whole-network example warms up 3)
DDP_WARMUP_STEPS = 11  # under DDP: torch's CUDA-graph notes ask for at least 11 eager DDP iterations first


@dataclasses.dataclass(frozen=True)
class GraphChoice:
    """Whether this run captures its training step, and the line that says why (None: nothing to say)."""

    capture: bool
    note: Optional[str]
    warmup_steps: int = WARMUP_STEPS


def choose(cfg: Config, device: torch.device, model: nn.Module) -> GraphChoice:
    """--cuda-graphs (cfg.cuda_graphs) for a run on `device` with `model` as the script wrapped it; `on` on
    the CPU is a UsageError. What of the options keeps the step eager: config.cuda_graph_blockers, which
    common.comm reads too."""
    if cfg.cuda_graphs == "on" and device.type != "cuda":
        raise UsageError("argument --cuda-graphs: on needs a CUDA GPU, and this process trains on the CPU "
                         "(use auto or off)")
    if cfg.cuda_graphs == "off" or device.type != "cuda":
        return GraphChoice(False, None)
    if cfg.cuda_graphs == "auto":
        return GraphChoice(False, "cuda graphs: off (--cuda-graphs auto stays eager until run_scripts/gpu_check.sh "
                                  "has measured graphs on a GPU; --cuda-graphs on captures the training step)")
    blockers = (("DataParallel (it scatters each batch from the host)",) if isinstance(model, nn.DataParallel)
                else ()) + cuda_graph_blockers(cfg)
    if blockers:
        return GraphChoice(False, "--cuda-graphs on: every training step eager, for " + "; ".join(blockers))
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    warmup = DDP_WARMUP_STEPS if ddp else WARMUP_STEPS
    return GraphChoice(True, f"--cuda-graphs on: the training step captured in a CUDA graph after {warmup} eager "
                             f"steps{' (DDP)' if ddp else ''}, then replayed; a batch of another shape and "
                             f"validation run eagerly", warmup)


class StepOutputs(NamedTuple):
    """What a step leaves for the loop: its loss and logits (for the metric
    sums) and its NaN/inf flags (for the LossGuard). A replay's are the
    graph's static tensors, rewritten by the next replay: read them, on the
    device, before it."""

    loss: torch.Tensor
    logits: torch.Tensor
    flags: torch.Tensor


class CudaGraph:
    """`body` captured once in a torch.cuda.CUDAGraph on `stream` (the
    capture runs nothing); `replay()` runs it on the current stream and
    returns the tensors the capture returned. thread_local: other threads'
    CUDA calls during the capture (the DataLoader's pinning thread, NCCL's
    watchdog) are theirs, not an error of this capture."""

    def __init__(self, body: Callable[[], StepOutputs], stream: Optional[torch.cuda.Stream]):
        self.graph = torch.cuda.CUDAGraph()
        previous = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
                self.outputs = body()
        except RuntimeError:
            # What a failed capture leaves (torch 2.14's graphs.py and CUDAGraph.h read; not yet seen on a GPU):
            # torch.cuda.graph's stream current, when capture_end threw before its exit; and the graph's private
            # memory pool held, the allocator perhaps still routing to it, and the CUDA generator's state of
            # this capture, until the graph is reset: now, not when the error's traceback lets it go.
            torch.cuda.set_stream(previous)
            self.graph.reset()
            self.graph = None
            raise

    def replay(self) -> StepOutputs:
        self.graph.replay()
        return self.outputs


class GraphedStep:
    """The training step over static buffers: eager for a shape's first
    `warmup_steps` steps, then captured by `capture_with` (CudaGraph; tests
    give a stand-in that runs on the CPU) and replayed. `warmup_steps` None:
    never captured (every step eager, the same function). `say`: the
    primary's log, for the capture's cost. `stream`: the side stream the
    warm-up and capture run on (DDP's: the one it was made on); None: one
    of its own on a GPU."""

    def __init__(self, model: nn.Module, criterion: nn.Module, optimizer: Optimizer, precision,
                 device: torch.device, warmup_steps: Optional[int] = WARMUP_STEPS,
                 say: Callable[[str], None] = print, capture_with: Callable = CudaGraph,
                 stream: Optional[torch.cuda.Stream] = None):
        self.model, self.criterion, self.optimizer, self.precision = model, criterion, optimizer, precision
        self.device = device
        self.warmup_steps = math.inf if warmup_steps is None else warmup_steps
        self.say = say
        self.capture_with = capture_with
        self.ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        self.lr = torch.zeros((), dtype=torch.float32, device=device)  # the rate the captured SGD reads
        if stream is None and device.type == "cuda":
            stream = torch.cuda.Stream(device)
        self.stream = stream  # warm-up and capture
        self.graph = None  # the captured step, for batches of `shape`
        self.shape = None
        self.static_images = self.static_target = None
        self._eager_run = (None, 0)  # (shape, eager steps of it in a row) since the last replay
        self._optimizer_ready = False

    def __call__(self, images: torch.Tensor, target: torch.Tensor, lr: float, where: str = "") -> StepOutputs:
        """One training step on this batch at rate `lr` (`where`: the step, for the capture's line)."""
        self._prepare_optimizer()
        self.lr.fill_(lr)
        shape = _shape_of(images, target)
        if self.graph is not None and shape == self.shape:
            self._eager_run = (None, 0)
            self.static_images.copy_(images)
            self.static_target.copy_(target)
            return self.graph.replay()
        steps = self._eager_run[1] + 1 if self._eager_run[0] == shape else 1
        self._eager_run = (shape, steps)
        if steps > self.warmup_steps:
            return self._capture(images, target, shape, where)
        return self._on_side_stream(lambda: self.body(images, target))

    def body(self, images: torch.Tensor, target: torch.Tensor) -> StepOutputs:
        """The step itself: the eager step's calls, none of which waits for the device."""
        with self._rate_on_device():
            with self.precision.autocast():
                logits = self.model(images)
                loss = self.criterion(logits, target)
            self.precision.backward_and_step(loss, self.optimizer)
        return StepOutputs(loss.detach(), logits.detach(), nonfinite_flags(loss))

    def _capture(self, images: torch.Tensor, target: torch.Tensor, shape: tuple, where: str) -> StepOutputs:
        """Capture the step for `shape` (dropping an earlier graph first) and replay it for this batch."""
        self.graph = self.static_images = self.static_target = None
        self.optimizer.zero_grad(set_to_none=True)  # the capture's backward makes them, in the graph's memory
        reserved_before, started = _settled_reserved_bytes(self.device, release_cached=True), time.perf_counter()
        self.static_images, self.static_target = images.clone(), target.clone()  # strides kept: channels-last too
        failure = None
        try:
            self.graph = self.capture_with(lambda: self.body(self.static_images, self.static_target), self.stream)
        except RuntimeError as error:
            if self.ddp:  # its reducer stopped mid-backward, and every process must take the same path: no going on
                raise UsageError(f"argument --cuda-graphs: on: the training step could not be captured under DDP "
                                 f"({error_summary(error)}); run with --cuda-graphs off") from None
            failure = error_summary(error)
        if failure is not None:  # out of the except: the error's traceback, and the capture's tensors it holds, gone
            return self._eager_for_good(images, target, failure)
        self.shape = shape
        outputs = self.graph.replay()
        reserved_after, seconds = _settled_reserved_bytes(self.device), time.perf_counter() - started
        self._eager_run = (None, 0)
        memory = (f"; {format_bytes(max(0, reserved_after - reserved_before))} more GPU memory reserved"
                  if self.device.type == "cuda" else "")
        self.say(f"cuda graphs: training step captured{f' at {where}' if where else ''} for batches of "
                 f"{'x'.join(map(str, images.shape))} in {seconds:.2f} s (capture and first replay){memory}")
        return outputs

    def _eager_for_good(self, images: torch.Tensor, target: torch.Tensor, failure: str) -> StepOutputs:
        """After a capture that failed (something in the step waits for the host, or is not capturable; `failure`
        says what): what the capture began dropped (gradients, the scaler's record and what it handed the
        optimizer), the memory it took handed back, this step and every later one eager, said once. The capture
        ran nothing, so the weights, momentum and scale are as they were."""
        self.graph = self.static_images = self.static_target = None
        self.warmup_steps = math.inf
        self.optimizer.zero_grad(set_to_none=True)
        self.precision.forget_step(self.optimizer)
        _settle(self.device, release_cached=True)  # the failed graph's pool, its last tensors dropped above
        self.say(f"cuda graphs: the training step could not be captured ({failure}); every training "
                 f"step eager from here")
        return self._on_side_stream(lambda: self.body(images, target))

    def _on_side_stream(self, run: Callable[[], StepOutputs]) -> StepOutputs:
        """`run` on the warm-up stream (the capture's), ordered after the work queued before it and before
        the work queued after it; on the CPU, as it comes."""
        if self.stream is None:
            return run()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            outputs = run()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return outputs

    @contextlib.contextmanager
    def _rate_on_device(self):
        """SGD reads the rate from self.lr during the step; the groups keep a float otherwise (checkpoints,
        set_lr, the logs)."""
        rates = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        try:
            yield
        finally:
            for group, rate in zip(self.optimizer.param_groups, rates):
                group["lr"] = rate

    def _prepare_optimizer(self) -> None:
        """Fused SGD (the scaler's skip decided on the device), its momentum buffers made now (after a
        resume loaded any): once."""
        if self._optimizer_ready:
            return
        self._optimizer_ready = True
        # What torch's SGD(fused=True) sets itself: GradScaler.step then hands it the scale and found_inf on the
        # device. Without it (the foreach SGD engine.sgd makes under fp16 loss scaling, made fused here) the
        # scaler reads found_inf on the host (.item()), which a capture refuses.
        self.optimizer._step_supports_amp_scaling = True
        for group in self.optimizer.param_groups:
            group["fused"], group["foreach"] = True, False
            if not group["momentum"]:
                continue
            for parameter in group["params"]:
                state = self.optimizer.state[parameter]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)


def _shape_of(images: torch.Tensor, target: torch.Tensor) -> tuple:
    """What a graph is captured for: the batch's shapes, types and layout."""
    return tuple(images.shape), images.dtype, images.stride(), tuple(target.shape), target.dtype


def _settle(device: torch.device, release_cached: bool = False) -> None:
    """Wait until the device is idle (a host sync); `release_cached`: then hand the CUDA caching allocator's
    unused blocks back (torch.cuda.graph does too as it starts). Nothing on the CPU."""
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    if release_cached:
        torch.cuda.empty_cache()


def _settled_reserved_bytes(device: torch.device, release_cached: bool = False) -> int:
    """The CUDA caching allocator's reserved bytes once the device is idle (_settle: once per capture), so that
    with `release_cached` the capture's cost is what it adds to what the tensors alive hold."""
    if device.type != "cuda":
        return 0
    _settle(device, release_cached)
    return torch.cuda.memory_reserved(device)
