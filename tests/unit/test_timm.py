"""-a timm/NAME: timm's names listed once per timm version and read by the
command line without importing timm, the line without timm, close names from
both zoos, --dropout and --drop-path reaching the model, and pretrained
weights from a local file or Hugging Face's cache equal to the file's."""
import importlib.metadata
import json

import pytest
import torch

from common import architectures, cli
from common.errors import UsageError
from common.models import build_model, sync_batchnorm
from helpers import REPO, RunsCode, run_with_cached_architectures

timm = pytest.importorskip("timm", reason="timm is optional: pip install -r requirements-timm.txt")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors comes with timm")


def test_timm_names_are_cached_per_timm_version(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    listed = architectures._list_timm_architectures()
    assert {"test_resnet", "test_vit", "resnet50d", "test_resnet.r160_in1k"} <= set(listed)
    assert architectures.timm_architectures.__wrapped__() == listed
    version = importlib.metadata.version("timm")
    cache = tmp_path / "imagenet-reference" / "architectures" / f"timm-{version}.json"
    assert json.loads(cache.read_text()) == {"timm": version, "architectures": listed}
    monkeypatch.setattr(architectures, "_list_timm_architectures", lambda: pytest.fail("listed again"))
    assert architectures.timm_architectures.__wrapped__() == listed  # read from the cache


_PARSE_TIMM_WITHOUT_TORCH = """
import sys
from common import cli
from common.errors import UsageError
cfg = cli.parse("nd", ["-a", "timm/test_resnet.r160_in1k", "--drop-path", "0.1", "--synthetic"])
try:
    cli.parse("nd", ["-a", "resnet50d", "--synthetic"])
except UsageError as error:
    print(error)
print(cfg.arch, cfg.drop_path, sorted(name for name in sys.modules if name.startswith(("torch", "timm"))))
"""


def test_the_command_line_reads_timm_names_without_importing_timm_or_torch(tmp_path):
    done = run_with_cached_architectures(_PARSE_TIMM_WITHOUT_TORCH, tmp_path / "cache")
    assert done.returncode == 0, done.stderr[-3000:]
    mistake, parsed = done.stdout.splitlines()
    assert mistake.startswith("argument -a/--arch: unknown architecture 'resnet50d'; did you mean timm/resnet50d, ")
    assert parsed == "timm/test_resnet.r160_in1k 0.1 []"


def test_a_torchvision_run_never_lists_timms_names(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    architectures.timm_architectures.cache_clear()
    monkeypatch.setattr(architectures, "_list_timm_architectures", lambda: pytest.fail("timm listed"))
    assert cli.parse("nd", ["-a", "resnet18", "--synthetic"]).arch == "resnet18"
    architectures.timm_architectures.cache_clear()


def test_a_timm_model_without_timm_is_one_line_naming_the_requirements_file(monkeypatch, capsys):
    monkeypatch.setattr(architectures, "_timm_missing", lambda: True)
    architectures.timm_architectures.cache_clear()
    try:
        with pytest.raises(SystemExit) as stopped:
            cli.run(lambda: cli.parse("nd", ["-a", "timm/test_resnet", "--synthetic"]))
        with pytest.raises(UsageError) as unknown:
            architectures.check_architecture("resnet50d")
    finally:
        architectures.timm_architectures.cache_clear()
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(": argument -a/--arch: timm/test_resnet is one of timm's models and "
                                                 "timm is not installed (pip install -r requirements-timm.txt)"), lines
    assert "timm/" not in str(unknown.value).split("(")[0]  # no timm names to suggest
    assert str(unknown.value).endswith("timm's models need pip install -r requirements-timm.txt)")


@pytest.mark.parametrize("arch,first", [("resnet50d", "timm/resnet50d"), ("timm/vit_b_16", "vit_b_16"),
                                        ("timm/test_resnett", "timm/test_resnet"), ("resnet51", "resnet50")])
def test_unknown_names_suggest_close_names_of_both_zoos(arch, first):
    with pytest.raises(UsageError) as error:
        architectures.check_architecture(arch)
    message = str(error.value)
    assert message.startswith(f"argument -a/--arch: unknown architecture {arch!r}; did you mean {first}")
    suggested = message.split("did you mean ")[1].split("?")[0].replace(" or ", ", ").split(", ")
    assert 1 <= len(suggested) <= 5 and arch not in suggested
    assert all(name in architectures.available_architectures() or
               name[len("timm/"):] in architectures.timm_architectures() for name in suggested)
    if arch == "resnet50d":  # both zoos: torchvision's resnet50 beside timm's
        assert "resnet50" in suggested


def test_dropout_and_drop_path_reach_the_model():
    model = build_model("timm/test_resnet", 5, image_size=32, dropout=0.3, drop_path=0.25)
    drop_paths = [module.drop_prob for module in model.modules() if type(module).__name__ == "DropPath"]
    assert model.drop_rate == 0.3 and drop_paths and max(drop_paths) == pytest.approx(0.25)  # timm's linear rule
    assert not [m for m in build_model("timm/test_resnet", 5, image_size=32).modules()
                if type(m).__name__ == "DropPath"]  # the architecture's own default: none
    convnext = build_model("convnext_tiny", 5, image_size=32, drop_path=0.3)  # torchvision's stochastic_depth_prob
    assert max(m.p for m in convnext.modules() if type(m).__name__ == "StochasticDepth") == pytest.approx(0.3)
    with pytest.raises(UsageError, match=r"^argument --drop-path: resnet18 has no stochastic_depth_prob setting "
                                         r"\(leave --drop-path out\)$"):
        build_model("resnet18", 5, image_size=32, drop_path=0.1)


@pytest.mark.parametrize("arch,size", [("timm/test_resnet", 32), ("timm/test_efficientnet", 32),
                                       ("timm/test_vit", 32), ("timm/test_convnext", 64)])
def test_timm_models_build_at_the_image_size_with_the_class_count(arch, size):
    model = build_model(arch, 7, image_size=size, other_sizes=[("--val-crop-size", size)])
    assert model.train()(torch.randn(2, 3, size, size)).shape == (2, 7)


def test_a_size_a_fixed_size_timm_model_cannot_take_is_one_line():
    with pytest.raises(UsageError, match=r"^argument --val-crop-size: timm/test_vit cannot take 36-pixel images "
                                         r"\(Input height \(36\) should be divisible by patch size \(16\)\.\)$"):
        build_model("timm/test_vit", 7, image_size=32, other_sizes=[("--val-crop-size", 36)])


def _saved_weights(tmp_path, classes: int, suffix: str):
    torch.manual_seed(1)
    source = timm.create_model("test_resnet", num_classes=classes)
    state = {name: tensor.contiguous() for name, tensor in source.state_dict().items()}
    path = tmp_path / f"weights{suffix}"
    safetensors_torch.save_file(state, path) if suffix == ".safetensors" else torch.save(state, path)
    return path, state


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_pretrained_file_gives_the_files_weights_and_a_new_head_for_other_classes(tmp_path, suffix):
    path, state = _saved_weights(tmp_path, 7, suffix)
    torch.manual_seed(2)
    same = build_model("timm/test_resnet", 7, image_size=32, pretrained_file=str(path)).state_dict()
    assert same.keys() == state.keys() and all(torch.equal(same[name], state[name]) for name in state)
    other = build_model("timm/test_resnet", 4, image_size=32, pretrained_file=str(path)).state_dict()
    assert other["fc.weight"].shape == (4, state["fc.weight"].shape[1])
    body = [name for name in state if not name.startswith("fc.")]
    assert len(body) > 10 and all(torch.equal(other[name], state[name]) for name in body)


def test_pretrained_reads_hugging_faces_cache_and_names_it_when_the_weights_are_not_there(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--timm--test_resnet.r160_in1k"
    with pytest.raises(UsageError) as missing:
        build_model("timm/test_resnet", 7, pretrained=True, image_size=32)
    assert str(missing.value).startswith(f"argument --pretrained: timm's weights for test_resnet are not in {repo} "
                                         f"(a run never downloads them); hf download timm/test_resnet.r160_in1k on a machine ")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    path, state = _saved_weights(tmp_path, 1000, ".safetensors")
    path.rename(repo / "snapshots" / "0123abcd" / "model.safetensors")
    built = build_model("timm/test_resnet", 1000, pretrained=True, image_size=32).state_dict()
    assert all(torch.equal(built[name], state[name]) for name in state)


def test_a_pretrained_file_that_holds_code_is_refused_without_running_it(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "weights.pth"
    torch.save({"fc.weight": RunsCode(str(marker))}, path)
    with pytest.raises(UsageError, match=rf"^argument --pretrained-file: {path} is not a plain weights file"):
        build_model("timm/test_resnet", 7, image_size=32, pretrained_file=str(path))
    assert not marker.exists()
    _, state = _saved_weights(tmp_path, 7, ".safetensors")
    torch.save({"conv.weight": torch.zeros(3)}, path)  # tensors, another model's
    with pytest.raises(UsageError, match=rf"^argument --pretrained-file: the weights in {path} do not fit "):
        build_model("timm/test_resnet", 7, image_size=32, pretrained_file=str(path))


def test_pretrained_file_is_for_timm_models_and_must_exist(tmp_path):
    with pytest.raises(UsageError, match=r"^argument --pretrained-file: only for timm/ models, not resnet18"):
        cli.parse("nd", ["-a", "resnet18", "--pretrained-file", str(REPO / "README.md"), "--synthetic"])
    with pytest.raises(UsageError, match=rf"^argument --pretrained-file: {tmp_path / 'no'} is not a file$"):
        cli.parse("nd", ["-a", "timm/test_resnet", "--pretrained-file", str(tmp_path / "no"), "--synthetic"])


def test_sync_batchnorm_keeps_the_activation_timm_fuses_into_its_norms():
    torch.manual_seed(0)
    model = build_model("timm/test_efficientnet", 5, image_size=32).eval()
    images = torch.randn(2, 3, 32, 32)
    expected = model(images)
    converted = sync_batchnorm(model, "timm/test_efficientnet").eval()
    norms = [type(module).__name__ for module in converted.modules() if "BatchNorm" in type(module).__name__]
    assert norms and set(norms) == {"SyncBatchNormAct"}
    assert torch.allclose(converted(images), expected, atol=1e-6)  # torch's conversion drops the activations
