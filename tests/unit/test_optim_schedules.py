"""The optimiser's and the schedule's recipe options (docs/recipes.md, "Optimiser and schedules"):
weight decay per parameter group, Nesterov momentum, gradient clipping in the precision policies,
the linear (FFCV) schedule, linear and constant warm-up, the floor, and BlurPool. Exact numbers."""
import dataclasses
import math

import pytest
import torch
from torch import nn

from common import checkpoint, engine, precision, session
from common.cli import parse
from common.distributed import single_process
from common.errors import UsageError
from common.models import Blur, build_model
from common.schedules import LRSchedule

CPU = single_process("cpu")


# --- schedules: the rate at given steps ---

def test_linear_schedule_ramps_up_to_the_peak_then_straight_down_to_the_floor_at_the_last_step():
    # 3 epochs of 4 steps, 1 warm-up epoch: warm-up steps 0-3, then 4 .. 11 down to the floor 0.1.
    schedule = LRSchedule(peak_lr=2.0, epochs=3, kind="linear", warmup_epochs=1, min_lr=0.2)
    rates = [schedule.lr(epoch, step, 4) for epoch in range(3) for step in range(4)]
    assert rates[:4] == pytest.approx([0.5, 1.0, 1.5, 2.0], rel=1e-12)  # today's warm-up: 1/4, 2/4, ... of the peak
    down = [2.0 * (1 + (0.1 - 1) * (index - 4) / 7) for index in range(4, 12)]
    assert rates[4:] == pytest.approx(down, rel=1e-12)
    assert rates[4] == 2.0 and rates[11] == pytest.approx(0.2, rel=1e-12)
    # No warm-up: the peak at the first step, the floor (0 by default) at the last.
    plain = LRSchedule(peak_lr=1.0, epochs=2, kind="linear")
    assert [plain.lr(epoch, step, 3) for epoch in range(2) for step in range(3)] == \
        pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.0], abs=1e-15)


def test_linear_warmup_with_a_starting_factor_is_torchvisions_linearlr_per_step():
    schedule = LRSchedule(peak_lr=1.0, epochs=4, kind="step", warmup_epochs=1, warmup_decay=0.2)
    assert [schedule.lr(0, step, 4) for step in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8], rel=1e-12)
    assert schedule.lr(1, 0, 4) == 1.0


def test_constant_warmup_holds_its_factor_then_jumps_to_the_peak():
    default = LRSchedule(peak_lr=0.5, epochs=4, kind="cosine", warmup_epochs=0.5, warmup_method="constant")
    assert [default.lr(0, step, 4) for step in range(3)] == pytest.approx([0.005, 0.005, 0.5], rel=1e-12)
    given = LRSchedule(peak_lr=0.5, epochs=4, warmup_epochs=1, warmup_method="constant", warmup_decay=0.3)
    assert [given.lr(0, step, 2) for step in range(2)] + [given.lr(1, 0, 2)] == pytest.approx([0.15, 0.15, 0.5])


def test_cosine_decays_to_the_floor_and_step_never_goes_below_it():
    cosine = LRSchedule(peak_lr=1.0, epochs=10, kind="cosine", min_lr=0.1)
    assert cosine.lr(0, 0, 4) == pytest.approx(1.0, rel=1e-12)
    assert cosine.lr(5, 0, 4) == pytest.approx(0.55, rel=1e-12)  # half-way: eta_min + (peak - eta_min) / 2
    assert cosine.lr(9, 3, 4) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 9.75 / 10)), rel=1e-12)
    step = LRSchedule(peak_lr=1.0, epochs=4, milestones=(1, 2, 3), min_lr=0.05)
    assert [step.lr(epoch, 0, 2) for epoch in range(4)] == pytest.approx([1.0, 0.1, 0.05, 0.05], rel=1e-12)


def test_the_defaults_keep_the_old_arithmetic_to_the_bit():
    """min_lr 0 and no warm-up factor: peak x warm-up x decay, in that order, as before the floor."""
    cosine = LRSchedule(peak_lr=0.4, epochs=10, kind="cosine", warmup_epochs=1, min_lr=0.0, warmup_decay=None)
    for epoch, step in ((0, 0), (0, 3), (1, 0), (4, 2), (9, 3)):
        progress, index = epoch + step / 4, epoch * 4 + step
        warm = (index + 1) / 4 if index < 4 else 1.0
        fraction = min(max((progress - 1) / 9, 0.0), 1.0)
        assert cosine.lr(epoch, step, 4) == 0.4 * warm * (0.5 * (1.0 + math.cos(math.pi * fraction)))
    step = LRSchedule(peak_lr=0.3, epochs=90, min_lr=0.0)
    assert step.lr(65, 1, 7) == 0.3 * 1.0 * 0.1 ** 2


def test_the_schedule_is_said_in_words():
    assert LRSchedule(0.2, 90).describe() == "step schedule (x0.1 at epoch 30, 60, 80)"
    assert LRSchedule(0.2, 9, milestones=(3,), min_lr=0.01).describe() == \
        "step schedule (x0.1 at epoch 3, not below 0.01)"
    assert LRSchedule(0.2, 16, kind="linear", warmup_epochs=2, warmup_decay=1e-4).describe() == (
        "linear schedule from the peak after warm-up to 0 at the last step; linear warm-up over 2 epoch(s), "
        "per step, from 0.0001 x the rate")
    assert LRSchedule(0.2, 10, kind="cosine", min_lr=0.002, warmup_epochs=5, warmup_method="constant").describe() \
        == ("cosine schedule to 0.002 at the end of epoch 9; constant warm-up over 5 epoch(s), per step, at 0.01 x "
            "the rate")


def test_the_plan_scales_the_floor_as_the_rate_and_makes_the_schedule():
    cfg = parse("nd", ["--synthetic", "-b", "64", "--lr", "0.4", "--lr-min", "0.02", "--lr-scheduler", "steplr",
                       "--lr-warmup-epochs", "2", "--lr-warmup-method", "constant", "--lr-warmup-decay", "0.5"])
    plan = session.Plan.of(cfg, dataclasses.replace(CPU, world_size=2), precision.FP32())
    assert (plan.global_batch, plan.lr, plan.lr_min) == (128, 0.2, 0.01)
    assert plan.schedule == LRSchedule(0.2, 90, "step", (30, 60, 80), warmup_epochs=2.0, warmup_method="constant",
                                       warmup_decay=0.5, min_lr=0.01)


@pytest.mark.parametrize("spelling, kind", [("steplr", "step"), ("CosineAnnealingLR", "cosine"), ("linear", "linear"),
                                            ("cosine", "cosine")])
def test_lr_scheduler_takes_torchvisions_spellings(spelling, kind):
    cfg = parse("nd", ["--synthetic", "--lr-scheduler", spelling, "--lr-warmup-epochs", "3"])
    assert (cfg.lr_schedule, cfg.warmup_epochs, cfg.warmup_method, cfg.warmup_decay, cfg.lr_min) == \
        (kind, 3.0, "linear", None, 0.0)


@pytest.mark.parametrize("argv, message", [
    (["--lr", "0.1", "--lr-min", "0.2"], "argument --lr-min: 0.2 is above --lr 0.1 (both per 256 images)"),
    (["--nesterov", "--momentum", "0"], "argument --nesterov: Nesterov momentum needs a --momentum above 0"),
    (["--lr-scheduler", "onecycle"], "argument --lr-schedule/--lr-scheduler: invalid choice: 'onecycle'"),
    (["--lr-warmup-decay", "1.5"], "argument --lr-warmup-decay: expected a factor in (0, 1], got 1.5"),
    (["--clip-grad-norm", "0"], "argument --clip-grad-norm: expected a positive number, got 0"),
    (["--norm-weight-decay", "-1"], "argument --norm-weight-decay: expected a number >= 0, got -1"),
])
def test_the_command_line_refuses_what_cannot_train(argv, message):
    with pytest.raises(UsageError) as refused:
        parse("nd", ["--synthetic", *argv])
    assert str(refused.value).startswith(message)


# --- weight decay per parameter group ---

def _small_model():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4, 5),
                         nn.LayerNorm(5))


def _sgd(model, **options):
    return engine.sgd(model, 0.5, 0.9, 0.01, **options)


def _members(model, **options):
    """{group kind: (weight decay, [parameter names])} of the groups of _sgd(model, **options)."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    return {group.get("group", "all"): (group["weight_decay"], [names[id(p)] for p in group["params"]])
            for group in _sgd(model, **options).param_groups}


def test_the_default_is_the_one_group_of_before():
    model = _small_model()
    optimizer = _sgd(model, nesterov=False, norm_weight_decay=None, bias_weight_decay=None)
    assert len(optimizer.param_groups) == 1 and "group" not in optimizer.param_groups[0]
    assert optimizer.param_groups[0]["params"] == list(model.parameters())
    assert optimizer.param_groups[0]["foreach"] is True and not optimizer.param_groups[0]["nesterov"]


def test_norm_layers_and_biases_get_their_own_groups_as_torchvisions_set_weight_decay():
    model = _small_model()
    assert _members(model, norm_weight_decay=0.0) == {
        "other": (0.01, ["0.weight", "0.bias", "4.weight", "4.bias"]),
        "norm": (0.0, ["1.weight", "1.bias", "5.weight", "5.bias"])}
    # Alone, --bias-weight-decay takes every bias, the normalisation layers' too (torchvision's rule).
    assert _members(model, bias_weight_decay=0.001) == {
        "other": (0.01, ["0.weight", "1.weight", "4.weight", "5.weight"]),
        "bias": (0.001, ["0.bias", "1.bias", "4.bias", "5.bias"])}
    assert _members(model, norm_weight_decay=0.0, bias_weight_decay=0.001) == {
        "other": (0.01, ["0.weight", "4.weight"]), "norm": (0.0, ["1.weight", "1.bias", "5.weight", "5.bias"]),
        "bias": (0.001, ["0.bias", "4.bias"])}
    # A model without normalisation layers: no empty group.
    assert list(_members(nn.Linear(2, 2), norm_weight_decay=0.0)) == ["other"]


@pytest.mark.parametrize("norm_decay", [0.0, 0.04])
def test_a_norm_weight_with_no_gradient_shrinks_by_lr_times_its_decay(norm_decay):
    model = _small_model()
    optimizer = _sgd(model, norm_weight_decay=norm_decay)
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    for name, parameter in model.named_parameters():
        decay = norm_decay if name.startswith(("1.", "5.")) else 0.01
        assert torch.allclose(parameter, before[name] * (1 - 0.5 * decay), rtol=0, atol=1e-7), name
    assert torch.equal(model[1].weight, before["1.weight"]) == (norm_decay == 0.0)


def test_nesterov_is_torchs_formula():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    start = [parameter.detach().clone() for parameter in model.parameters()]
    optimizer = engine.sgd(model, 0.1, 0.9, 0.01, nesterov=True)
    gradients = [[torch.randn_like(parameter) for parameter in model.parameters()] for _ in range(2)]
    for grads in gradients:
        for parameter, grad in zip(model.parameters(), grads):
            parameter.grad = grad.clone()
        optimizer.step()
    for index, parameter in enumerate(model.parameters()):
        weight, buffer = start[index].clone(), None
        for grads in gradients:
            grad = grads[index] + 0.01 * weight
            buffer = grad if buffer is None else 0.9 * buffer + grad
            weight = weight - 0.1 * (grad + 0.9 * buffer)
        assert torch.allclose(parameter, weight, rtol=0, atol=1e-7)


def _saved(tmp_path, model, optimizer, config):
    state = checkpoint.training_state(
        model=model, optimizer=optimizer, precision_state={}, epoch=1, step=0, images_done=0, partial_epoch=None,
        best_acc1=10.0, best_epoch=0, arch="resnet18", classes=["a", "b"], config=config, world_size=1,
        global_batch=256, lr=0.1, seed=0)
    return checkpoint.save(state, tmp_path, is_best=False)


class _Policy:
    def load_state_dict(self, state):
        pass


class _Log:
    def info(self, message):
        pass


def _resume(path, model, optimizer, *flags):
    cfg = parse("nd", ["--synthetic", "-a", "resnet18", "--resume", str(path), *flags])
    return checkpoint.resume(cfg, CPU, model, optimizer, _Policy(), ["a", "b"], _Log(), global_batch=256, lr=0.1,
                             auto_dir=None)


def test_a_resume_refuses_another_grouping_and_keeps_this_runs_decays(tmp_path):
    model = _small_model()
    optimizer = _sgd(model, norm_weight_decay=0.0)
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()  # momentum buffers to carry
    path = _saved(tmp_path, model, optimizer, {"norm_weight_decay": 0.0})
    for flags, options in ((["--bias-weight-decay", "0"], {"bias_weight_decay": 0.0}), ([], {})):
        with pytest.raises(UsageError, match=r"^argument --resume: the optimizer state in .* has the parameter groups "
                                             r"other, norm, this run's are (other, bias|all); give the "
                                             r"--norm-weight-decay and --bias-weight-decay of the checkpoint's run"):
            _resume(path, _small_model(), _sgd(_small_model(), **options), *flags)
    resumed = _small_model()
    optimizer = _sgd(resumed, norm_weight_decay=0.001, nesterov=True)
    _resume(path, resumed, optimizer, "--norm-weight-decay", "0.001", "--nesterov")
    assert [(group["group"], group["weight_decay"], group["nesterov"]) for group in optimizer.param_groups] == \
        [("other", 0.01, True), ("norm", 0.001, True)]  # this run's values, not the checkpoint's
    assert torch.equal(optimizer.state[resumed[1].weight]["momentum_buffer"], torch.ones(4))


def test_a_resume_with_another_blurpool_setting_says_so(tmp_path):
    model = _small_model()
    path = _saved(tmp_path, model, _sgd(model), {"blurpool": True})
    with pytest.raises(UsageError, match=r"holds a model trained with --blurpool; add --blurpool$"):
        _resume(path, _small_model(), _sgd(_small_model()))


# --- gradient clipping, in the precision policies ---

def _gradients(model):
    return torch.cat([parameter.grad.flatten() for parameter in model.parameters()])


def _model_and_loss(scale):
    torch.manual_seed(1)
    model = nn.Linear(4, 3)
    inputs, target = torch.randn(8, 4), torch.randint(0, 3, (8,))
    return model, lambda: scale * nn.functional.cross_entropy(model(inputs), target)


@pytest.mark.parametrize("scale, clipped", [(100.0, True), (0.01, False)])
def test_clipping_scales_the_summed_gradients_to_max_and_leaves_smaller_ones(scale, clipped):
    model, loss = _model_and_loss(scale)
    loss().backward()
    unclipped = 2 * _gradients(model)  # two micro-batches' sum
    model.zero_grad()
    policy = precision.FP32(clip_grad_norm=1.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    policy.backward(loss())
    policy.backward(loss())  # --accum-steps 2: clipped once, after both
    policy.step(optimizer)
    after = _gradients(model)
    if clipped:
        assert unclipped.norm() > 1.5 and after.norm().item() == pytest.approx(1.5, rel=1e-6)
        assert torch.allclose(after, unclipped * 1.5 / unclipped.norm(), rtol=1e-5)
    else:
        assert unclipped.norm() < 1.5 and torch.equal(after, unclipped)
    assert policy.describe() == "precision: fp32; gradients clipped to norm 1.5"


def test_clipping_under_the_fp16_gradscaler_unscales_first_and_keeps_its_skips():
    policy = precision.MixedPrecision("O1", torch.float16, torch.device("cpu"), clip_grad_norm=0.5)
    assert policy.scales_loss
    model, loss = _model_and_loss(100.0)
    optimizer = engine.sgd(model, 0.1, 0.0, 0.0, loss_scaling=True)
    before = [parameter.detach().clone() for parameter in model.parameters()]
    policy.backward_and_step(loss(), optimizer)
    assert _gradients(model).norm().item() == pytest.approx(0.5, rel=1e-5)  # unscaled (x 2**16 else), then clipped
    for parameter, start in zip(model.parameters(), before):
        assert torch.allclose(parameter, start - 0.1 * parameter.grad, rtol=0, atol=1e-7)
    # An overflowing gradient: a non-finite norm; the scaler skips the step and halves its scale, as without clipping.
    weights = [parameter.detach().clone() for parameter in model.parameters()]
    optimizer.zero_grad(set_to_none=True)
    policy.backward(loss())
    model.weight.grad[0, 0] = float("inf")
    policy.step(optimizer)
    assert all(torch.equal(parameter, weight) for parameter, weight in zip(model.parameters(), weights))
    status = policy.status()
    assert (status["loss_scale"], status["skipped_steps"]) == (2.0 ** 15, 1)
    assert policy.describe().endswith("; gradients clipped to norm 0.5")


def test_the_policies_of_every_script_take_the_clip():
    assert precision.build_policy("O0", None, torch.device("cpu"), clip_grad_norm=2.0).clip_grad_norm == 2.0
    assert precision.build_policy("O1", "bf16", torch.device("cpu"), clip_grad_norm=3.0).clip_grad_norm == 3.0
    assert precision.FP32().clip_grad_norm is None


# --- BlurPool ---

def test_the_blur_keeps_a_constant_image_and_spreads_a_point_as_1_2_1():
    blur = Blur(3)
    constant = torch.full((2, 3, 7, 5), 0.7)
    assert torch.allclose(blur(constant), constant, rtol=0, atol=1e-7)
    point = torch.zeros(1, 3, 5, 5)
    point[0, :, 2, 2] = 16.0
    expected = torch.zeros(5, 5)
    expected[1:4, 1:4] = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]])
    assert all(torch.equal(blur(point)[0, channel], expected) for channel in range(3))
    assert list(blur.parameters()) == [] and blur.state_dict() == {}  # a fixed buffer, not saved


@pytest.mark.parametrize("arch, blurs", [("resnet50", 6), ("mobilenet_v3_small", 4)])
def test_blurpool_goes_before_every_strided_convolution_of_16_channels_or_more(arch, blurs):
    with torch.device("meta"):  # shapes and counts only
        plain, blurred = build_model(arch, 10, image_size=64), build_model(arch, 10, image_size=64, blurpool=True)
        assert blurred(torch.empty(2, 3, 64, 64)).shape == plain(torch.empty(2, 3, 64, 64)).shape
    wrapped = [module for module in blurred.modules() if isinstance(module, nn.Sequential)
               and len(module) == 2 and isinstance(module[0], Blur)]
    assert len(wrapped) == blurs
    assert all(conv.in_channels == blur.kernel.shape[0] and max(conv.stride) > 1 and conv.in_channels >= 16
               for blur, conv in wrapped)
    assert sum(p.numel() for p in blurred.parameters()) == sum(p.numel() for p in plain.parameters())


def test_blurpool_on_resnet18_trains_the_same_parameters_to_the_same_shapes():
    torch.manual_seed(0)
    plain = build_model("resnet18", 7, image_size=32)
    torch.manual_seed(0)
    blurred = build_model("resnet18", 7, image_size=32, blurpool=True)
    images = torch.randn(2, 3, 32, 32)
    assert blurred(images).shape == plain(images).shape == (2, 7)
    assert not torch.allclose(blurred(images), plain(images))  # the blur is in the path
    assert [p.shape for p in blurred.parameters()] == [p.shape for p in plain.parameters()]
    assert "layer2.0.conv1.1.weight" in blurred.state_dict() and len(blurred.state_dict()) == len(plain.state_dict())
    assert sum(isinstance(module, Blur) for module in blurred.modules()) == 6


def test_blurpool_is_refused_where_it_cannot_apply_or_the_maps_are_too_small():
    with pytest.raises(UsageError, match=r"^argument --blurpool: vgg11 has no convolution with a stride above 1 and "
                                         r"16 or more input channels to blur before; leave --blurpool out$"):
        build_model("vgg11", 10, image_size=32, blurpool=True)
    with pytest.raises(UsageError, match=r"^argument --image-size: resnet18 with --blurpool cannot take 16-pixel "
                                         r"images \(.*Padding size should be less than"):
        build_model("resnet18", 10, image_size=16, blurpool=True)
