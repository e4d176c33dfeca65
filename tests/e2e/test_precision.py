"""Mixed precision: the Apex opt levels with native AMP, loss scaling that
skips an overflowing step on every rank, the scaler in checkpoints, and
imagenet_ddp_apex.py launched as the Apex tutorial launches it."""
import json
import math
import platform
import sys

import pytest
import torch
from torch import nn

from common import cli, hardware
from common.errors import UsageError
from common.engine import sgd_implementation
from common.precision import FP32, NEVER_GROW, MixedPrecision, build_policy
from helpers import (ENV, MODEL, REPO, cpu_has_native_bf16, finish, free_port, load_checkpoint, make_image_folder,
                     max_abs_diff, metrics, metrics_rows, run_command, run_script, single_run_dir, start, weights)

CPU = torch.device("cpu")


# --- the opt levels ---

def test_opt_levels_and_their_apex_defaults():
    assert isinstance(build_policy("O0", None, CPU), FP32)
    o1 = build_policy("O1", None, CPU)
    assert (o1.dtype, o1.scaler.is_enabled(), o1.channels_last) == (torch.bfloat16, False, False)  # bf16 on the CPU
    fp16 = build_policy("O1", "fp16", CPU)
    assert fp16.scaler.is_enabled() and fp16.scaler.get_scale() == 2.0**16
    assert fp16.scaler.get_growth_interval() == 2000  # dynamic
    static = build_policy("O2", "fp16", CPU, loss_scale=128.0)
    assert static.scaler.get_scale() == 128.0 and static.scaler.get_growth_interval() == NEVER_GROW
    o3 = build_policy("O3", "fp16", CPU)
    assert not o3.scaler.is_enabled() and o3.keep_batchnorm_fp32 is False  # Apex: O3 trains unscaled


NATIVE_BF16 = hardware.HalfSupport("cpu", "AVX512", bf16_native=True, fp16_native=False)
EMULATED = hardware.HalfSupport("cpu", "AVX2", bf16_native=False, fp16_native=False)


def test_auto_takes_the_fastest_level_that_is_native_here():
    native = build_policy("auto", None, CPU, support=NATIVE_BF16)
    assert (native.opt_level, native.dtype, native.warning) == ("O1", torch.bfloat16, None)
    assert native.describe().startswith("precision: Apex opt level O1 with native AMP, bf16 (--opt-level auto: "
                                        "bf16 is native on this CPU (AVX512))")
    emulated = build_policy("auto", None, CPU, support=EMULATED)
    assert isinstance(emulated, FP32) and emulated.opt_level == "O0" and emulated.warning is None
    assert emulated.describe() == ("precision: fp32 (--opt-level auto: bf16 is emulated on this CPU (AVX2), slower "
                                   "than fp32; --opt-level O1 would use it anyway)")
    asked_fp16 = build_policy("auto", "fp16", CPU, support=NATIVE_BF16)  # the half type asked for decides
    assert isinstance(asked_fp16, FP32)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_an_asked_half_type_that_is_emulated_runs_with_one_warning(level):
    policy = build_policy(level, None, CPU, support=EMULATED)
    assert (policy.opt_level, policy.dtype) == (level, torch.bfloat16)  # still what was asked
    assert policy.warning == (
        f"warning: bf16 is emulated on this CPU (AVX2; native bf16 needs AVX512, best with AVX512-BF16 or AMX): "
        f"expect --opt-level {level} to train much slower than fp32 (16x for ResNet-18 on a 2-core AVX2 EPYC); "
        f"--opt-level O0 trains in fp32 at full speed")
    assert build_policy(level, None, CPU, support=NATIVE_BF16).warning is None
    fp16 = build_policy(level, "fp16", CPU, support=NATIVE_BF16).warning  # fp16 has its own instructions
    assert fp16.startswith("warning: fp16 is emulated on this CPU (AVX512; native fp16 needs AVX512-FP16 or AMX-FP16)")
    assert build_policy("O0", None, CPU, support=EMULATED).warning is None


def test_the_hardware_answer_follows_pytorchs_capability_caps(monkeypatch):
    monkeypatch.setattr(hardware.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(hardware, "_onednn_supports", lambda check: True)  # a CPU with AMX, as oneDNN says
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    assert hardware.cpu_half_support() == hardware.HalfSupport("cpu", "AVX512", True, True, None)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert hardware.cpu_half_support().bf16_native  # a cap above AVX512 leaves it native
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert hardware.cpu_half_support() == hardware.HalfSupport("cpu", "AVX512", False, False, "ONEDNN_MAX_CPU_ISA=AVX2")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # what ATen then reports:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert hardware.cpu_half_support() == hardware.HalfSupport("cpu", "AVX2", False, False, "ATEN_CPU_CAPABILITY=avx2")
    described = hardware.describe(CPU)
    assert (described["cpu_capability"], described["cpu_bf16_native"]) == ("AVX2", False)


def _overflow_then_a_good_step(implementation: dict):
    """One SGD parameter under a dynamic fp16 GradScaler: a first step whose
    gradient overflows (the scaler skips it), then a finite one. Returns the
    weights after the skip, the momentum state then, and the final weights."""
    weight = nn.Parameter(torch.tensor([1.0, -2.0, 3.0, -4.0]))
    optimizer = torch.optim.SGD([weight], lr=0.1, momentum=0.9, **implementation)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for factor in (torch.tensor([float("inf"), 1.0, 1.0, 1.0]), torch.ones(4)):
        optimizer.zero_grad()
        scaler.scale((weight * factor).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        if factor.isinf().any():
            after_skip, state = weight.detach().clone(), dict(optimizer.state[weight])
    return after_skip, state, weight.detach()


@pytest.mark.parametrize("on_gpu", [False, True])
def test_sgd_under_fp16_loss_scaling_survives_the_skipped_first_steps(on_gpu):
    """The optimizer the engine picks under a GradScaler leaves a skipped step
    without a trace, as plain SGD does (weights and momentum untouched), and
    the next step equals plain SGD's. torch's fused SGD, which the engine
    uses on GPUs without loss scaling, fails this: it keeps a momentum buffer
    of uninitialised memory from the skipped step (NaN weights in an fp16
    ResNet-50 run on an H100 at step 3; its CPU kernel does the same, but
    what that memory holds varies, so it is not asserted here)."""
    assert sgd_implementation(on_gpu, loss_scaling=False) == ({"fused": True} if on_gpu else {"foreach": True})
    chosen = sgd_implementation(on_gpu, loss_scaling=True)
    after_skip, state, final = _overflow_then_a_good_step(chosen)
    assert torch.equal(after_skip, torch.tensor([1.0, -2.0, 3.0, -4.0])) and "momentum_buffer" not in state
    plain_skip, _, plain_final = _overflow_then_a_good_step({"foreach": False})
    assert torch.equal(final, plain_final) and torch.equal(final, torch.tensor([0.9, -2.1, 2.9, -4.1]))


def test_the_apex_script_tells_the_optimizer_when_a_loss_scaler_may_skip_steps():
    assert build_policy("O1", "fp16", CPU).scales_loss and build_policy("O2", "fp16", CPU).scales_loss
    assert not build_policy("O1", "bf16", CPU).scales_loss and not build_policy("O3", "fp16", CPU).scales_loss
    assert not FP32().scales_loss
    assert "loss_scaling=policy.scales_loss" in (REPO / "imagenet_ddp_apex.py").read_text()


def test_o3_casts_the_model_and_its_inputs_keeping_batchnorm_fp32_on_request():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))
    model(torch.zeros(1, 3, 8, 8))  # materialise the lazy layer
    policy = build_policy("O3", "bf16", CPU, keep_batchnorm_fp32=True)
    model = policy.prepare_model(model)
    assert model[0].weight.dtype == torch.bfloat16 and model[3].weight.dtype == torch.bfloat16
    assert model[1].weight.dtype == torch.float32 and model[1].running_mean.dtype == torch.float32
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model[0].weight.detach().clone()
    with policy.autocast():
        loss = model(torch.randn(2, 3, 8, 8)).float().mean()  # fp32 input cast by the policy
    policy.backward_and_step(loss, optimizer)  # a training step with half weights and fp32 BatchNorm
    assert model[0].weight.dtype == torch.bfloat16 and not torch.equal(model[0].weight, before)
    model.eval()
    assert model(torch.randn(2, 3, 8, 8)).dtype == torch.bfloat16


@pytest.mark.parametrize("args, message", [
    (("O3", "fp16", CPU, None, "dynamic"), "argument --loss-scale: O3 keeps no fp32 master weights"),
    (("O1", "fp16", CPU, False, None), "argument --keep-batchnorm-fp32: O1 keeps fp32 weights"),
])
def test_impossible_combinations_are_one_line_errors(args, message):
    with pytest.raises(UsageError, match=message):
        build_policy(*args)


def test_apex_flag_spellings_parse():
    cfg = cli.parse("ddp_apex", ["--synthetic", "--b", "208", "--workers", "20", "--opt-level", "O2",
                                 "--keep-batchnorm-fp32", "True", "--loss-scale", "128.0", "--local_rank=3"])
    assert (cfg.batch_size, cfg.workers, cfg.opt_level, cfg.keep_batchnorm_fp32, cfg.loss_scale, cfg.local_rank) == \
        (208, 20, "O2", True, 128.0, 3)
    assert cli.parse("ddp_apex", ["--synthetic", "--loss-scale", "dynamic"]).loss_scale == "dynamic"
    assert cli.parse("ddp_apex", ["--synthetic"]).opt_level == "auto"  # resolved by build_policy, on the device
    assert cli.parse("nd", ["--synthetic", "--b", "7"]).batch_size == 7  # --b means -b in every script
    for bad in (["--loss-scale", "big"], ["--keep-batchnorm-fp32", "yes"], ["--opt-level", "O4"]):
        with pytest.raises(UsageError):
            cli.parse("ddp_apex", ["--synthetic", *bad])


# --- an overflowing step is skipped on every rank ---

def _overflow_on_rank0_at_step_1(rank, port, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = MixedPrecision("O1", torch.float16, CPU)
    history = [{"weight": model.module.weight.detach().clone()}]
    for step in range(3):
        with policy.autocast():  # mean, small inputs: the scaled fp16 gradients of a normal step stay finite
            loss = model(torch.full((2, 4), 0.01 * (rank + 1))).float().mean()
        if step == 1 and rank == 0:
            loss = loss * float("inf")  # one rank's gradient overflows; DDP averages it into everyone's
        policy.backward_and_step(loss, optimizer)
        history.append({"weight": model.module.weight.detach().clone(), **policy.status()})
    torch.save(history, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_an_overflow_skips_the_step_on_every_rank_and_halves_the_scale(tmp_path):
    import torch.multiprocessing as mp

    port = free_port()
    # spawn, not fork: this process has run OpenMP-threaded ops already, which a forked child can hang on.
    mp.start_processes(_overflow_on_rank0_at_step_1, args=(port, tmp_path), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    for initial, *steps in ranks:
        assert not torch.equal(steps[0]["weight"], initial["weight"])  # step 0 applied
        assert torch.equal(steps[1]["weight"], steps[0]["weight"])  # step 1 skipped: weights unchanged
        assert not torch.equal(steps[2]["weight"], steps[1]["weight"])  # step 2 applied again
        assert [entry["loss_scale"] for entry in steps] == [2.0**16, 2.0**15, 2.0**15]
        assert [entry["skipped_steps"] for entry in steps] == [0, 1, 1]
    assert torch.equal(ranks[0][-1]["weight"], ranks[1][-1]["weight"])


def test_scaler_state_round_trips():
    policy = build_policy("O1", "fp16", CPU, loss_scale=1024.0)
    policy.skipped_steps = 3
    other = build_policy("O1", "fp16", CPU)
    other.load_state_dict(policy.state_dict())
    assert other.status() == {"loss_scale": 1024.0, "skipped_steps": 3, "skipped_since_start": 0}
    assert other.scaler.get_growth_interval() == NEVER_GROW


# --- imagenet_ddp_apex.py end to end ---

APEX = REPO / "imagenet_ddp_apex.py"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("apex") / "data")


@pytest.mark.slow
def test_o0_is_imagenet_ddp(data, tmp_path):
    common = [data, *MODEL, "-b", "4", "-j", "0", "--epochs", "1", "--nproc-per-node", "2"]
    ddp = run_script([REPO / "imagenet_ddp.py", *common, "--logdir", tmp_path / "ddp"], env_extra=ENV)
    apex = run_script([APEX, *common, "--opt-level", "O0", "--logdir", tmp_path / "apex"], env_extra=ENV)
    assert ddp.returncode == 0 and apex.returncode == 0, ddp.stderr + apex.stderr
    apex_run = single_run_dir(tmp_path / "apex")
    assert max_abs_diff(weights(apex_run), weights(single_run_dir(tmp_path / "ddp"))) <= 1e-6
    assert apex_run.name.endswith("_optO0")


def test_the_tutorial_launch_lines_run(data, tmp_path):
    port = free_port()
    tutorial = ["-a", "squeezenet1_1", "--b", "4", "--workers", "1", "--opt-level", "O1", "--image-size", "32",
                "--val-resize", "32", "--epochs", "1", "--steps-per-epoch", "2", "-p", "1", data]
    launch = [sys.executable, "-m", "torch.distributed.launch"]
    one_node = [start([*launch, "--nproc_per_node=2", f"--master_port={port}", APEX, *tutorial,
                       "--logdir", tmp_path / "one"])]
    two_nodes = [start([*launch, "--nproc_per_node=1", "--nnodes=2", f"--node_rank={node}",
                        "--master_addr=127.0.0.1", f"--master_port={port + 1}", APEX, *tutorial,
                        "--logdir", tmp_path / "two"]) for node in (1, 0)]
    torchrun = [start([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                       "--master-port", str(port + 2), APEX, *tutorial, "--logdir", tmp_path / "torchrun"])]
    outputs = finish(one_node + two_nodes + torchrun)
    # Said once per job by its primary process, and only where bf16 is emulated (AVX2-only CPUs).
    warned = [output.count("warning: bf16 is emulated") for output in outputs]
    assert warned == ([0] * 4 if cpu_has_native_bf16() else [1, 0, 1, 1]), warned  # two nodes: node 0 says it
    for name in ("one", "two", "torchrun"):
        run_dir = single_run_dir(tmp_path / name)
        assert run_dir.name.endswith("_squeezenet1_1_cpux2_b4_cpu1_optO1"), run_dir.name
        config = json.loads((run_dir / "config.json").read_text())
        assert config["resolved"]["precision"] == "O1 bf16" and config["resolved"]["global_batch"] == 8
        assert [int(row["images"]) for row in metrics(run_dir)] == [2 * 8, 9]  # 2 steps of the global batch


# PyTorch's and oneDNN's own caps: bf16 (and fp16) emulated on any x86 CPU, as on an AVX2-only one.
EMULATED_HALF = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the caps are x86 instruction sets")
def test_an_emulated_half_type_is_said_once_at_the_start_and_recorded(data, tmp_path):
    tiny = [data, *MODEL, "-b", "4", "-j", "0", "--epochs", "1", "--steps-per-epoch", "1"]
    env = dict(ENV, **EMULATED_HALF)
    asked = run_script([APEX, *tiny, "--opt-level", "O1", "--nproc-per-node", "2", "--logdir", tmp_path / "asked"],
                       env_extra=env)
    assert asked.returncode == 0, asked.stderr
    said = [line for line in asked.stdout.splitlines() if "is emulated" in line]
    assert len(said) == 1, said  # two processes, one line: the primary's
    assert said[0].startswith("warning: bf16 is emulated on this CPU (AVX2, capped by ONEDNN_MAX_CPU_ISA=AVX2; native "
                              "bf16 needs AVX512") and "--opt-level O0 trains in fp32" in said[0]
    lines = asked.stdout.splitlines()
    assert lines.index(said[0]) < next(index for index, line in enumerate(lines) if line.startswith("train epoch 0"))
    config = json.loads((single_run_dir(tmp_path / "asked") / "config.json").read_text())
    assert config["resolved"]["precision"] == "O1 bf16" and config["resolved"]["precision_warning"] == said[0]
    environment = config["environment"]
    assert (environment["cpu_capability"], environment["cpu_bf16_native"], environment["cpu_fp16_native"],
            environment["cpu_capped_by"]) == ("AVX2", False, False, "ONEDNN_MAX_CPU_ISA=AVX2")

    # Left to choose (--opt-level auto, the default), the script trains in fp32 here, and says why, as no warning.
    chosen = run_script([APEX, *tiny, "--nproc-per-node", "1", "--logdir", tmp_path / "auto"], env_extra=env)
    assert chosen.returncode == 0, chosen.stderr
    assert "warning:" not in chosen.stdout
    assert "precision: fp32 (--opt-level auto: bf16 is emulated on this CPU (AVX2)" in chosen.stdout
    run_dir = single_run_dir(tmp_path / "auto")
    config = json.loads((run_dir / "config.json").read_text())
    assert run_dir.name.endswith("_optO0") and config["options"]["opt_level"] == "O0"
    assert config["resolved"]["precision"] == "fp32" and config["resolved"]["precision_warning"] is None


FP16_RUN = [*MODEL, "-b", "4", "-j", "0", "--epochs", "2", "--opt-level", "O1", "--amp-dtype", "fp16",
            # A scale far too big for fp16: the first steps overflow, so skips and halvings happen
            # in epoch 0 and the scaler's state at the checkpoint matters.
            "--loss-scale", str(2.0**40)]


def precision_state(run_dir):
    return load_checkpoint(run_dir / "checkpoint.pth.tar")["precision"]


@pytest.mark.slow
def test_resume_continues_the_loss_scale_and_weights_exactly(data, tmp_path):
    whole = run_script([APEX, data, *FP16_RUN, "--logdir", tmp_path / "whole"], env_extra=ENV)
    assert whole.returncode == 0, whole.stderr
    first = run_script([APEX, data, *FP16_RUN, "--epochs", "1", "--logdir", tmp_path / "parts"], env_extra=ENV)
    assert first.returncode == 0, first.stderr
    part_dir = single_run_dir(tmp_path / "parts")
    after_epoch_0 = precision_state(part_dir)
    assert after_epoch_0["skipped_steps"] > 0 and after_epoch_0["scaler"]["scale"] < 2.0**40
    rest = run_script([APEX, data, *FP16_RUN, "--resume", part_dir / "checkpoint.pth.tar"], env_extra=ENV)
    assert rest.returncode == 0, rest.stderr
    whole_dir = single_run_dir(tmp_path / "whole")
    assert precision_state(part_dir) == precision_state(whole_dir)
    assert max_abs_diff(weights(part_dir), weights(whole_dir)) <= 1e-6
    train = [row for row in metrics_rows(whole_dir) if row["split"] == "train"]
    assert float(train[-1]["loss_scale"]) == precision_state(whole_dir)["scaler"]["scale"]
    assert int(train[-1]["skipped_steps"]) == precision_state(whole_dir)["skipped_steps"]
    assert "normal while the loss scale finds its level" in whole.stdout
    assert all(math.isfinite(float(row["loss"])) for row in train)


@pytest.mark.slow
@pytest.mark.skipif(not cpu_has_native_bf16(), reason="bf16 is emulated on this CPU: the 8-epoch demo in bf16 "
                                                       "takes over 30 minutes (it takes ~2 where bf16 is native)")
def test_o1_bf16_trains_the_digits_as_well_as_fp32(tmp_path):
    """The demo's recipe under imagenet_ddp_apex.py --opt-level O1 (bf16 on the CPU), at 32 px for 6
    epochs (test_demo runs the whole demo in fp32; this took 2 minutes at its 48 px and 8 epochs)."""
    result = run_command(["bash", "run_scripts/demo.sh", "--opt-level", "O1", "--image-size", "32",
                          "--val-resize", "36", "--epochs", "6"],
                         env_extra={"PYTHON": sys.executable, "SCRIPT": "imagenet_ddp_apex.py",
                                    "DATA": str(tmp_path / "digits"), "LOGDIR": str(tmp_path / "runs")},
                         timeout=1800)
    assert result.returncode == 0, result.stderr
    run_dir = single_run_dir(tmp_path / "runs")
    assert run_dir.name.endswith("_optO1")
    val = [row for row in metrics(run_dir) if row["split"] == "val"]
    assert len(val) == 6 and int(val[-1]["images"]) == 359
    assert float(val[-1]["top1"]) >= 95.0, [row["top1"] for row in val]
