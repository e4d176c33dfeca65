"""Model builders: any torchvision classifier (its names cached per torchvision
version), the right output shape, one logits tensor (auxiliary heads off), a
resizable head, and unwrapping."""
import importlib.metadata
import json

import pytest
import torch
from torch import nn

from common import architectures
from common.cli import build_parser
from common.errors import UsageError
from common.models import _replace_last_linear, available_architectures, build_model, unwrap


def test_help_lists_every_architecture():
    text = build_parser("nd").format_help()
    compact = " ".join(text.split())  # argparse wraps the list over lines
    assert all(f" {name}," in compact or f" {name} " in compact for name in available_architectures())
    assert {"alexnet", "resnet50", "vgg16", "vit_b_16", "mobilenet_v3_small"} <= set(available_architectures())
    assert "maskrcnn_resnet50_fpn" not in available_architectures()  # detection models are not classifiers


def test_the_names_are_torchvisions_cached_per_version_and_listed_again_when_the_cache_is_not_right(
        tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    listed = architectures._list_torchvision_architectures()
    assert architectures.available_architectures.__wrapped__() == listed  # __wrapped__: past the per-process memo
    version = importlib.metadata.version("torchvision")
    cache = tmp_path / "imagenet-reference" / "architectures" / f"torchvision-{version}.json"
    assert json.loads(cache.read_text()) == {"torchvision": version, "architectures": listed}
    assert [path.name for path in cache.parent.iterdir()] == [cache.name]  # no temporary file left

    monkeypatch.setattr(architectures, "_list_torchvision_architectures", lambda: pytest.fail("listed again"))
    assert architectures.available_architectures.__wrapped__() == listed  # read from the cache

    monkeypatch.setattr(architectures, "_list_torchvision_architectures", lambda: listed)
    for wrong in (b"", b"{half", b"\xff\xfe", b"[]", b'{"torchvision": "0.0.1", "architectures": ["resnet50"]}',
                  json.dumps({"torchvision": version, "architectures": []}).encode(),
                  json.dumps({"torchvision": version, "architectures": ["resnet50", 7]}).encode()):
        cache.write_bytes(wrong)
        assert architectures.available_architectures.__wrapped__() == listed, wrong
        assert json.loads(cache.read_text())["architectures"] == listed, wrong  # written again


def test_the_cache_folder_follows_xdg_and_a_folder_that_cannot_be_written_only_skips_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG rules: a relative path is ignored
    assert architectures.user_cache_folder() == tmp_path / "home" / ".cache" / "imagenet-reference"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert architectures.user_cache_folder() == tmp_path / "home" / ".cache" / "imagenet-reference"
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))  # no folder can be made under a file
    assert architectures.available_architectures.__wrapped__() == architectures._list_torchvision_architectures()


@pytest.mark.parametrize("arch,size", [
    ("resnet18", 32), ("alexnet", 64), ("vgg11", 32), ("squeezenet1_0", 64), ("mobilenet_v3_small", 32),
    # The larger ones take seconds each on 2 cores: CI's full suite runs them (`make test-all`).
    *(pytest.param(arch, size, marks=pytest.mark.slow)
      for arch, size in (("efficientnet_b0", 32), ("googlenet", 64), ("inception_v3", 96), ("densenet121", 32))),
    ("vit_b_16", 64),
])
def test_build_model_outputs_one_logits_tensor(arch, size):
    torch.manual_seed(0)
    model = build_model(arch, num_classes=7, image_size=size)
    model.train()  # training mode is where googlenet / inception would add auxiliary outputs
    output = model(torch.randn(2, 3, size, size))
    assert isinstance(output, torch.Tensor) and output.shape == (2, 7)


def test_unknown_arch_is_a_usage_error():
    with pytest.raises(UsageError, match="-a/--arch"):
        build_model("resnet51", 10)


@pytest.mark.parametrize("arch,head", [("resnet18", "fc"), ("alexnet", "classifier.6"), ("vit_b_16", "heads.head")])
def test_replace_last_linear_resizes_the_classifier_head(arch, head):
    model = build_model(arch, num_classes=1000)
    before = {name: p.clone() for name, p in model.named_parameters() if not name.startswith(head)}
    _replace_last_linear(model, 10)
    assert model.get_submodule(head).out_features == 10
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters() if name in before)


def test_unwrap_finds_the_plain_model():
    model = nn.Linear(2, 2)
    assert unwrap(nn.DataParallel(model)) is model
    assert unwrap(model) is model


@pytest.mark.parametrize("arch,size", [("alexnet", 32), ("inception_v3", 48), ("maxvit_t", 64)])
def test_image_size_the_model_cannot_take_is_one_line(arch, size):
    with pytest.raises(UsageError, match=rf"--image-size: {arch} cannot take {size}-pixel images"):
        build_model(arch, num_classes=5, image_size=size)
