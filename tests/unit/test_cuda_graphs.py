"""--cuda-graphs (common/cuda_graphs.py): the captured training step's logic on the CPU, where a stand-in
graph replays the same function over the same static buffers; on a GPU (`gpu`), the real CUDA graph against
eager steps."""
import contextlib
import copy
import dataclasses
import types
import weakref

import pytest
import torch
from torch import nn

from common import (cli, comm, cuda_graphs, data, distributed, engine, measure, meters, precision, schedules, session,
                    telemetry)
from common.cuda_graphs import DDP_WARMUP_STEPS, WARMUP_STEPS, GraphedStep, choose
from common.errors import UsageError

CLASSES = 5
STEPS = 8  # per epoch: the schedule's warm-up epoch, then cosine decay; a new rate every step
SCHEDULE = schedules.LRSchedule(0.4, 2, kind="cosine", warmup_epochs=1.0)


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, CLASSES))


def fused_sgd(model: nn.Module) -> torch.optim.SGD:
    """The optimizer the captured step runs (GraphedStep makes any SGD fused): today's eager step with it does
    the same arithmetic, so the two compare bit for bit."""
    return torch.optim.SGD(engine.parameter_groups(model, 1e-4, 0.0), lr=0.1, momentum=0.9, weight_decay=1e-4,
                           nesterov=True, fused=True)


def batch(index: int, size: int = 6) -> data.Sample:
    generator = torch.Generator().manual_seed(index)
    images = torch.randn(size, 3, 8, 8, generator=generator)
    target = torch.randint(0, CLASSES, (size,), generator=generator)
    zeros = torch.zeros(size, dtype=torch.long)
    return data.Sample(images, target, zeros, torch.full((size,), -1), [""] * size, torch.full((size,), -1), zeros,
                       zeros)


class RecordedGraph:
    """A stand-in for common.cuda_graphs.CudaGraph on the CPU: the capture keeps the step's function (which
    reads the static buffers and the rate tensor) and runs nothing; each replay runs it and writes its results
    into the same output tensors, as a CUDA graph's replays do. It notes each replay's rate."""

    captures = []

    def __init__(self, body, stream):
        assert stream is None  # the CPU has no side stream
        self.body, self.outputs, self.rates = body, None, []
        RecordedGraph.captures.append(self)

    def replay(self):
        results = self.body()
        if self.outputs is None:
            self.outputs = results
        else:
            for kept, new in zip(self.outputs, results):
                kept.copy_(new)
        return self.outputs


@pytest.fixture(autouse=True)
def no_captures_left():
    RecordedGraph.captures.clear()
    yield
    RecordedGraph.captures.clear()


def train(policy, steps, graphed_with=None, batches=None, lines=None):
    """Steps of a Trainer: today's eager one, or one whose step is a GraphedStep (warm-up 2 with the stand-in
    graph, or never captured: `graphed_with` "eager"). Returns the model, the optimizer and each step's loss."""
    model = small_model()
    optimizer = fused_sgd(model)
    ctx = distributed.single_process("cpu")
    graphed = None
    if graphed_with is not None:
        warmup = None if graphed_with == "eager" else 2
        graphed = GraphedStep(model, nn.CrossEntropyLoss(), optimizer, policy, ctx.device, warmup,
                              say=(lines if lines is not None else []).append, capture_with=RecordedGraph)
    trainer = engine.Trainer(model, nn.CrossEntropyLoss(), optimizer, SCHEDULE, policy, ctx, telemetry.RunLog(ctx),
                             graphed=graphed)
    return model, optimizer, losses_of_steps(trainer, batches or [batch(index) for index in range(steps)])


def losses_of_steps(trainer: engine.Trainer, samples: list) -> list:
    """Each step's mean loss, the samples moved to the trainer's device; the LossGuard's last check made."""
    device, losses = trainer.ctx.device, []
    for step, sample in enumerate(samples):
        sample = sample._replace(image=sample.image.to(device), target=sample.target.to(device))
        sums = meters.MetricSums(device)
        trainer._step(sample, iter(()), step // STEPS, step % STEPS, STEPS, 7, sums,
                      measure.StepTimer(STEPS, 0, [device]), data.BadImages(None))
        totals = sums.totals()
        losses.append(totals.loss_sum / totals.count)
    trainer.guard.settle()
    return losses


def assert_same_state(first, second):
    (model_a, optimizer_a, losses_a), (model_b, optimizer_b, losses_b) = first, second
    assert losses_a == losses_b
    for a, b in zip(model_a.state_dict().values(), model_b.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(optimizer_a.state[a]["momentum_buffer"], optimizer_b.state[b]["momentum_buffer"])


# --- the step over static buffers is today's step ---

@pytest.mark.parametrize("graphed_with", ["eager", "recorded"])
def test_the_graphable_step_trains_as_the_eager_step_bit_for_bit(graphed_with):
    """Weights, BatchNorm's statistics, momentum and every step's loss: equal, over 12 steps whose rate changes
    at each (warm-up, then cosine); captured (the stand-in) at the third, replayed over static buffers after."""
    eager = train(precision.FP32(), 12)
    graphed = train(precision.FP32(), 12, graphed_with)
    assert_same_state(eager, graphed)
    assert len(set(eager[2])) == 12  # every step trained on its own batch
    assert len(RecordedGraph.captures) == (1 if graphed_with == "recorded" else 0)


def test_the_rate_each_replay_reads_is_the_schedules_rate_of_its_step():
    lines = []
    model = small_model()
    rates = []
    graphed = GraphedStep(model, nn.CrossEntropyLoss(), fused_sgd(model), precision.FP32(), torch.device("cpu"), 2,
                          say=lines.append, capture_with=RecordedGraph)
    for step in range(10):
        sample = batch(step)
        graphed(sample.image, sample.target, SCHEDULE.lr(step // STEPS, step % STEPS, STEPS), f"epoch 0 step {step}")
        rates.append(float(graphed.lr))
        assert all(group["lr"] == 0.1 for group in graphed.optimizer.param_groups)  # the groups keep their float
    assert rates == [float(torch.tensor(SCHEDULE.lr(step // STEPS, step % STEPS, STEPS))) for step in range(10)]
    assert len(set(rates)) == 9  # warm-up's 8 rates, then cosine's (its first is the warm-up's last, the peak)
    (capture,) = RecordedGraph.captures
    assert lines == ["cuda graphs: training step captured at epoch 0 step 2 for batches of 6x3x8x8 in "
                     + lines[0].split(" in ")[1]]
    assert lines[0].endswith("s (capture and first replay)")  # no GPU memory to report on the CPU


def test_a_batch_of_another_shape_runs_eagerly_with_the_same_numbers_and_the_graph_is_kept():
    """A short batch between full ones: eager (no replay, no capture), the same weights as the eager
    Trainer's; the full batches after it replay the one graph. A shape that lasts is captured in its place."""
    sizes = [6, 6, 6, 6, 4, 6, 6, 3, 3, 3, 6]
    batches = [batch(index, size) for index, size in enumerate(sizes)]
    replays = []
    original_replay = RecordedGraph.replay

    def counted(self):
        replays.append(RecordedGraph.captures.index(self))
        return original_replay(self)

    RecordedGraph.replay = counted
    try:
        graphed = train(precision.FP32(), 0, "recorded", batches)
    finally:
        RecordedGraph.replay = original_replay
    assert_same_state(train(precision.FP32(), 0, batches=batches), graphed)
    # Steps 0-1 eager (warm-up), 2-3 the graph for 6 images, 4 eager, 5-6 the graph, 7-8 eager (warm-up for 3),
    # 9 the graph for 3 images (captured in place of the first), 10 eager again (warm-up for 6).
    assert len(RecordedGraph.captures) == 2
    assert replays == [0, 0, 0, 0, 1]


class FailingGraph:
    """A capture that fails as CUDA's do when the step waits for the host (an .item() in a model's forward)."""

    attempts = 0

    def __init__(self, body, stream):
        FailingGraph.attempts += 1
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nCompile with "
                           "`TORCH_USE_CUDA_DSA` to enable device-side assertions.")


def test_a_capture_that_fails_leaves_every_step_eager_with_the_same_numbers_said_once():
    FailingGraph.attempts = 0
    lines = []
    model = small_model()
    optimizer = fused_sgd(model)
    ctx = distributed.single_process("cpu")
    graphed = GraphedStep(model, nn.CrossEntropyLoss(), optimizer, precision.FP32(), ctx.device, 2, say=lines.append,
                          capture_with=FailingGraph)
    trainer = engine.Trainer(model, nn.CrossEntropyLoss(), optimizer, SCHEDULE, precision.FP32(), ctx,
                             telemetry.RunLog(ctx), graphed=graphed)
    losses = losses_of_steps(trainer, [batch(index) for index in range(8)])
    assert_same_state(train(precision.FP32(), 8), (model, optimizer, losses))
    assert FailingGraph.attempts == 1  # at the third step; never again
    assert lines == ["cuda graphs: the training step could not be captured (CUDA error: operation not permitted "
                     "when stream is capturing); every training step eager from here"]


def test_under_ddp_a_capture_that_fails_ends_the_run():
    """Every process must take the same path, and DDP's reducer stopped mid-backward: no eager step after it."""
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)  # never called here
    model = small_model()
    graphed = GraphedStep(ddp, nn.CrossEntropyLoss(), fused_sgd(model), precision.FP32(), torch.device("cpu"), 0,
                          capture_with=FailingGraph)
    sample = batch(0)
    with pytest.raises(UsageError, match=r"^argument --cuda-graphs: on: the training step could not be captured "
                                         r"under DDP \(CUDA error: operation not permitted when stream is capturing\); "
                                         r"run with --cuda-graphs off$"):
        graphed(sample.image, sample.target, 0.1)


def test_a_step_the_scaler_began_is_forgotten_and_the_next_one_runs():
    """What a failed capture leaves in the GradScaler (its optimizer unscaled): cleared by forget_step, so the next
    step's unscale_ (--clip-grad-norm) does not fail as "already called since the last update()"."""
    model = small_model()
    optimizer = fused_sgd(model)
    policy = precision.MixedPrecision("O1", torch.float16, torch.device("cpu"), clip_grad_norm=1.0)
    sample = batch(0)
    with policy.autocast():
        policy.backward(nn.functional.cross_entropy(model(sample.image), sample.target))
    policy.scaler.unscale_(optimizer)
    policy.forget_step(optimizer)
    before = model[5].weight.detach().clone()
    with policy.autocast():
        loss = nn.functional.cross_entropy(model(sample.image), sample.target)
    policy.backward_and_step(loss, optimizer)
    assert not torch.equal(model[5].weight, before)


def capture_refused_in(owner, name: str, model: nn.Module):
    """A stand-in capture that runs the step until it calls `owner.name`, which raises as CUDA does at a call
    that waits for the host: what the step set up to there (the scaler's attributes on the optimizer, the
    gradients) stays, as after a real capture. A real capture runs no kernel, so the model's weights and
    BatchNorm's statistics are put back as they were."""

    class RefusedCapture:
        def __init__(self, body, stream):
            as_before = copy.deepcopy(model.state_dict())

            def refuse(*args, **kwargs):
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

            setattr(owner, name, refuse)
            try:
                body()
            finally:
                delattr(owner, name)
                model.load_state_dict(as_before)

    return RefusedCapture


def test_a_capture_that_fails_inside_the_optimizer_step_leaves_no_scale_for_the_next_step():
    """GradScaler.step hands fused SGD the scale and found_inf as attributes of the optimizer and deletes them
    only once its step returns: a capture that fails inside the step leaves them, and the next eager step would
    take the stale scale times its own (its gradients unscaled twice). The steps after the failure train exactly
    as eager steps do."""
    model = small_model()
    optimizer = fused_sgd(model)
    ctx = distributed.single_process("cpu")
    lines = []
    graphed = GraphedStep(model, nn.CrossEntropyLoss(), optimizer, fp16_on_cpu(), ctx.device, 2, say=lines.append,
                          capture_with=capture_refused_in(optimizer, "step", model))
    trainer = engine.Trainer(model, nn.CrossEntropyLoss(), optimizer, SCHEDULE, graphed.precision, ctx,
                             telemetry.RunLog(ctx), graphed=graphed)
    losses = losses_of_steps(trainer, [batch(index) for index in range(6)])
    assert lines == ["cuda graphs: the training step could not be captured (CUDA error: operation not permitted "
                     "when stream is capturing); every training step eager from here"]
    assert_same_state(train(fp16_on_cpu(), 6), (model, optimizer, losses))


def test_what_a_failed_capture_made_is_let_go_before_the_eager_step():
    """The error of a failed capture holds, in its traceback, the tensors the capture made (on a GPU, in the
    graph's private pool: the loss, the logits, what autograd saved for the backward pass): let go before the
    step is run eagerly, and before the allocator's cache is emptied, so that their memory goes back."""
    model = small_model()
    optimizer = fused_sgd(model)
    made_in_capture, alive_at_eager_steps = [], []

    class WatchedLoss(nn.CrossEntropyLoss):
        def forward(self, logits, target):
            loss = super().forward(logits, target)
            if "step" in vars(optimizer):  # the stand-in capture refuses optimizer.step: capturing
                made_in_capture.append(weakref.ref(loss))
            else:
                alive_at_eager_steps.append(sum(made() is not None for made in made_in_capture))
            return loss

    ctx = distributed.single_process("cpu")
    graphed = GraphedStep(model, WatchedLoss(), optimizer, precision.FP32(), ctx.device, 2, say=[].append,
                          capture_with=capture_refused_in(optimizer, "step", model))
    trainer = engine.Trainer(model, WatchedLoss(), optimizer, SCHEDULE, precision.FP32(), ctx, telemetry.RunLog(ctx),
                             graphed=graphed)
    losses_of_steps(trainer, [batch(index) for index in range(4)])
    assert len(made_in_capture) == 1  # at the third step
    assert alive_at_eager_steps == [0, 0, 0, 0]  # two before the capture, the third step's and the fourth


def test_a_capture_whose_end_fails_gives_its_graph_back_and_the_stream_it_found(monkeypatch):
    """torch.cuda.graph's exit calls capture_end, which throws for a capture that went wrong, before the exit
    would make the stream it found current again. CudaGraph does that, and resets the graph at once rather than
    when the error's traceback lets it go: torch 2.14's CUDAGraph.h says reset() releases the private memory pool
    of a failed capture and ends the allocator's routing to it. Stand-ins for torch.cuda's graph and streams."""
    events = []

    class Graph:
        def reset(self):
            events.append("graph reset")

    @contextlib.contextmanager
    def capturing(graph, stream, capture_error_mode):
        events.append(f"capture on the {stream} ({capture_error_mode})")
        yield
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")  # capture_end's

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", capturing)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "training stream")
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: events.append(f"{stream} current"))
    with pytest.raises(RuntimeError, match=r"^CUDA error: operation not permitted when stream is capturing$"):
        cuda_graphs.CudaGraph(lambda: events.append("step captured"), "side stream")
    assert events == ["capture on the side stream (thread_local)", "step captured", "training stream current",
                      "graph reset"]


def ddp_on_stand_in_streams(monkeypatch, **options):
    """comm.distributed_model on rank 1 of 2 on a stand-in GPU, with `options` over the defaults: the order in
    which DDP was made and streams waited (stand-in streams and DDP record it), and the hook it returns."""
    events = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            events.append(f"{self.name} waits for {other.name}")

    current = [Stream("training stream")]

    @contextlib.contextmanager
    def on_stream(stream):
        current.append(stream)
        yield
        current.pop()

    def ddp(model, **ddp_options):
        events.append(f"DDP made on the {current[-1].name}")
        return types.SimpleNamespace(register_comm_hook=lambda state, hook: None)

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream("side stream"))
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(nn.parallel, "DistributedDataParallel", ddp)
    ctx = distributed.Context(rank=1, local_rank=1, world_size=2, device=torch.device("cuda", 1), backend="nccl")
    cfg = dataclasses.replace(cli.parse("ddp", ["--synthetic"]), static_graph=True, **options)
    _, hook = comm.distributed_model(nn.Linear(2, 2), cfg, ctx)
    return events, hook


def test_ddp_made_on_a_side_stream_is_waited_for_before_the_training_stream_uses_its_weights(monkeypatch):
    """DDP's constructor copies rank 0's weights into every process's model on the stream current then (a
    non-blocking copy after its broadcast): under --cuda-graphs on a side stream, which the training stream
    (the first step, a resume's load) must wait for."""
    events, hook = ddp_on_stand_in_streams(monkeypatch, cuda_graphs="on")
    assert events == ["DDP made on the side stream", "training stream waits for side stream"]
    assert hook.stream.name == "side stream"  # for the warm-up and the capture (the next test)
    for setting in ("off", "auto"):  # as before
        events, hook = ddp_on_stand_in_streams(monkeypatch, cuda_graphs=setting)
        assert events == ["DDP made on the training stream"] and hook.stream is None


@pytest.mark.parametrize("blocker", [dict(accum_steps=2), dict(model_ema=True), dict(sync_bn=True),
                                     dict(ddp_comm_hook="fp16"), dict(mixup_alpha=0.2), dict(compile=True),
                                     dict(max_nonfinite_steps=1)])
def test_ddp_stays_on_the_training_stream_when_an_option_keeps_every_step_eager(monkeypatch, blocker):
    """--cuda-graphs on with an option that keeps the step eager: eager steps run on the training stream, and a DDP
    made on a side stream would have every gradient of every step cross streams (torch's AccumulateGrad
    stream-mismatch warning on every rank, a sync per step). The same options choose() names."""
    events, hook = ddp_on_stand_in_streams(monkeypatch, cuda_graphs="on", **blocker)
    assert events == ["DDP made on the training stream"] and hook.stream is None
    cfg = dataclasses.replace(cli.parse("ddp", ["--synthetic"]), cuda_graphs="on", **blocker)
    choice = choose(cfg, torch.device("cuda"), nn.Linear(2, 2))
    assert not choice.capture and choice.note.startswith("--cuda-graphs on: every training step eager, for ")
    assert "; " not in choice.note  # that option's reason alone


def test_the_step_of_a_ddp_model_is_warmed_up_and_captured_on_the_stream_ddp_was_made_on(monkeypatch):
    """DDP keeps its parameters' AccumulateGrad nodes, each bound to the stream current when DDP was made;
    a capture on another stream has them run outside it (torch's stale-stream failures, Megatron-LM's fix:
    DDP made on the capture stream). The session hands DDP's stream to the GraphedStep."""
    made = []
    monkeypatch.setattr(cuda_graphs, "choose", lambda *args, **kwargs: cuda_graphs.GraphChoice(True, None, 11))
    monkeypatch.setattr(session, "GraphedStep", lambda *args, **kwargs: made.append(kwargs) or "graphed")
    cfg = cli.parse("ddp", ["--synthetic"])
    ctx = distributed.single_process("cpu")
    model = small_model()
    stream = object()  # a stand-in for DDP's side stream
    assert session._graphed_step(cfg, ctx, telemetry.RunLog(ctx), model, nn.CrossEntropyLoss(), fused_sgd(model),
                                 precision.FP32(), comm.CommHook(stream=stream)) == "graphed"
    assert made[0]["stream"] is stream
    assert session._graphed_step(cfg, ctx, telemetry.RunLog(ctx), model, nn.CrossEntropyLoss(), fused_sgd(model),
                                 precision.FP32()) == "graphed"
    assert made[1]["stream"] is None  # no DDP: a stream of the GraphedStep's own


# --- the fp16 scaler's skip, on the device ---

def fp16_on_cpu():
    return precision.MixedPrecision("O1", torch.float16, torch.device("cpu"))


OVERFLOWING_SCALE = 3e38  # the scaled loss is inf in fp32; halved exactly in float32
HALVED = float(torch.tensor(OVERFLOWING_SCALE, dtype=torch.float32)) / 2


def test_a_step_the_scaler_skips_leaves_weights_and_momentum_exactly_and_halves_the_scale():
    """A replayed step whose scaled gradients overflow: fused SGD, told by the scaler on the device, leaves
    the weights and momentum as they were; the scale halves and the skip is counted; the next step updates."""
    model = small_model()
    optimizer = fused_sgd(model)
    policy = fp16_on_cpu()
    graphed = GraphedStep(model, nn.CrossEntropyLoss(), optimizer, policy, torch.device("cpu"), 0,
                          capture_with=RecordedGraph, say=lambda line: None)
    sample = batch(0)
    graphed(sample.image, sample.target, 0.1)  # warm-up 0: captured at once and replayed, a step taken
    assert policy.status()["skipped_steps"] == 0
    weights = [parameter.detach().clone() for parameter in model.parameters()]
    momentum = [optimizer.state[parameter]["momentum_buffer"].clone() for parameter in model.parameters()]
    policy.scaler._scale.fill_(OVERFLOWING_SCALE)
    outputs = graphed(sample.image, sample.target, 0.1)
    assert bool(torch.isfinite(outputs.loss))  # the loss was fine; its scaled gradients were not
    assert len(RecordedGraph.captures) == 1
    for parameter, weight, buffer in zip(model.parameters(), weights, momentum):
        assert torch.equal(parameter, weight)
        assert torch.equal(optimizer.state[parameter]["momentum_buffer"], buffer)
    assert policy.scaler.get_scale() == HALVED
    assert policy.status()["skipped_steps"] == 1
    policy.scaler._scale.fill_(1024.0)
    graphed(sample.image, sample.target, 0.1)  # a scale that fits: the step is taken
    assert not torch.equal(model[5].weight, weights[-2])
    assert policy.status()["skipped_steps"] == 1


def test_a_first_step_the_scaler_skips_leaves_the_momentum_at_zero():
    model = small_model()
    optimizer = fused_sgd(model)
    policy = fp16_on_cpu()
    graphed = GraphedStep(model, nn.CrossEntropyLoss(), optimizer, policy, torch.device("cpu"), None,
                          say=lambda line: None)
    before = copy.deepcopy(list(model.parameters()))
    policy.backward(torch.zeros((), requires_grad=True))  # the scaler makes its scale tensor at its first use
    policy.scaler._scale.fill_(OVERFLOWING_SCALE)
    sample = batch(0)
    graphed(sample.image, sample.target, 0.1)
    assert policy.scaler.get_scale() == HALVED and policy.status()["skipped_steps"] == 1
    for parameter, earlier in zip(model.parameters(), before):
        assert torch.equal(parameter, earlier)
        assert torch.equal(optimizer.state[parameter]["momentum_buffer"], torch.zeros_like(parameter))


def test_the_skip_count_a_replay_adds_to_is_the_one_status_reads():
    """A CUDA graph's replays write the tensors its capture wrote: the policy adds each skip to one count, in
    place, which status() reads and sets back to zero in place (not a new tensor a replay would never see)."""
    model = small_model()
    optimizer = fused_sgd(model)
    policy = fp16_on_cpu()
    sample = batch(0)

    def step():
        with policy.autocast():
            loss = nn.functional.cross_entropy(model(sample.image), sample.target)
        policy.backward_and_step(loss, optimizer)

    step()
    count, last = policy._skipped_now, policy._last_skipped
    policy.scaler._scale.fill_(OVERFLOWING_SCALE)
    step()
    assert policy._skipped_now is count and policy._last_skipped is last
    assert int(count) == 1 and policy.last_step_skipped()
    assert policy.status()["skipped_steps"] == 1
    assert policy._skipped_now is count and int(count) == 0


# --- nothing inside waits for the device ---

class HostSync(Exception):
    pass


@pytest.fixture
def host_reads_raise(monkeypatch):
    """Every way a tensor's value reaches the host raises (on a GPU each would wait for the device)."""
    def refuse(*args, **kwargs):
        raise HostSync()

    def start():
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"):
            monkeypatch.setattr(torch.Tensor, name, refuse)
    return start


@pytest.mark.parametrize("policy", [
    lambda: precision.FP32(), lambda: precision.FP32(clip_grad_norm=0.5), fp16_on_cpu,
    lambda: precision.MixedPrecision("O1", torch.float16, torch.device("cpu"), clip_grad_norm=0.5),
], ids=["fp32", "fp32-clip", "fp16-scaler", "fp16-scaler-clip"])
def test_the_graphable_step_reads_nothing_back_to_the_host(policy, host_reads_raise):
    model = small_model()
    graphed = GraphedStep(model, nn.CrossEntropyLoss(), fused_sgd(model), policy(), torch.device("cpu"), None,
                          say=lambda line: None)
    sample = batch(0)
    graphed(sample.image, sample.target, 0.1)  # the scaler's first use makes its tensors
    before = model[5].weight.detach().clone()
    host_reads_raise()
    graphed.body(sample.image, sample.target)
    graphed.body(sample.image, sample.target)
    assert not torch.equal(model[5].weight.detach(), before)


def test_the_scripts_fp16_sgd_made_fused_skips_on_the_device_without_a_host_read(host_reads_raise):
    """The SGD a script makes under fp16 loss scaling (engine.sgd: foreach, as on a GPU) is what the captured
    step gets: made fused, the GradScaler must hand it the skip on the device, as it does torch's fused SGD,
    not read found_inf on the host (which a capture refuses). An overflowing step is still skipped."""
    model = small_model()
    optimizer = engine.sgd(model, 0.1, 0.9, 1e-4, loss_scaling=True)
    assert optimizer.param_groups[0]["foreach"] and not optimizer.param_groups[0]["fused"]
    policy = fp16_on_cpu()
    graphed = GraphedStep(model, nn.CrossEntropyLoss(), optimizer, policy, torch.device("cpu"), None,
                          say=lambda line: None)
    sample = batch(0)
    graphed(sample.image, sample.target, 0.1)  # the scaler's first use makes its tensors
    weights = [parameter.detach().clone() for parameter in model.parameters()]
    policy.scaler._scale.fill_(OVERFLOWING_SCALE)
    host_reads_raise()
    graphed.body(sample.image, sample.target)
    for parameter, weight in zip(model.parameters(), weights):
        assert torch.equal(parameter.detach(), weight)
    policy.scaler._scale.fill_(1024.0)  # a scale that fits: this step is taken
    graphed.body(sample.image, sample.target)
    assert not torch.equal(model[5].weight.detach(), weights[-2])


def test_the_eager_fp16_step_with_foreach_sgd_reads_the_skip_on_the_host(host_reads_raise):
    """Why the captured step takes fused SGD: with the foreach SGD that eager fp16 steps use (engine.sgd),
    the GradScaler decides the skip on the host."""
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    policy = fp16_on_cpu()
    policy.backward(torch.zeros((), requires_grad=True))
    sample = batch(0)
    host_reads_raise()
    with pytest.raises(HostSync):
        with policy.autocast():
            loss = nn.functional.cross_entropy(model(sample.image), sample.target)
        policy.backward_and_step(loss, optimizer)


# --- which runs capture, said once ---

def graphs(setting: str, **options):
    """A DDP run's Config with --cuda-graphs `setting` and `options`, made past the command line's check (which
    refuses on without a GPU here)."""
    return dataclasses.replace(cli.parse("ddp", ["--synthetic"]), cuda_graphs=setting, **options)


def test_on_without_a_gpu_is_one_line():
    with pytest.raises(UsageError, match=r"^argument --cuda-graphs: on needs a CUDA GPU, and this process trains on "
                                         r"the CPU \(use auto or off\)$"):
        choose(graphs("on"), torch.device("cpu"), nn.Linear(2, 2))
    with pytest.raises(UsageError, match=r"^argument --cuda-graphs: on needs a CUDA GPU, and --device cpu trains on "
                                         r"the CPU \(use auto or off\)$"):
        cli.parse("nd", ["--synthetic", "--device", "cpu", "--cuda-graphs", "on"])
    assert cli.parse("nd", ["--synthetic"]).cuda_graphs == "auto"


def test_auto_and_off_stay_eager_and_on_says_what_keeps_it_eager():
    gpu, cpu, model = torch.device("cuda"), torch.device("cpu"), nn.Linear(2, 2)  # a device object: no GPU used
    assert choose(graphs("off"), gpu, model).note is None and not choose(graphs("off"), gpu, model).capture
    assert choose(graphs("auto"), cpu, model).note is None and not choose(graphs("auto"), cpu, model).capture
    auto = choose(graphs("auto"), gpu, model)
    assert not auto.capture and "run_scripts/gpu_check.sh" in auto.note
    on = choose(graphs("on"), gpu, model)
    assert on.capture and on.warmup_steps == WARMUP_STEPS == 3
    assert on.note == ("--cuda-graphs on: the training step captured in a CUDA graph after 3 eager steps, then "
                       "replayed; a batch of another shape and validation run eagerly")
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)  # the type is enough
    assert choose(graphs("on"), gpu, ddp).warmup_steps == DDP_WARMUP_STEPS == 11
    blocked = choose(graphs("on", accum_steps=2, cutmix_alpha=1.0, model_ema=True, max_nonfinite_steps=1,
                            compile=True, ddp_comm_hook="powersgd", sync_bn=True), gpu, nn.DataParallel(model))
    assert not blocked.capture
    assert blocked.note == (
        "--cuda-graphs on: every training step eager, for DataParallel (it scatters each batch from the host); "
        "--accum-steps 2 (micro-batches, the first under DDP's no_sync); MixUp/CutMix (drawn on the host each "
        "step); --model-ema (its update asks the host whether the step was skipped); --max-nonfinite-steps 1 (the "
        "host reads each loss before the update); --compile (torch.compile makes graphs of its own); "
        "--ddp-comm-hook powersgd (the hook keeps state on the host); --sync-bn (not captured yet)")
    assert choose(graphs("on", max_nonfinite_steps=1), gpu, model).note.endswith(
        "(the host reads each loss before the update)")


# --- on a GPU: the real graph against eager steps ---

def gpu_parts(opt_level):
    """A small convolutional model on the GPU, its precision policy and the SGD a script gives it (engine.sgd)."""
    device = torch.device("cuda")
    torch.manual_seed(0)  # the same weights both ways (deterministic algorithms would stay on for later tests)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3),
                          nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(16, CLASSES)).to(device)
    policy = precision.FP32() if opt_level == "O0" else precision.MixedPrecision(opt_level, torch.float16, device)
    model = policy.prepare_model(model)
    return model, policy, engine.sgd(model, 0.1, 0.9, 1e-4, loss_scaling=policy.scales_loss)


def gpu_train(opt_level, graphs, sizes):
    """Steps of batches of `sizes` images on the GPU: eager, or --cuda-graphs on's step (warm-up 3)."""
    model, policy, optimizer = gpu_parts(opt_level)
    ctx = distributed.single_process("cuda")
    lines = []
    graphed = GraphedStep(model, nn.CrossEntropyLoss(), optimizer, policy, ctx.device, say=lines.append) \
        if graphs else None
    trainer = engine.Trainer(model, nn.CrossEntropyLoss(), optimizer, SCHEDULE, policy, ctx, telemetry.RunLog(ctx),
                             graphed=graphed)
    return model, losses_of_steps(trainer, [batch(step, size) for step, size in enumerate(sizes)]), lines


@pytest.mark.gpu
@pytest.mark.parametrize("opt_level", ["O0", "O2", "O3"])
def test_a_run_with_graphs_ends_where_the_eager_run_ends(opt_level):
    """Losses per step and final weights within tolerance: fp32's steps are the same kernels (fused SGD
    both ways), summed in another order where cuDNN's backward adds with atomics (1e-7 relative a step);
    under fp16 eager SGD is foreach and the captured one fused, a rounding of the last bit per step, and
    half-precision activations: 12 steps of a small model keep well inside 2%."""
    eager_model, eager_losses, _ = gpu_train(opt_level, False, [32] * 12)
    model, losses, lines = gpu_train(opt_level, True, [32] * 12)
    tolerance = 1e-4 if opt_level == "O0" else 2e-2
    assert losses == pytest.approx(eager_losses, rel=tolerance)
    for a, b in zip(model.state_dict().values(), eager_model.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), rtol=tolerance, atol=tolerance)
    (line,) = lines
    assert line.startswith("cuda graphs: training step captured at epoch 0 step 3 for batches of 32x3x8x8 in ")
    assert line.endswith("more GPU memory reserved")


@pytest.mark.gpu
def test_a_short_batch_on_the_gpu_runs_eagerly_and_the_graph_stays():
    sizes = [32] * 6 + [20] + [32] * 3
    eager_model, eager_losses, _ = gpu_train("O0", False, sizes)
    model, losses, lines = gpu_train("O0", True, sizes)
    assert losses == pytest.approx(eager_losses, rel=1e-4)
    assert len(lines) == 1  # one capture: the short batch did not replace it
    for a, b in zip(model.state_dict().values(), eager_model.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_an_overflowing_fp16_step_on_the_gpu_is_skipped_inside_the_graph():
    model, policy, optimizer = gpu_parts("O2")
    graphed = GraphedStep(model, nn.CrossEntropyLoss(), optimizer, policy, torch.device("cuda"), say=lambda line: None)
    sample = batch(0, 32)
    images, target = sample.image.cuda(), sample.target.cuda()
    for _ in range(WARMUP_STEPS + 1):  # the last one captured and replayed
        graphed(images, target, 0.1)
    assert graphed.graph is not None
    skipped = policy.status()["skipped_steps"]
    weights = [parameter.detach().clone() for parameter in model.parameters()]
    momentum = [optimizer.state[parameter]["momentum_buffer"].clone() for parameter in model.parameters()]
    policy.scaler._scale.fill_(OVERFLOWING_SCALE)
    graphed(images, target, 0.1)  # a replay
    assert policy.status()["skipped_steps"] == skipped + 1 and policy.scaler.get_scale() == HALVED
    for parameter, weight, buffer in zip(model.parameters(), weights, momentum):
        assert torch.equal(parameter, weight)
        assert torch.equal(optimizer.state[parameter]["momentum_buffer"], buffer)
