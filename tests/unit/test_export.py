"""python -m common.tools.export: a run's weights as safetensors, ONNX and
TorchScript files whose outputs equal the checkpoint's model's (ONNX through
onnxruntime), loaded by plain code in a process that cannot import this
project; the card's fields against the checkpoint, metrics.csv and the run's
records; EMA weights; each mistake one line with nothing written.

The run directories are written here through the project's own save path
(checkpoint.training_state, checkpoint.save), with hand-chosen figures."""
import contextlib
import csv
import hashlib
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from common import architectures, checkpoint, models
from common.cli import parse
from common.ema import ModelEMA
from common.errors import UsageError
from common.rundir import BEST_NAME
from common.tools import export
from helpers import FAST_ARGS, REPO, assert_one_line_error, make_image_folder, metrics_rows

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")  # torch 2.14 warns at each use

CLASSES = ["cat", "dog", "eel"]
FLAGS = ["--synthetic", "-a", "resnet18", "--image-size", "32", "--val-resize", "36", "--lr", "0.2"]
BEST_TOP1, BEST_TOP5 = 66.67, 100.0  # metrics.csv's val row of epoch 2, the checkpoint's best
EMA_TOP1, EMA_TOP5 = 70.0, 95.5  # its val_ema row
COMMIT, RESUMED_COMMIT = "a" * 40, "b" * 40  # config.json's code, and the resume's (from epoch 2) that saved it


def _trained_model(seed: int, *flags) -> torch.nn.Module:
    """resnet18 for 3 classes with random weights and BatchNorm statistics (so evaluation mode matters)."""
    torch.manual_seed(seed)
    model = models.build_model("resnet18", len(CLASSES), image_size=32, blurpool="--blurpool" in flags)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "running_var" in name:
                tensor.uniform_(0.5, 2.0)
            elif "running_mean" in name:
                tensor.normal_(0, 0.1)
    return model


def write_run(run_dir, *flags, epoch=3, step=0, images_done=0, channels_last=False):
    """A run directory as a run leaves it: a checkpoint at (epoch, step), model_best.pth.tar when at an
    epoch's end, config.json, a resume's line in resumes.jsonl, metrics.csv. With --model-ema, the average is
    the weights before a last change, so it differs from the model's."""
    cfg = parse("nd", [*FLAGS, *flags])
    model = _trained_model(0, *flags)
    ema = ModelEMA(model, decay=0.5, every_steps=1) if cfg.model_ema else None
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    state = checkpoint.training_state(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), precision_state={},
        epoch=epoch, step=step, images_done=images_done, partial_epoch=None, best_acc1=BEST_TOP1,
        best_epoch=epoch - 1, arch="resnet18", classes=CLASSES, config=cfg.to_dict(), world_size=1, global_batch=4,
        lr=0.2, seed=0, model_ema=ema.state_dict() if ema else None, best_source="model")
    run_dir.mkdir(exist_ok=True)
    saved = checkpoint.save(state, run_dir, is_best=not step)
    record = {"command": "python imagenet_nd.py --synthetic", "start_epoch": 0, "start_step": 0,
              "options": cfg.to_dict(), "environment": {"git_commit": COMMIT, "git_dirty": False}}
    (run_dir / "config.json").write_text(json.dumps(record))
    resumed = {**record, "start_epoch": 2, "environment": {"git_commit": RESUMED_COMMIT, "git_dirty": True}}
    (run_dir / "resumes.jsonl").write_text(json.dumps(resumed) + "\n")
    with open(run_dir / "metrics.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerows([["epoch", "split", "loss", "top1", "top5"], [1, "val", 1.0, 50.0, 90.0],
                          [2, "val", 0.9, BEST_TOP1, BEST_TOP5], [2, "val_ema", 0.8, EMA_TOP1, EMA_TOP5]])
    return saved, checkpoint.load(str(saved))


@pytest.fixture
def run(tmp_path):
    path, state = write_run(tmp_path / "run", "--model-ema")
    return {"dir": tmp_path / "run", "path": path, "state": state}


def exported(tmp_path, source, format_name, *flags, name=None):
    """OUT, its card and what was printed, after `python -m common.tools.export SOURCE --format FORMAT OUT FLAGS`."""
    out = tmp_path / (name or f"model.{format_name}")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        export.main([str(source), "--format", format_name, str(out), *flags])
    return out, json.loads((tmp_path / f"{out.name}.json").read_text()), printed.getvalue()


# The files each test reads, exported once for the module (ONNX's exporter takes seconds); a format whose
# package is missing is left out, and its tests skip naming requirements-export.txt.
SHIPPED = {"model.safetensors": ("safetensors",), "ema.safetensors": ("safetensors", "--weights", "ema"),
           "model.onnx": ("onnx", "--check-inputs", "3"), "model.torchscript": ("torchscript", "--check-inputs", "3")}


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shipped")
    path, state = write_run(folder / "run", "--model-ema")
    files = {}
    for name, (format_name, *flags) in SHIPPED.items():
        if all(importlib.util.find_spec(package) for package in export.FORMAT_PACKAGES[format_name]):
            files[name] = exported(folder, folder / "run", format_name, *flags, name=name)
    return {"folder": folder, "dir": folder / "run", "path": path, "state": state, "files": files}


def shipped_file(shipped, name):
    """(OUT, card, printed) of one of SHIPPED's exports; skipped where its format's package is missing."""
    if name not in shipped["files"]:
        pytest.skip(f"{SHIPPED[name][0]} needs {', '.join(export.FORMAT_PACKAGES[SHIPPED[name][0]])}: "
                    f"pip install -r requirements-export.txt")
    return shipped["files"][name]


def reference_logits(state: dict, weights: str, images: torch.Tensor) -> torch.Tensor:
    """The checkpoint's model, with its weights or its average's, on `images`."""
    model = models.build_model("resnet18", len(CLASSES), image_size=32).eval()
    model.load_state_dict(state["state_dict"] if weights == "model" else state["model_ema"]["state_dict"])
    with torch.no_grad():
        return model(images)


def test_safetensors_holds_the_checkpoints_weights_and_the_card_its_facts(shipped):
    from safetensors.torch import load_file

    out, card, printed = shipped_file(shipped, "model.safetensors")
    weights = load_file(out)
    saved = shipped["state"]["state_dict"]
    assert set(weights) == set(saved) == set(models.build_model("resnet18", 3, image_size=32).state_dict())
    assert all(torch.equal(weights[name], saved[name]) and weights[name].is_contiguous() for name in saved)
    # The card: the checkpoint's classes and architecture, metrics.csv's figures of the epoch it ended,
    # the code of the resume that was running at its position, the file's own hash.
    assert card["classes"] == CLASSES and card["num_classes"] == 3 and card["architecture"] == "resnet18"
    assert card["validation"] == {"top1": BEST_TOP1, "top5": BEST_TOP5, "epoch": 2, "split": "val",
                                  "from": "metrics.csv"}
    assert card["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest() and card["bytes"] == out.stat().st_size
    assert card["code"] == {"git_commit": RESUMED_COMMIT, "git_dirty": True, "git_diff_sha256": None,
                            "recorded_in": "resumes.jsonl line 1"}
    assert card["input"]["crop_px"] == 32 and card["input"]["resize_px"] == 36
    assert card["input"]["mean"] == [0.485, 0.456, 0.406] and card["input"]["std"] == [0.229, 0.224, 0.225]
    assert card["recipe"]["options"]["lr"] == 0.2 and card["recipe"]["options"]["image_size"] == 32
    assert card["checkpoint"]["file"] == str(shipped["dir"] / BEST_NAME) and card["checkpoint"]["epoch"] == 3
    assert card["weights"] == "model" and card["format"] == "safetensors"
    assert card["check"]["inputs"] == 4 and card["check"]["max_abs_difference"] == 0.0  # the same weights
    assert "torchvision.models.get_model('resnet18', num_classes=3)" in card["loads_with"]
    assert "validation top-1 66.67%" in printed and "max abs difference 0," in printed


def test_the_ema_weights_differ_from_the_models_and_are_what_is_exported(shipped):
    from safetensors.torch import load_file

    out, card, _ = shipped_file(shipped, "ema.safetensors")
    average, model = shipped["state"]["model_ema"]["state_dict"], shipped["state"]["state_dict"]
    weights = load_file(out)
    assert all(torch.equal(weights[name], average[name]) for name in average)
    assert len([name for name in model if not torch.equal(weights[name], model[name])]) == 62  # every parameter
    assert card["weights"] == "ema"
    assert card["validation"] == {"top1": EMA_TOP1, "top5": EMA_TOP5, "epoch": 2, "split": "val_ema",
                                  "from": "metrics.csv"}


@pytest.mark.parametrize("name", ["model.onnx", "model.torchscript"])
def test_the_graph_formats_answer_as_the_checkpoints_model_on_another_batch(shipped, name):
    out, card, _ = shipped_file(shipped, name)
    images = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(7))  # not the check's, nor its batch
    expected = reference_logits(shipped["state"], "model", images)
    if name.endswith(".onnx"):
        import onnxruntime

        session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        logits = torch.from_numpy(session.run(["logits"], {"images": images.numpy()})[0])
        assert card["check"]["by"].startswith("onnxruntime ") and card["opset"] >= 17
    else:
        logits = torch.jit.load(str(out))(images)
        assert card["check"]["by"] == "torch.jit.load"
    assert (logits - expected).abs().max().item() < 1e-4
    assert card["check"]["inputs"] == 3 and 0 <= card["check"]["max_abs_difference"] <= card["check"]["allowed"]
    assert card["check"]["allowed"] == pytest.approx(1e-4 * max(1.0, expected.abs().max().item()), rel=0.5)


PLAIN_LOADER = textwrap.dedent("""
    import importlib.util, json, sys
    import numpy, onnxruntime, safetensors.torch, torch, torchvision
    assert importlib.util.find_spec("common") is None, "the project is importable"
    folder = sys.argv[1]
    images = torch.from_numpy(numpy.load(folder + "/images.npy"))
    expected = torch.from_numpy(numpy.load(folder + "/expected.npy"))
    card = json.load(open(folder + "/model.safetensors.json"))
    model = torchvision.models.get_model(card["architecture"], num_classes=card["num_classes"])
    model.load_state_dict(safetensors.torch.load_file(folder + "/model.safetensors"))
    outputs = {"safetensors": model.eval()(images),
               "torchscript": torch.jit.load(folder + "/model.torchscript").eval()(images),
               "onnx": torch.from_numpy(onnxruntime.InferenceSession(folder + "/model.onnx").run(
                   ["logits"], {"images": images.numpy()})[0])}
    print(json.dumps({name: (logits - expected).abs().max().item() for name, logits in outputs.items()}))
""")


@pytest.mark.slow  # a fresh interpreter importing torch, torchvision and onnxruntime: about 8 s
def test_plain_code_outside_the_repository_loads_every_format(shipped, tmp_path):
    for name in ("model.safetensors", "model.onnx", "model.torchscript"):
        shutil.copy(shipped_file(shipped, name)[0], tmp_path)
        shutil.copy(shipped["folder"] / f"{name}.json", tmp_path)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    np.save(tmp_path / "images.npy", images.numpy())
    np.save(tmp_path / "expected.npy", reference_logits(shipped["state"], "model", images).numpy())
    (tmp_path / "load.py").write_text(PLAIN_LOADER)
    # -I: no PYTHONPATH, no user site, not the script's folder on sys.path; cwd outside the repository.
    done = subprocess.run([sys.executable, "-I", str(tmp_path / "load.py"), str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    differences = json.loads(done.stdout.strip().splitlines()[-1])
    assert differences["safetensors"] == 0.0 and differences["torchscript"] == 0.0
    assert differences["onnx"] < 1e-4


def test_wrapper_prefixes_and_channels_last_are_undone(tmp_path):
    pytest.importorskip("safetensors", reason="pip install -r requirements-export.txt")
    from safetensors.torch import load_file

    path, state = write_run(tmp_path / "run", channels_last=True)
    assert any(not tensor.is_contiguous() for tensor in state["state_dict"].values())  # NHWC convolutions
    # As DDP around torch.compile names them (checkpoints of other trainers keep them).
    state["state_dict"] = {f"module._orig_mod.{name}": tensor for name, tensor in state["state_dict"].items()}
    torch.save(state, tmp_path / "wrapped.pth.tar")
    out, card, _ = exported(tmp_path, tmp_path / "wrapped.pth.tar", "safetensors")
    weights = load_file(out)
    assert set(weights) == set(models.build_model("resnet18", 3, image_size=32).state_dict())
    assert all(tensor.is_contiguous() for tensor in weights.values())
    assert card["check"]["max_abs_difference"] == 0.0
    # No run beside it: the checkpoint's own best_acc1 (it ended the best epoch), and no record of the code.
    assert card["validation"] == {"top1": BEST_TOP1, "top5": None, "epoch": 2, "split": "val",
                                  "from": "the checkpoint's best_acc1"}
    assert card["code"]["recorded_in"] is None and card["command"] is None


def test_blurpool_weights_load_into_a_blurred_model_and_the_graph_holds_the_blur(tmp_path):
    write_run(tmp_path / "run", "--blurpool")
    out, card, _ = exported(tmp_path, tmp_path / "run", "torchscript")
    assert card["blurpool"] is True and "add_blurpool" not in card["loads_with"]  # TorchScript: self-contained
    state = checkpoint.load(str(tmp_path / "run" / BEST_NAME))
    assert "layer2.0.conv1.1.weight" in state["state_dict"]  # a blurred convolution's name
    blurred = _trained_model(0, "--blurpool").eval()
    blurred.load_state_dict(state["state_dict"])
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (torch.jit.load(str(out))(images) - blurred(images)).abs().max().item() < 1e-5
    if importlib.util.find_spec("safetensors") is not None:
        _, card, _ = exported(tmp_path, tmp_path / "run", "safetensors")
        assert "add_blurpool" in card["loads_with"] and "<name>.1.weight" in card["loads_with"]


def test_choices_of_checkpoint_and_a_mid_epoch_ones_figures(tmp_path):
    pytest.importorskip("safetensors", reason="pip install -r requirements-export.txt")
    write_run(tmp_path / "run")
    mid, _ = write_run(tmp_path / "run", epoch=4, step=2, images_done=8)  # newer, not validated
    _, card, _ = exported(tmp_path, tmp_path / "run", "safetensors", "--checkpoint", "last", name="last.safetensors")
    assert card["checkpoint"]["file"] == str(mid) and card["checkpoint"]["step"] == 2
    assert card["validation"]["top1"] is None and "within an epoch" in card["validation"]["note"]
    assert card["code"]["git_commit"] == RESUMED_COMMIT
    _, card, _ = exported(tmp_path, tmp_path / "run", "safetensors", "--checkpoint", mid.name, name="file.safetensors")
    assert card["checkpoint"]["file"] == str(tmp_path / "run" / mid.name)  # best: the other tests' default


def _listing(folder):
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


def test_each_mistake_is_one_line_and_writes_nothing(run, tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    (tmp_path / "taken.onnx").write_bytes(b"mine")
    (tmp_path / "carded.onnx.json").write_text("{}")
    bare = tmp_path / "bare"
    bare.mkdir()
    mistakes = {
        ("missing", "--format", "torchscript", "new.pt"): "RUN_OR_CHECKPOINT missing: no such file or directory",
        ("notes.txt", "--format", "torchscript", "new.pt"): "notes.txt is not a PyTorch checkpoint (text",
        ("run", "--format", "torchscript", "taken.onnx"): "taken.onnx exists; choose another name",
        ("run", "--format", "torchscript", "carded.onnx"): "carded.onnx.json exists; choose another name",
        ("run", "--format", "torchscript", "nowhere/new.pt"): "OUT nowhere/new.pt: no such folder nowhere",
        (str(run["path"]), "--format", "torchscript", "new.pt", "--checkpoint", "last"):
            "argument --checkpoint: only with a run directory",
        ("run", "--format", "torchscript", "new.pt", "--checkpoint", "other"):
            "argument --checkpoint: other is neither best, last nor a file in run",
        ("bare", "--format", "torchscript", "new.pt"): "bare: no model_best.pth.tar",
        ("bare", "--format", "torchscript", "new.pt", "--checkpoint", "last"): "bare: no readable checkpoint",
        ("run", "--format", "tflite", "new.pt"): "argument --format: invalid choice: 'tflite'",
    }
    monkeypatch.chdir(tmp_path)
    before = _listing(tmp_path)
    for argv, message in mistakes.items():
        with pytest.raises(UsageError) as raised:
            export.main(list(argv))
        assert message in str(raised.value), (argv, str(raised.value))
    write_run(tmp_path / "plain")  # no --model-ema
    before = _listing(tmp_path)
    with pytest.raises(UsageError, match=r"argument --weights: .*model_best.pth.tar holds no --model-ema average"):
        export.main(["plain", "--format", "torchscript", "new.pt", "--weights", "ema"])
    assert _listing(tmp_path) == before and (tmp_path / "taken.onnx").read_bytes() == b"mine"


@pytest.mark.parametrize("format_name, hidden, missing", [("onnx", "onnxruntime", "onnxruntime"),
                                                          ("safetensors", "safetensors.torch", "safetensors")])
def test_a_missing_package_names_the_requirements_file(run, tmp_path, monkeypatch, format_name, hidden, missing):
    monkeypatch.setitem(sys.modules, hidden, None)  # `import hidden` raises ImportError
    with pytest.raises(UsageError, match=rf"argument --format: {format_name} needs .*\(missing: {missing}\): "
                                         r"pip install -r requirements-export.txt"):
        export.main([str(run["dir"]), "--format", format_name, str(tmp_path / "new")])
    assert not (tmp_path / "new").exists() and not (tmp_path / "new.json").exists()


def test_outputs_that_differ_are_exit_status_1_and_nothing_written(run, tmp_path, monkeypatch):
    reads = export.exported_outputs

    def off_by_a_little(*args):
        logits, by = reads(*args)
        return logits + 0.01, by

    monkeypatch.setattr(export, "exported_outputs", off_by_a_little)
    with pytest.raises(export.ExportMismatch, match=r"differ from the checkpoint's by up to 0.01 \(torch.jit.load\)"
                                                    r", above the .* allowed .*; nothing written") as raised:
        export.main([str(run["dir"]), "--format", "torchscript", str(tmp_path / "m.pt")])
    assert raised.value.status == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]


def test_the_command_ends_a_mistake_with_one_line_and_status_2(run, tmp_path):
    (tmp_path / "taken.pt").write_bytes(b"mine")
    done = subprocess.run([sys.executable, "-m", "common.tools.export", str(run["dir"]), "--format", "torchscript",
                           str(tmp_path / "taken.pt")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert_one_line_error(done, "python -m common.tools.export: error: OUT", "taken.pt exists")
    assert (tmp_path / "taken.pt").read_bytes() == b"mine"


@pytest.mark.slow  # a 2-epoch training run in this process, then two exports: about 20 s
def test_a_real_runs_checkpoints_carry_the_figures_metrics_csv_has_for_them(tmp_path):
    import imagenet_nd

    data = make_image_folder(tmp_path / "data")
    imagenet_nd.main([str(data), *FAST_ARGS, "-j", "0", "--epochs", "2", "--model-ema", "--model-ema-steps", "1",
                      "--logdir", str(tmp_path / "runs"), "--run-name", "r"])
    run_dir = tmp_path / "runs" / "r"
    rows = {(int(row["epoch"]), row["split"]): row for row in metrics_rows(run_dir)}
    best = checkpoint.load(str(run_dir / BEST_NAME))
    # The best checkpoint starts the epoch after the best one, whose row scored its best_acc1.
    assert best["epoch"] == best["best_epoch"] + 1
    source_split = "val_ema" if best["best_source"] == "ema" else "val"
    assert float(rows[best["best_epoch"], source_split]["top1"]) == pytest.approx(best["best_acc1"])
    _, card, _ = exported(tmp_path, run_dir, "torchscript", "--weights", "ema", name="best.pt")
    row = rows[best["best_epoch"], "val_ema"]
    assert card["validation"] == {"top1": float(row["top1"]), "top5": float(row["top5"]), "epoch": best["best_epoch"],
                                  "split": "val_ema", "from": "metrics.csv"}
    recorded = json.loads((run_dir / "config.json").read_text())
    assert card["code"]["recorded_in"] == "config.json"
    assert card["code"]["git_commit"] == recorded["environment"]["git_commit"]
    assert card["classes"] == ["class_0", "class_1", "class_2"] and card["command"] == recorded["command"]
    _, card, _ = exported(tmp_path, run_dir, "torchscript", "--checkpoint", "last", name="last.pt")
    assert card["checkpoint"]["epoch"] == 2 and card["validation"]["top1"] == float(rows[1, "val"]["top1"])


def _write_timm_run(run_dir):
    """A run directory of timm's test_vit at 32 pixels (timm's default: 160), its model in evaluation mode."""
    cfg = parse("nd", ["--synthetic", "-a", "timm/test_vit", "--image-size", "32", "--val-resize", "32"])
    torch.manual_seed(0)
    model = models.build_model("timm/test_vit", len(CLASSES), image_size=32).eval()
    state = checkpoint.training_state(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), precision_state={}, epoch=1, step=0,
        images_done=0, partial_epoch=None, best_acc1=50.0, best_epoch=0, arch="timm/test_vit", classes=CLASSES,
        config=cfg.to_dict(), world_size=1, global_batch=4, lr=0.1, seed=0, model_ema=None, best_source="model")
    run_dir.mkdir()
    return checkpoint.save(state, run_dir, is_best=True), model


def test_a_timm_vits_card_code_loads_its_safetensors_at_the_runs_image_size(tmp_path):
    """A fixed-size timm model (a ViT's position embedding is sized by the image) built at the run's 32 pixels,
    not timm's default 160: the card's loading code must build it so, or load_state_dict refuses the file."""
    timm = pytest.importorskip("timm", reason="timm is optional: pip install -r requirements-timm.txt")
    pytest.importorskip("safetensors.torch", reason="pip install -r requirements-export.txt")
    _, model = _write_timm_run(tmp_path / "run")
    out, card, _ = exported(tmp_path, tmp_path / "run", "safetensors")
    assert card["loads_with"].startswith("model = timm.create_model('test_vit', num_classes=3, img_size=32); ")
    assert card["versions"]["timm"] == timm.__version__  # the version whose module names the weights follow
    plain = {"timm": timm, "safetensors": sys.modules["safetensors"], "FILE": str(out)}
    exec(card["loads_with"], plain)  # noqa: S102 - the card's own code, as a user pastes it
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(plain["model"](images), model(images))


def test_a_timm_checkpoint_without_timm_names_the_checkpoint_not_a_flag_export_lacks(tmp_path, monkeypatch):
    pytest.importorskip("timm", reason="timm is optional: pip install -r requirements-timm.txt")
    _write_timm_run(tmp_path / "run")
    monkeypatch.setattr(architectures, "_timm_missing", lambda: True)
    architectures.timm_architectures.cache_clear()
    try:
        with pytest.raises(UsageError) as raised:
            export.main([str(tmp_path / "run"), "--format", "torchscript", str(tmp_path / "m.pt")])
    finally:
        architectures.timm_architectures.cache_clear()
    assert str(raised.value) == (f"argument RUN_OR_CHECKPOINT: {tmp_path / 'run' / BEST_NAME} holds a timm/test_vit model: timm/test_vit is "
                                 f"one of timm's models and timm is not installed "
                                 f"(pip install -r requirements-timm.txt)")
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["run"]
