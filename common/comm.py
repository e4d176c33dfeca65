"""How DistributedDataParallel communicates: the wrapper the DDP scripts put
around the model (--bucket-cap-mb, --static-graph, gradients as views of
the buckets) and the gradient communication hook (--ddp-comm-hook:
none, fp16, bf16, powersgd), whose state a checkpoint keeps.

A hook changes what crosses the network each step, not the recipe:
  none      DDP's own all-reduce of fp32 gradients (4 bytes each);
  fp16      the gradients cast to fp16 for the all-reduce (2 bytes), back to fp32 after;
  bf16      the same in bf16: fp32's range, fewer mantissa bits;
  powersgd  PowerSGD (Vogels et al., 2019): after --powersgd-start-step plain all-reduces, each
            gradient matrix is sent as two rank-r factors, with error feedback (what the
            compression left out is added to the next step's gradient). Its error feedback and
            step counter are state, per process: checkpoints keep every process's (gathered on
            the primary) so a resumed run ends as the uninterrupted one does.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from typing import Optional, Tuple

import numpy as np
import torch
from torch import nn

from common.config import Config, cuda_graph_blockers
from common.distributed import Context, broadcast_buffers_from_primary, gather_to_primary
from common.errors import UsageError
from common.models import unwrap

POWERSGD_RANK = 1  # torch's default matrix_approximation_rank
# torch's default start_powerSGD_iter: plain all-reduces first, while the gradients change fastest
# (PowerSGD's authors warm up with uncompressed steps too). At least 2: DDP's first steps rebuild buckets.
POWERSGD_START_STEP = 1000


@dataclasses.dataclass
class CommHook:
    """The hook a DDP model communicates with, and its state (PowerSGD's)."""

    name: str = "none"
    state: Optional[object] = None  # a PowerSGDState for powersgd; None for the stateless hooks
    layout: Optional["_BucketLayout"] = None  # PowerSGD's: its per-bucket state kept valid when DDP rebuckets
    # --cuda-graphs on: the side stream DDP was made on, which the step's warm-up and capture must run on too:
    # DDP keeps its parameters' AccumulateGrad nodes, and each runs on the stream current when it was made.
    stream: Optional[torch.cuda.Stream] = None

    def describe(self, bucket_cap_mb: Optional[float], static_graph: bool) -> str:
        what = {"none": "fp32 all-reduce", "fp16": "gradients all-reduced in fp16",
                "bf16": "gradients all-reduced in bf16"}.get(self.name)
        if self.name == "powersgd":
            what = (f"PowerSGD rank {self.state.matrix_approximation_rank} after "
                    f"{self.state.start_powerSGD_iter} plain steps, with error feedback")
        buckets = f"{bucket_cap_mb:g} MiB" if bucket_cap_mb else "DDP's default size (25 MiB, the first 1 MiB)"
        return (f"DDP communication: {what}; buckets of {buckets}"
                + ("; static graph" if static_graph else ""))

    def state_dict(self, ctx: Context) -> Optional[dict]:
        """What a checkpoint keeps: the hook's name and, for PowerSGD, every
        process's state in rank order (on the primary; None elsewhere). A
        collective for PowerSGD: every process must call it."""
        if self.state is None:
            return {"name": self.name, "world_size": ctx.world_size, "ranks": None} if ctx.is_primary else None
        own = {slot: _saved(getattr(self.state, slot)) for slot in self.state.__slots__ if slot not in _PER_BUCKET}
        # Per parameter, not per bucket: DDP numbers its buckets anew after a (re)start (see _BucketLayout).
        # Each piece a copy of its own: a slice would carry its whole bucket's storage into the pickle.
        own["per_parameter"] = _saved(self.layout.per_parameter()) if self.layout is not None else {}
        ranks = gather_to_primary(own, ctx)
        return {"name": self.name, "world_size": ctx.world_size, "ranks": ranks} if ctx.is_primary else None

    def load_state_dict(self, saved: Optional[dict], ctx: Context, device: torch.device) -> Optional[str]:
        """Take this process's state from a checkpoint's; a note to print when
        it cannot (another hook, another number of processes), else None."""
        if self.state is None:
            return None
        if not saved or saved.get("name") != self.name or not saved.get("ranks"):
            was = saved.get("name") if saved else "none"
            return f"note: the checkpoint's run used --ddp-comm-hook {was}: PowerSGD starts afresh here"
        notes = []
        if saved["world_size"] != ctx.world_size:
            # Error feedback is each process's own residue: W processes' cannot be dealt to W' processes.
            # The factors' warm start and the step counter are the same on every process: kept.
            mine = dict(saved["ranks"][0], per_parameter={name: {"q": parts["q"]} for name, parts in
                                                          saved["ranks"][0]["per_parameter"].items() if "q" in parts})
            notes.append(f"its state is of {saved['world_size']} processes and this run has {ctx.world_size}: its "
                         f"step counter and factors are kept, its error feedback starts afresh")
        else:
            mine = saved["ranks"][ctx.rank]
        mine = _restored(mine, device)
        per_parameter = mine.pop("per_parameter", {})
        if mine.get("matrix_approximation_rank") != self.state.matrix_approximation_rank:
            # Factors of another rank do not fit this run's (--powersgd-rank, as given now, wins).
            per_parameter = {name: {"error": parts["error"]} for name, parts in per_parameter.items()
                             if "error" in parts}
            notes.append(f"its factors are of rank {mine.get('matrix_approximation_rank')} and this run's of "
                         f"{self.state.matrix_approximation_rank}: new factors are drawn")
        unknown = set(per_parameter) - set(self.layout.shapes if self.layout is not None else ())
        if unknown:  # another model's state: nothing of it can be used
            per_parameter = {}
            notes.append(f"it names parameters this model lacks ({sorted(unknown)[0]}, ...): it starts afresh")
        for slot in _RESUMED:  # the flags of this run (rank, start step, ...) stay as given
            if slot in mine:
                setattr(self.state, slot, mine[slot])
        if self.layout is not None:
            self.layout.restart(per_parameter)
        return f"note: PowerSGD's checkpointed state: {'; '.join(notes)}" if notes else None


# PowerSGDState's dicts keyed by DDP's bucket index, which a checkpoint keeps per parameter instead.
_PER_BUCKET = ("process_group", "error_dict", "p_memory_dict", "q_memory_dict")
# What a resume takes back of PowerSGDState besides them: where it stands, not how it was configured.
_RESUMED = ("iter", "rng", "total_numel_before_compression", "total_numel_after_compression", "next_stats_report")


class _BucketLayout:
    """PowerSGD's hook, with its state kept per parameter across DDP's
    changes of buckets. PowerSGDState keys its error feedback and its warm
    start factors (Q) by bucket index, but DDP puts every parameter in one
    bucket for the first step after each start and regroups them by the
    order their gradients came in after it: after a resume, the state saved
    for bucket i would meet another bucket i. PowerSGD's arithmetic is per
    tensor (each matrix compressed alone, everything else all-reduced
    element by element), so the state can be cut per parameter and put
    together again for whatever buckets come: this does that whenever the
    parameters of a bucket index change, before the hook sees the bucket."""

    def __init__(self, hook, state, model: nn.Module):
        self.hook, self.state = hook, state
        # The plain model's names (models.unwrap): the same with or without --compile's wrapper.
        named = list(unwrap(model).named_parameters())
        self.names = {id(parameter): name for name, parameter in named}
        self.shapes = {name: tuple(parameter.shape) for name, parameter in named}
        self.bucket_names: dict = {}  # bucket index -> the parameter names the state's entries are laid out for
        self.pending: dict = {}  # name -> {"error": flat tensor, "q": flat tensor}, waiting for a bucket

    def __call__(self, state, bucket):
        names = tuple(self.names[id(parameter)] for parameter in bucket.parameters())
        index = bucket.index()
        if self.bucket_names.get(index) != names:
            if index in self.bucket_names:  # DDP regrouped: every bucket's entries go back to per parameter
                self.restart(self.per_parameter())
            self._lay_out(index, names, bucket.buffer())
        return self.hook(state, bucket)

    def restart(self, per_parameter: dict) -> None:
        """Forget the buckets; their state waits per parameter for the next ones."""
        self.pending = per_parameter
        self.bucket_names = {}
        for entries in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict):
            entries.clear()

    def _compressed(self, names) -> list:
        """The bucket's parameters whose gradients PowerSGD compresses, in
        the order it lays their factors out (grouped by shape, first seen first)."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

        by_shape: dict = {}
        for name in names:
            shape = self.shapes[name]
            rows, columns = shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1
            rank = min(rows, columns, self.state.matrix_approximation_rank)
            if _should_compress(rows, columns, rank, self.state.min_compression_rate)[0]:
                by_shape.setdefault((rows, columns), []).append((name, columns * rank, rows * rank))
        return [entry for entries in by_shape.values() for entry in entries]

    def _lay_out(self, index: int, names, buffer: torch.Tensor) -> None:
        self.bucket_names[index] = names
        pieces = [self.pending.pop(name, {}) for name in names]
        if any("error" in piece for piece in pieces):
            self.state.error_dict[index] = torch.cat([
                piece["error"] if "error" in piece else buffer.new_zeros(math.prod(self.shapes[name]))
                for name, piece in zip(names, pieces)])
        pieces = dict(zip(names, pieces))
        compressed = self._compressed(names)
        if compressed and all("q" in pieces[name] for name, _, _ in compressed):  # else PowerSGD draws new ones
            self.state.q_memory_dict[index] = torch.cat([pieces[name]["q"] for name, _, _ in compressed])
            self.state.p_memory_dict[index] = buffer.new_empty(sum(size for _, _, size in compressed))

    def per_parameter(self) -> dict:
        """The state of every bucket laid out so far, cut per parameter (with
        what still waits for a bucket)."""
        cut = {name: dict(parts) for name, parts in self.pending.items()}
        for index, names in self.bucket_names.items():
            if index in self.state.error_dict:
                offset = 0
                for name in names:
                    size = math.prod(self.shapes[name])
                    cut.setdefault(name, {})["error"] = self.state.error_dict[index][offset:offset + size]
                    offset += size
            if index in self.state.q_memory_dict:
                offset = 0
                for name, size, _ in self._compressed(names):
                    cut.setdefault(name, {})["q"] = self.state.q_memory_dict[index][offset:offset + size]
                    offset += size
        return cut


# A checkpoint holds plain types and tensors only (common.checkpoint loads with weights_only): PowerSGD's
# NumPy generator, which draws its first factors, travels as its state, tagged.
_NUMPY_GENERATOR = "numpy.random.RandomState"


def _saved(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {key: _saved(item) for key, item in value.items()}
    if isinstance(value, np.random.RandomState):
        name, keys, position, has_gauss, cached_gaussian = value.get_state()
        return {_NUMPY_GENERATOR: [name, keys.tolist(), position, has_gauss, cached_gaussian]}
    return value


def _restored(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict) and _NUMPY_GENERATOR in value:
        name, keys, position, has_gauss, cached_gaussian = value[_NUMPY_GENERATOR]
        generator = np.random.RandomState()
        generator.set_state((name, np.array(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))
        return generator
    if isinstance(value, dict):
        return {key: _restored(item, device) for key, item in value.items()}
    return value


def distributed_model(model: nn.Module, cfg: Config, ctx: Context) -> Tuple[nn.Module, CommHook]:
    """`model` in DistributedDataParallel with the run's communication
    options, and the hook it communicates with."""
    if cfg.ddp_comm_hook != "none" and ctx.world_size == 1:
        raise UsageError(f"argument --ddp-comm-hook: {cfg.ddp_comm_hook} changes what processes exchange, and "
                         f"this run has one process (use imagenet_nd.py, or start more processes)")
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # Gradients as views into the buckets: no copy into them before each all-reduce, and one copy less in
    # memory (the gradients' size: 100 MB for ResNet-50). Static graph: the same parameters get gradients
    # every step, which lets DDP skip its per-step search for unused ones.
    # --bucket-cap-mb only when given: DDP's own default keeps a small first bucket, which any size given drops.
    size = {"bucket_cap_mb": cfg.bucket_cap_mb} if cfg.bucket_cap_mb else {}
    options = fewer_copies(inspect.signature(nn.parallel.DistributedDataParallel).parameters,
                           on_gpu=ctx.device.type == "cuda")
    # --cuda-graphs on: torch's CUDA-graph notes ask DDP to be made on a side stream for its backward to be
    # captured. Only where the step will be: eager steps run on the default stream, and a DDP made on another
    # has each gradient of each step cross streams (torch warns of AccumulateGrad's stream mismatch and syncs).
    captured = cfg.cuda_graphs == "on" and ctx.device.type == "cuda" and not cuda_graph_blockers(cfg)
    side_stream = torch.cuda.Stream(ctx.device) if captured else None
    with torch.cuda.stream(side_stream) if side_stream is not None else contextlib.nullcontext():
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True,
                                                  static_graph=cfg.static_graph, **size, **options)
    if side_stream is not None:  # its constructor copied rank 0's weights in on that stream, without a wait
        torch.cuda.current_stream(ctx.device).wait_stream(side_stream)
    if options.get("broadcast_buffers") is False:  # a torch before 2.14: that also left out the buffers' first sync
        broadcast_buffers_from_primary(model, ctx)
    hook = CommHook(cfg.ddp_comm_hook, stream=side_stream)
    if cfg.ddp_comm_hook in ("fp16", "bf16") and ctx.backend == "gloo":
        ddp.register_comm_hook(None, _cast_in_this_thread(cfg.ddp_comm_hook))
    elif cfg.ddp_comm_hook in ("fp16", "bf16"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, getattr(default_hooks, f"{cfg.ddp_comm_hook}_compress_hook"))
    elif cfg.ddp_comm_hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        hook.state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=cfg.powersgd_rank or POWERSGD_RANK,
            start_powerSGD_iter=cfg.powersgd_start_step or POWERSGD_START_STEP, use_error_feedback=True,
            warm_start=True, random_seed=cfg.seed,
            # torch's default 0 divides by a zero norm when a layer's gradient is zero (a dead ReLU's
            # weights; seen here as a NaN loss on the next step): the PowerSGD authors' 1e-8.
            orthogonalization_epsilon=1e-8)
        in_order = _one_bucket_at_a_time(powerSGD_hook.powerSGD_hook) if ctx.backend == "gloo" else \
            powerSGD_hook.powerSGD_hook
        layout = hook.layout = _BucketLayout(in_order, hook.state, model)

        def powersgd_hook(state, bucket):  # a function: DDP logs hooks by their names
            return layout(state, bucket)

        ddp.register_comm_hook(hook.state, powersgd_hook)
    return ddp, hook


def fewer_copies(ddp_parameters, on_gpu: bool) -> dict:
    """DDP's options that take per-tensor copies out of each step, as far as
    this torch's DDP (`ddp_parameters`: its signature's) has them. Counted on
    the CPU (ResNet-50, one process, docs/performance.md): of a step's 689
    copies, 159 were DDP's broadcast of the buffers before each forward
    pass, and DDP brought each of the 161 gradients into its bucket by a
    multiply of its own.

    Buffers are synced once, when DDP wraps the model, and not again before
    every forward pass: that broadcast only overwrote the other processes'
    BatchNorm statistics with the primary's, and the primary's own are the
    same either way (copied onto themselves), as are every process's weights
    (BatchNorm normalises a training batch by its own statistics). The
    primary's are the ones saved, and validation takes them first
    (common.engine's _validated_model). torch 2.14 calls the option
    forward_sync_buffers; the older broadcast_buffers=False also skips the
    first sync, which distributed_model then does itself.

    batched_grad_copy (torch 2.14), on GPUs only: a bucket's gradients
    copied in by one _foreach_copy_ and divided by the number of processes
    once, not one multiply (a kernel launch) per gradient: for a step whose
    host is the bottleneck (the H200's, RESULTS.md). It costs a second pass
    over the gradients' memory (ResNet-50's: 100 MB), not yet measured on a
    GPU; the CPU, which has no launches to save, took 193-203 ms a step with
    it instead of 173-176 (ResNet-50, batch 2 at 64 px, 2-core Xeon). Bitwise the
    same weights where the process count is a power of two (one process
    included): 1/W is exact there; elsewhere g / W instead of g * (1/W),
    within one rounding of it."""
    options = {"forward_sync_buffers": False} if "forward_sync_buffers" in ddp_parameters else \
        {"broadcast_buffers": False}
    if on_gpu and "batched_grad_copy" in ddp_parameters:
        options["batched_grad_copy"] = True
    return options


def _cast_in_this_thread(hook_name: str):
    """torch's fp16/bf16 compress hook (cast, all-reduce, cast back into the
    bucket), with the cast back done here rather than in a callback: with
    gloo a callback runs on gloo's own thread, and CPU tensor work there, in
    a process that later forks its data-loading workers, is a hang waiting to
    happen (one validation in CI hung once after such a run, not reproduced
    here). On the CPU there is no overlap to lose. `hook_name`: fp16 or bf16."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[hook_name]

    def compress_hook(process_group, bucket):
        group = process_group if process_group is not None else torch.distributed.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(group.size())
        torch.distributed.all_reduce(compressed, group=group)
        buffer.copy_(compressed)
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    compress_hook.__name__ = f"{hook_name}_compress_hook_in_this_thread"
    return compress_hook


def _one_bucket_at_a_time(hook):
    """`hook`, finished before the next bucket's starts. PowerSGD issues its
    second and third all-reduces of a bucket from callbacks of the first;
    with gloo those callbacks run on gloo's own threads, so two buckets'
    all-reduces can reach the processes in different orders, and gloo stops
    the job ("Received data size doesn't match expected size"; torch's
    own PowerSGD tests skip gloo). Waiting inside the hook keeps the order,
    at the cost of overlap: fine for gloo, the CPU backend. With NCCL the
    callbacks run in order as the work is queued, and the hook is used as is."""
    def hook_in_order(state, bucket):
        result = hook(state, bucket).wait()
        done = torch.futures.Future()
        done.set_result(result)
        return done

    return hook_in_order
