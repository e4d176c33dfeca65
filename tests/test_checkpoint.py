"""Checkpoints: atomic writes, safe loading, foreign formats."""
import os

import pytest
import torch
import torchvision

from common import checkpoint
from common.cli import UsageError


class RunsCode:
    """A pickle payload that would create a file when unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mknod, (self.marker,))


def test_checkpoint_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = str(tmp_path / "pwned")
    path = tmp_path / "evil.pth.tar"
    torch.save({"state_dict": {}, "payload": RunsCode(marker)}, path)
    with pytest.raises(UsageError, match="not a readable checkpoint"):
        checkpoint.load(str(path))
    assert not os.path.exists(marker)


def test_save_is_atomic_and_keeps_the_best(tmp_path):
    checkpoint.save({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, tmp_path, is_best=True)
    checkpoint.save({"state_dict": {"w": torch.zeros(2)}, "epoch": 2}, tmp_path, is_best=False)
    assert checkpoint.load(str(tmp_path / checkpoint.CHECKPOINT_NAME))["epoch"] == 2
    assert checkpoint.load(str(tmp_path / checkpoint.BEST_NAME))["epoch"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint.CHECKPOINT_NAME, checkpoint.BEST_NAME]


def test_failed_write_leaves_the_previous_checkpoint_intact(tmp_path):
    checkpoint.save({"state_dict": {}, "epoch": 1}, tmp_path, is_best=False)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full, say")

    with pytest.raises(RuntimeError):
        checkpoint.save({"state_dict": {}, "epoch": 2, "bad": Unpicklable()}, tmp_path, is_best=False)
    assert checkpoint.load(str(tmp_path / checkpoint.CHECKPOINT_NAME))["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint.CHECKPOINT_NAME]


def test_pytorch_examples_style_checkpoint_loads(tmp_path):
    # pytorch/examples saves DataParallel weights ('module.' prefix) and best_acc1 as a tensor.
    source = torchvision.models.resnet18(num_classes=5)
    wrapped_state = {f"module.{key}": value for key, value in source.state_dict().items()}
    optimizer = torch.optim.SGD(source.parameters(), lr=0.1, momentum=0.9)
    path = tmp_path / "examples.pth.tar"
    torch.save({"epoch": 7, "arch": "resnet18", "state_dict": wrapped_state, "best_acc1": torch.tensor(61.5),
                "optimizer": optimizer.state_dict()}, path)
    target = torchvision.models.resnet18(num_classes=5)
    point = checkpoint.resume(str(path), target, torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9),
                              _NoPolicy(), "resnet18", [f"c{i}" for i in range(5)])
    assert (point.start_epoch, point.best_acc1) == (7, 61.5)
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))


def test_rng_state_round_trip():
    import random

    import numpy as np

    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    state = checkpoint.capture_rng_state()
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    checkpoint.restore_rng_state(state)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(expected[0], again[0]) and expected[1:] == again[1:]


class _NoPolicy:
    def load_state_dict(self, state):
        assert state == {}


def test_wrapper_names_inside_keys_are_dropped():
    # pytorch/examples wraps only AlexNet's features in DataParallel: features.module.0.weight
    state = {"features.module.0.weight": torch.ones(1), "module._orig_mod.fc.bias": torch.zeros(1)}
    assert list(checkpoint._plain_state_dict(state)) == ["features.0.weight", "fc.bias"]


def test_optimizer_state_that_does_not_fit_is_a_usage_error(tmp_path):
    model = torchvision.models.resnet18(num_classes=3)
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    adam.step()
    path = tmp_path / "adam.pth.tar"
    torch.save({"arch": "resnet18", "epoch": 1, "state_dict": model.state_dict(),
                "optimizer": {"state": {}, "param_groups": [{"params": [0]}]}}, path)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match=r"--resume: the optimizer state in .* does not fit"):
        checkpoint.resume(str(path), model, sgd, _NoPolicy(), "resnet18", ["a", "b", "c"])
