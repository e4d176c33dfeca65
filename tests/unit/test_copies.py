"""Issue 41: the per-tensor copies of a DDP training step (docs/performance.md),
counted by torch.profiler on the CPU: DDP's options of common.comm.fewer_copies
take out the buffers' broadcast before every forward pass and, on GPUs, the
gradients' copies into the buckets one by one (checked here on the CPU with
the GPU's options), and train the same weights bitwise."""
from __future__ import annotations

import collections
import types
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from common import comm
from common.distributed import Context
from common.engine import sgd
from common.models import build_model
from common.precision import build_policy
from helpers import free_port

CPU = torch.device("cpu")
ACCUMULATE_GRAD = "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"
# What DDP's reducer does per gradient to bring it into its bucket: multiply by 1 / processes (no hook), copy (a hook).
ONE_GRADIENT_AT_A_TIME = ("torch::distributed::reducer::mul_out", "aten::copy_", "aten::mul")
RESNET18_TENSORS = (62, 60)  # parameters; buffers (20 BatchNorm layers: mean, variance, batches counted)


def _config(hook: str = "none") -> types.SimpleNamespace:
    """The fields of Config that comm.distributed_model reads; PowerSGD compresses from its 2nd step."""
    return types.SimpleNamespace(ddp_comm_hook=hook, bucket_cap_mb=None, static_graph=False, cuda_graphs="off",
                                 powersgd_rank=None, powersgd_start_step=2, seed=0)


def _batches(seed: int, steps: int, size: int = 32, batch: int = 4) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, size, size, generator=generator),
             torch.randint(0, 10, (batch,), generator=generator)) for _ in range(steps)]


def _train(ctx: Context, batches: list, hook: str = "none", accum_steps: int = 1, profiled_steps: int = 0,
           arch: str = "resnet18", amp_dtype: str = "bf16"):
    """`arch` in comm.distributed_model, O2 and SGD with momentum as the
    Trainer runs them (foreach; channels-last on a GPU), trained on
    `batches` (groups of `accum_steps` micro-batches, the first ones under
    no_sync); its weights and buffers, and the copies per step counted over
    the last `profiled_steps` (the profile too)."""
    torch.manual_seed(ctx.rank)  # a different start on each process: DDP's first sync makes them the primary's
    policy = build_policy("O2", amp_dtype, ctx.device)
    layout = torch.channels_last if policy.channels_last else torch.contiguous_format
    model = build_model(arch, 10, image_size=batches[0][0].shape[-1]).to(ctx.device, memory_format=layout)
    ddp, _ = comm.distributed_model(model, _config(hook), ctx)
    optimizer = sgd(ddp, 0.005, 0.9, 1e-4, loss_scaling=policy.scales_loss)
    steps = [[(images.to(ctx.device, memory_format=layout), target.to(ctx.device)) for images, target in
              batches[start:start + accum_steps]] for start in range(0, len(batches), accum_steps)]

    def step(micro):
        if accum_steps > 1:  # as the Trainer does (backward_and_step does it for one micro-batch)
            optimizer.zero_grad(set_to_none=True)
        for images, target in micro[:-1]:
            with ddp.no_sync():
                with policy.autocast():
                    loss = nn.functional.cross_entropy(ddp(images), target)
                policy.backward(loss / accum_steps)
        images, target = micro[-1]
        with policy.autocast():
            loss = nn.functional.cross_entropy(ddp(images), target)
        if accum_steps == 1:
            policy.backward_and_step(loss, optimizer)
        else:
            policy.backward(loss / accum_steps)
            policy.step(optimizer)

    for micro in steps[:len(steps) - profiled_steps]:
        step(micro)
    on_gpu = ctx.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * on_gpu) as profiled:
        for micro in steps[len(steps) - profiled_steps:]:
            step(micro)
        if on_gpu:
            torch.cuda.synchronize(ctx.device)
    weights = [tensor.detach().clone() for tensor in (*model.parameters(), *model.buffers())]
    return weights, _copies_per_step(profiled.events(), profiled_steps), profiled


def _copies_per_step(events, steps: int) -> dict:
    counts = collections.Counter()
    for event in events:
        parent = event.cpu_parent.name if event.cpu_parent is not None else ""
        if event.name == "aten::copy_" and parent == "DistributedDataParallel.forward":
            counts["buffer broadcast"] += 1  # each buffer copied back from the broadcast's flat tensor
        elif parent == ACCUMULATE_GRAD and event.name in ONE_GRADIENT_AT_A_TIME:
            counts["gradients into buckets, one by one"] += 1
        elif parent == ACCUMULATE_GRAD and event.name == "aten::_foreach_copy_":
            counts["gradients into buckets, a bucket at a time"] += 1
    return {name: count / steps for name, count in counts.items()} if steps else {}


@pytest.fixture
def one_process(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield Context(rank=0, local_rank=0, world_size=1, device=CPU, backend="gloo")
    finally:
        dist.destroy_process_group()


def _as_before(parameters, on_gpu: bool) -> dict:
    """DDP's options before issue 41: buffers broadcast before every forward pass, gradients copied one by one."""
    return {}


FEWER_COPIES = comm.fewer_copies  # the function itself, which the tests below patch over in comm


def _as_on_a_gpu(parameters, on_gpu: bool) -> dict:
    """The options a GPU run takes, here on the CPU."""
    return FEWER_COPIES(parameters, on_gpu=True)


def test_a_ddp_step_copies_no_buffer_and_on_a_gpu_the_gradients_a_bucket_at_a_time(one_process):
    """ResNet-18, one process: before, each step copied its 60 buffers back
    from DDP's broadcast and multiplied its 62 gradients into the buckets one
    at a time; now no buffer, and with a GPU's options the gradients a
    bucket at a time. The weights and buffers after 3 steps (the last
    profiled) are bitwise those of DDP's options as they were, either way."""
    batches = _batches(seed=1, steps=3)
    weights, copies, _ = _train(one_process, batches, profiled_steps=1)
    with mock.patch.object(comm, "fewer_copies", _as_on_a_gpu):
        gpu_weights, gpu_copies, _ = _train(one_process, batches, profiled_steps=1)
    with mock.patch.object(comm, "fewer_copies", _as_before):
        before_weights, before, _ = _train(one_process, batches, profiled_steps=1)
    parameters, buffers = RESNET18_TENSORS
    assert before == {"buffer broadcast": buffers, "gradients into buckets, one by one": parameters}
    assert copies == {"gradients into buckets, one by one": parameters}  # the CPU has no launches to save
    # DDP's default buckets for ResNet-18's 45 MB of gradients: 1 MiB first, then 25 MiB: 3 buckets.
    assert gpu_copies == {"gradients into buckets, a bucket at a time": 3}
    assert len(weights) == parameters + buffers
    for trained in (weights, gpu_weights):
        assert all(torch.equal(after, was) for after, was in zip(trained, before_weights))


def test_the_options_follow_the_torch_at_hand():
    """torch 2.14 names the forward pass's buffer sync forward_sync_buffers and
    has batched_grad_copy (taken on GPUs); an older torch has only
    broadcast_buffers (whose False also skips the first sync, which
    distributed_model then does)."""
    torch_2_14 = {"broadcast_buffers": None, "forward_sync_buffers": None, "batched_grad_copy": None}
    assert comm.fewer_copies(torch_2_14, on_gpu=True) == {"forward_sync_buffers": False, "batched_grad_copy": True}
    assert comm.fewer_copies(torch_2_14, on_gpu=False) == {"forward_sync_buffers": False}
    assert comm.fewer_copies({"broadcast_buffers": None}, on_gpu=True) == {"broadcast_buffers": False}


def _two_processes(rank: int, port: int, hook: str, accum_steps: int, out_dir) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    ctx = Context(rank=rank, local_rank=rank, world_size=2, device=CPU, backend="gloo")
    batches = _batches(seed=10 + rank, steps=4 * accum_steps)
    with mock.patch.object(comm, "fewer_copies", _as_on_a_gpu):
        weights, copies, _ = _train(ctx, batches, hook, accum_steps, profiled_steps=2)
    with mock.patch.object(comm, "fewer_copies", _as_before):
        before, _, _ = _train(ctx, batches, hook, accum_steps)
    # An older torch's broadcast_buffers=False: the buffers still start as the primary's.
    with mock.patch.object(comm, "fewer_copies", lambda parameters, on_gpu: {"broadcast_buffers": False}), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.14's word on broadcast_buffers, the older torch's own
        model = build_model("resnet18", 10, image_size=32)
        for buffer in model.buffers():
            buffer.fill_(rank + 1)
        comm.distributed_model(model, _config(), ctx)
        first_buffers = {int(buffer.flatten()[0]) for buffer in model.buffers()}
    parameters = RESNET18_TENSORS[0]
    same = [all(torch.equal(after, was) for after, was in zip(part, part_before))
            for part, part_before in ((weights[:parameters], before[:parameters]),
                                      (weights[parameters:], before[parameters:]))]
    torch.save({"same": same, "copies": copies, "first_buffers": first_buffers}, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
# Not PowerSGD: its first run in a process differs from the later ones (by 1.5e-8, whichever DDP options; torch
# 2.14), which are bitwise alike, these options or not (docs/performance.md).
@pytest.mark.parametrize("hook, accum_steps", [("none", 1), ("none", 2), ("fp16", 1)])
def test_two_processes_train_as_with_the_options_before(tmp_path, hook, accum_steps):
    """Two processes (gloo) with a GPU's options, with DDP's all-reduce, the
    fp16 hook and --accum-steps 2 (DDP's no_sync): every process's weights, and the
    primary's buffers, after 4 steps are bitwise those of DDP's options as
    they were (1 / 2 is exact), with no buffer copied in the forward pass and the gradients
    copied into the buckets a bucket at a time. The other process's buffers
    differ: its BatchNorm statistics are its own, as validation (which takes
    the primary's) and checkpoints (the primary's) never see."""
    import torch.multiprocessing as mp

    mp.start_processes(_two_processes, args=(free_port(), hook, accum_steps, tmp_path), nprocs=2,
                       start_method="fork")
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        # The weights alike on both; the buffers on the primary only: the other's BatchNorm statistics are now
        # its own batches', no longer the primary's with its last batch's update.
        assert result["same"] == [True, rank == 0], f"rank {rank}"
        assert result["copies"].get("buffer broadcast", 0) == 0
        # The fp16 hook's one copy per bucket: its all-reduced half values cast back into the bucket.
        assert result["copies"].get("gradients into buckets, one by one", 0) == (3 if hook == "fp16" else 0)
        assert result["copies"]["gradients into buckets, a bucket at a time"] == 3
        assert result["first_buffers"] == {1}  # the primary's (rank 0 filled its buffers with 1s)


def _device_copies_by_caller(profiled, steps: int) -> dict:
    """Device-to-device memcpys per step, by the operator that queued them and its two callers."""
    callers = collections.Counter()
    for event in profiled.events():
        memcpys = sum(kernel.name.startswith("Memcpy DtoD") for kernel in event.kernels)
        if memcpys:
            chain, parent = [event.name], event.cpu_parent
            while parent is not None and len(chain) < 3:
                chain.append(parent.name)
                parent = parent.cpu_parent
            callers[" < ".join(chain)] += memcpys
    return {caller: count / steps for caller, count in callers.most_common()}


@pytest.mark.gpu
def test_a_resnet50_step_on_the_gpu_copies_no_buffer_and_the_gradients_a_bucket_at_a_time(tmp_path):
    """Where the H200's 324 device-to-device copies a step came from
    (RESULTS.md's profile: ResNet-50, O2 fp16, channels-last, DDP on one
    GPU): none from DDP's buffer broadcast (159 buffers) or its gradients
    one by one (161) now; the copies left, per step and by caller, are
    printed (pytest -rA shows them) for docs/performance.md."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ctx = Context(rank=0, local_rank=0, world_size=1, device=device, backend="nccl")
        _, copies, profiled = _train(ctx, _batches(seed=1, steps=5, size=224, batch=64), profiled_steps=2,
                                     arch="resnet50", amp_dtype="fp16")
    finally:
        dist.destroy_process_group()
    memcpys = _device_copies_by_caller(profiled, 2)
    print(f"device-to-device memcpys per step: {sum(memcpys.values()):g}, by caller: {memcpys}")
    print(f"copies per step: {copies}")
    assert copies.get("buffer broadcast", 0) == 0 and copies.get("gradients into buckets, one by one", 0) == 0
    # ResNet-50's 100 MB of gradients in DDP's default buckets (1 MiB, then 25 MiB each): 5 of them.
    assert 2 <= copies["gradients into buckets, a bucket at a time"] <= 8
    assert not any(caller.startswith("aten::copy_ < DistributedDataParallel.forward") for caller in memcpys)
