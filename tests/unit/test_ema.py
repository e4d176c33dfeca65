"""--model-ema (common/ema.py): the average equals the formula after N
updates, computed by hand; torchvision's decay adjustment for batch, world
size, steps and epochs; updates only at every N-th step counted over the
run, never on a skipped step (fp16's scaler, a tolerated non-finite loss)
and once per --accum-steps step; the reset during the lr warm-up; the
checkpoint round trip and the resume's three cases; the val_ema rows, which
the tools never read as the model's."""
import types

import pytest
import torch
from torch import nn

from common import checkpoint, distributed, engine, fit, precision, schedules, session, telemetry
from common.cli import parse
from common.data import Sample
from common.errors import UsageError
from common.ema import ModelEMA, adjusted_decay
from common.meters import ClassReport, EpochMetrics
from common.tools import plots
from helpers import metrics_rows


class Tiny(nn.Module):
    """One weight and one BatchNorm: parameters and buffers, as use_buffers averages both."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 1, bias=False, dtype=torch.float64)
        self.norm = nn.BatchNorm1d(1, dtype=torch.float64)

    def forward(self, inputs):
        return self.norm(self.linear(inputs))


def set_weights(model: Tiny, value: float) -> None:
    """A fixed "optimizer step": every weight and the running mean set to `value`."""
    with torch.no_grad():
        model.linear.weight.fill_(value)
        model.norm.running_mean.fill_(value)


# --- the formula ---

def test_the_average_equals_the_formula_after_n_updates():
    model = Tiny()
    ema = ModelEMA(model, decay=0.75, every_steps=1)
    for step, value in enumerate([4.0, 8.0, 0.0, 16.0]):
        set_weights(model, value)
        assert ema.update(model, epoch=0, step=step, steps=100)
    # By hand, binary fractions (exact in floating point): the first update copies the weights (4), then
    # each is 0.75 x average + 0.25 x weights: 0.75 x 4 + 0.25 x 8 = 5; 0.75 x 5 + 0 = 3.75;
    # 0.75 x 3.75 + 0.25 x 16 = 6.8125.
    expected = torch.full((1, 2), 6.8125, dtype=torch.float64)
    assert torch.equal(ema.module.linear.weight, expected)
    assert torch.equal(ema.module.norm.running_mean, torch.tensor([6.8125], dtype=torch.float64))  # a buffer too
    assert ema.n_averaged == 4
    assert not ema.module.linear.weight.requires_grad  # averaged, never trained


# --- the decay: torchvision's adjustment, with its terms ---

def test_the_decay_is_adjusted_for_the_images_an_update_spans_and_the_epochs():
    # torchvision-v2's recipe: 8 GPUs x 128, --model-ema-steps 32, 600 epochs:
    # alpha = (1 - 0.99998) x 1024 x 32 / 600 = 0.0010922667.
    assert adjusted_decay(0.99998, 1024, 32, 600) == pytest.approx(1 - 2e-5 * 1024 * 32 / 600, rel=1e-12)
    assert adjusted_decay(0.99998, 1024, 32, 600) == pytest.approx(0.9989077333, abs=1e-10)
    assert adjusted_decay(0.9, 256, 32, 10) == 0.0  # alpha 81.92, capped at 1: the average is the weights
    assert adjusted_decay(1.0, 256, 32, 10) == 1.0  # nothing to adjust: the average never moves


@pytest.mark.parametrize("batch, accum, world_size, replicas_per_process", [(128, 1, 8, 1), (32, 4, 8, 1),
                                                                             (512, 1, 1, 2)])
def test_the_plan_counts_torchvisions_world_size_x_batch_size_as_the_global_batch(
        batch, accum, world_size, replicas_per_process):
    # torchvision's world_size x batch_size is the images of one optimizer step: here -b x --accum-steps x
    # replicas (processes, or a DataParallel process's GPUs), 1024 in each case.
    cfg = parse("nd", ["--synthetic", "-b", str(batch), "--epochs", "600", "--model-ema", "--model-ema-steps", "32",
                       "--accum-steps", str(accum)])
    ctx = distributed.Context(rank=0, local_rank=0, world_size=world_size, device=torch.device("cpu"),
                              replicas_per_process=replicas_per_process)
    plan = session.Plan.of(cfg, ctx, precision.FP32())
    assert plan.global_batch == 1024
    assert plan.ema_decay == adjusted_decay(0.99998, 1024, 32, 600)
    assert session.Plan.of(parse("nd", ["--synthetic"]), ctx, precision.FP32()).ema_decay is None  # off by default


# --- when it updates ---

def test_updates_come_every_n_steps_counted_over_the_run_not_per_epoch():
    model = Tiny()
    ema = ModelEMA(model, decay=0.5, every_steps=3)
    updated = [(epoch, step) for epoch in range(3) for step in range(4) if ema.update(model, epoch, step, steps=4)]
    # Global steps 0, 3, 6, 9 of 4 a epoch (torchvision's per-epoch count would give steps 0 and 3 of each).
    assert updated == [(0, 0), (0, 3), (1, 2), (2, 1)]
    assert ema.n_averaged == 4


def test_a_step_the_scaler_skipped_does_not_update_the_average():
    model = nn.Linear(2, 1)
    policy = precision.MixedPrecision("O1", torch.float16, torch.device("cpu"))  # fp16: a GradScaler
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = ModelEMA(model, decay=0.5, every_steps=1)
    before = model.weight.detach().clone()
    policy.backward_and_step((model(torch.ones(1, 2)) * float("inf")).sum(), optimizer)  # overflows: skipped
    assert policy.last_step_skipped() and torch.equal(model.weight, before)
    assert not ema.update(model, 0, 0, 10, skipped=policy.last_step_skipped) and ema.n_averaged == 0
    policy.backward_and_step(model(torch.ones(1, 2)).sum(), optimizer)
    assert not policy.last_step_skipped()
    assert ema.update(model, 0, 1, 10, skipped=policy.last_step_skipped) and ema.n_averaged == 1
    assert torch.equal(ema.module.weight, model.weight)  # the first update copies


class _Batches:
    dataset = None  # no image files behind them

    def __init__(self, images):
        self.images = images

    def __iter__(self):
        for image in self.images:
            yield Sample(image, torch.zeros(len(image), dtype=torch.long), torch.zeros(len(image)),
                         torch.full((len(image),), -1), [""] * len(image))


class _Loaders:
    """What Trainer.train_one_epoch reads of common.data.Loaders."""

    seed = 0
    global_batch = 2
    dali = None

    def __init__(self, images, accum_steps):
        self.train = _Batches(images)
        self.steps = len(images) // accum_steps

    def set_epoch(self, epoch, images_done=0, limit=0):
        return range(self.steps)

    def batches(self, split):
        return self.train


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_the_trainer_updates_after_each_whole_step_and_never_after_a_tolerated_non_finite_one(
        monkeypatch, accum_steps):
    updates = []
    real_update = ModelEMA.update

    def noted_update(self, model, epoch, step, steps, skipped=lambda: False):
        updates.append(step)
        return real_update(self, model, epoch, step, steps, skipped)

    monkeypatch.setattr(ModelEMA, "update", noted_update)
    ctx = distributed.single_process("cpu")
    model = nn.Linear(4, 3)
    ema = ModelEMA(model, decay=0.5, every_steps=1)
    images = [torch.ones(2, 4) for _ in range(4 * accum_steps)]
    images[2 * accum_steps] = torch.full((2, 4), float("nan"))  # step 2's (first) micro-batch: a NaN loss
    trainer = engine.Trainer(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1),
                             schedules.LRSchedule(0.1, 1), precision.FP32(), ctx, telemetry.RunLog(ctx),
                             max_nonfinite_steps=1, accum_steps=accum_steps, ema=ema)
    trainer.train_one_epoch(_Loaders(images, accum_steps), epoch=0)
    assert updates == [0, 1, 3]  # one per optimizer step, after all its micro-batches; none for step 2
    assert ema.n_averaged == 3


def test_during_the_warm_up_each_update_copies_the_weights():
    model = Tiny()
    ema = ModelEMA(model, decay=0.5, every_steps=1, warmup_epochs=0.5)  # warm-up: steps 0 and 1 of 4
    assert [ema.in_warmup(0, step, 4) for step in range(4)] == [True, True, False, False]
    for step, value in enumerate([4.0, 8.0, 2.0, 6.0]):
        set_weights(model, value)
        ema.update(model, 0, step, 4)
        if step == 1:  # reset after the update: the average is the weights, and the next update copies again
            assert ema.n_averaged == 0 and ema.module.linear.weight[0, 0].item() == 8.0
    # Step 2, the first after the warm-up, copies (2); step 3 averages: 0.5 x 2 + 0.5 x 6 = 4.
    assert ema.module.linear.weight[0, 0].item() == 4.0 and ema.n_averaged == 2
    # Whole warm-up epochs (torchvision's epoch < lr_warmup_epochs): every step of epoch 0, none of epoch 1.
    whole = ModelEMA(model, decay=0.5, every_steps=1, warmup_epochs=1)
    assert [whole.in_warmup(epoch, step, 4) for epoch in (0, 1) for step in (0, 3)] == [True, True, False, False]


# --- checkpoints ---

def _saved(tmp_path, ema, best_source="ema"):
    model = Tiny()
    state = checkpoint.training_state(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), precision_state={}, epoch=1, step=0,
        images_done=0, partial_epoch=None, best_acc1=50.0, best_epoch=0, arch="resnet50", classes=["a", "b"],
        config={}, world_size=1, global_batch=4, lr=0.1, seed=0,
        model_ema=ema.state_dict() if ema is not None else None, best_source=best_source)
    path = tmp_path / "checkpoint.pth.tar"
    torch.save(state, path)
    return path, model


def _resume(path, model, ema, *flags):
    cfg = parse("nd", ["--synthetic", "--resume", str(path), *flags])
    return checkpoint.resume(cfg, distributed.single_process("cpu"), model,
                             torch.optim.SGD(model.parameters(), lr=0.1), precision.FP32(), ["a", "b"],
                             telemetry.RunLog(distributed.single_process("cpu")), global_batch=4, lr=0.1,
                             auto_dir=None, ema=ema)


def test_a_checkpoint_holds_the_average_and_a_resume_restores_it(tmp_path, capsys):
    trained = Tiny()
    saved = ModelEMA(trained, decay=0.75, every_steps=2)
    for step, value in enumerate([4.0, 8.0, 0.0]):
        set_weights(trained, value)
        saved.update(trained, 0, step, 10)
    path, _ = _saved(tmp_path, saved)
    state = checkpoint.load(str(path))
    assert state["model_ema"]["n_averaged"] == 2 and state["best_source"] == "ema"
    assert set(state["model_ema"]["state_dict"]) == set(Tiny().state_dict())  # the plain model's names

    model = Tiny()
    restored = ModelEMA(model, decay=0.75, every_steps=2)
    start = _resume(path, model, restored, "--model-ema")
    assert start.has_ema and start.best_source == "ema"
    assert restored.n_averaged == 2
    for name, tensor in saved.module.state_dict().items():  # weights and buffers (BatchNorm's count too)
        assert torch.equal(restored.module.state_dict()[name], tensor), name
    assert torch.equal(restored.module.linear.weight, torch.full((1, 2), 3.0, dtype=torch.float64))  # 0.75 x 4
    assert "best top-1 50.00% at epoch 0 (the EMA's)" in capsys.readouterr().out


def test_a_resume_without_a_saved_average_starts_it_from_the_weights_and_one_without_the_flag_drops_it(
        tmp_path, capsys):
    path, saved_model = _saved(tmp_path, None, best_source=None)
    model = Tiny()
    ema = ModelEMA(model, decay=0.5, every_steps=1)  # made before the resume: of the weights as they were
    start = _resume(path, model, ema, "--model-ema")
    assert not start.has_ema and ema.n_averaged == 0
    assert torch.equal(ema.module.linear.weight, saved_model.linear.weight)  # the checkpoint's weights
    assert f"note: {path} holds no model EMA: --model-ema starts the average from its weights" in \
        capsys.readouterr().out

    with_average, _ = _saved(tmp_path, ModelEMA(Tiny(), decay=0.5, every_steps=1))
    assert not _resume(with_average, Tiny(), None).has_ema
    assert (f"note: {with_average} holds a model EMA; without --model-ema it is dropped (this run's checkpoints "
            f"hold none)") in capsys.readouterr().out


def test_a_saved_average_of_another_model_is_one_line(tmp_path):
    other = nn.Sequential(nn.Linear(3, 1))
    path, _ = _saved(tmp_path, ModelEMA(other, decay=0.5, every_steps=1))
    model = Tiny()
    with pytest.raises(UsageError, match=r"argument --resume: the model EMA in .* does not fit this model"):
        _resume(path, model, ModelEMA(model, decay=0.5, every_steps=1), "--model-ema")


# --- its rows: metrics.csv, the per-class report, and the tools that read them ---

def _row(split: str, top1: float) -> EpochMetrics:
    return EpochMetrics(epoch=0, split=split, loss=1.0, top1=top1, top5=100.0, images=9, steps=3, seconds=1.0,
                        images_per_second=9.0, seconds_per_step=0.3, data_wait_fraction=0.0,
                        lr=0.1 if split == "train" else None, wall_time=1.8e9, macro_f1=top1,
                        images_per_second_per_gpu=9.0, peak_memory_mib=1.0, dataset_bytes=0)


def test_the_average_has_rows_of_its_own_that_the_tools_do_not_read_as_the_models(tmp_path, capsys):
    ctx = distributed.single_process("cpu")
    log = telemetry.RunLog(ctx)
    log.start_run(parse("nd", ["--synthetic"]), checkpoint.ResumePoint(0), {},
                  types.SimpleNamespace(path=tmp_path, resuming=False))
    report = ClassReport.from_confusion(torch.tensor([[3, 0], [1, 5]]).numpy())
    log.epoch_end(_row("train", 50.0), _row("val", 60.0), report, ["a", "b"], 70.0, 0, ema=_row("val_ema", 70.0),
                  report_source="ema", best_source="ema")
    log.finish(fit.FitResult(epochs_run=1, seconds=3.0, best_acc1=70.0, best_epoch=0, best_source="ema"))
    out = capsys.readouterr().out
    assert [(row["split"], row["top1"]) for row in metrics_rows(tmp_path)] == \
        [("train", "50.0"), ("val", "60.0"), ("val_ema", "70.0")]
    assert ("epoch 0 val_ema: loss 1.0000  top1 70.00%  top5 100.00%  macro-F1 70.00%  | 9 images in 1.0 s  "
            "| per-class report: the EMA  | best top1 70.00% (epoch 0, the EMA)") in out
    assert "best val top-1 70.00% at epoch 0 (the EMA)" in out
    run = plots.read_run_dir(tmp_path)
    assert run.epochs["val_top1"].tolist() == [60.0]  # the model's, never the average's
    assert "not whole" not in capsys.readouterr().err  # the average's rows are whole rows, not a damaged file


def test_validation_picks_the_better_top1_and_its_report():
    reports = {False: "model's report", True: "EMA's report"}
    top1 = {False: 60.0, True: 70.0}
    trainer = types.SimpleNamespace(validate=lambda loaders, epoch, averaged=False, predictions=None: (
        _row("val_ema" if averaged else "val", top1[averaged]), reports[averaged]))
    both = fit.validate(trainer, None, 0, averaged=True)
    assert (both.source, both.top1, both.report, both.ema.split) == ("ema", 70.0, "EMA's report", "val_ema")
    top1[True] = 60.0  # a tie: the model's
    assert fit.validate(trainer, None, 0, averaged=True).source == "model"
    alone = fit.validate(trainer, None, 0, averaged=False)
    assert (alone.source, alone.ema, alone.report) == ("model", None, "model's report")
