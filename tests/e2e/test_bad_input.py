"""Every mistake a user can make on the command line or in the dataset: one
line on stderr naming the flag or path, exit status 2, no traceback, and
nothing written."""
import os

import pytest
import torch

from common.cli import parse
from common.errors import UsageError
from helpers import FAST_ARGS, RunsCode, make_image_folder, run_script


def assert_usage_error(result, *fragments):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("imagenet_nd.py: error: "), lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_missing_data(tmp_path):
    result = run_script(["imagenet_nd.py", "--logdir", tmp_path / "runs"])
    assert_usage_error(result, "DATA: missing", "--synthetic")
    assert not (tmp_path / "runs").exists()


def test_data_folder_does_not_exist(tmp_path):
    assert_usage_error(run_script(["imagenet_nd.py", tmp_path / "nowhere"]), f"DATA {tmp_path / 'nowhere'}: no such directory")


@pytest.mark.slow
@pytest.mark.parametrize("missing", ["train", "val"])
def test_data_without_split_folder(tmp_path, missing):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=1, val_per_class=1)
    for path in sorted((root / missing).rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    (root / missing).rmdir()
    assert_usage_error(run_script(["imagenet_nd.py", root]), f"no {missing}/ folder", str(root / missing))


@pytest.mark.slow
@pytest.mark.parametrize("split", ["train", "val"])
def test_class_folder_without_images(tmp_path, split):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=2, val_per_class=1)
    (root / split / "class_1" / "000.JPEG").unlink()
    if split == "train":
        (root / split / "class_1" / "001.JPEG").unlink()
    (root / split / "class_1" / "readme.txt").write_text("no images here")
    result = run_script(["imagenet_nd.py", root, *FAST_ARGS, "--logdir", tmp_path / "runs"])
    assert_usage_error(result, str(root / split / "class_1"), "class folder has no images")
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_unknown_arch_suggests_the_close_name(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=1, val_per_class=1)
    assert_usage_error(run_script(["imagenet_nd.py", root, "-a", "resnet51"]), "-a/--arch", "'resnet51'", "resnet50")


@pytest.mark.slow
@pytest.mark.parametrize("flag,value", [("-b", "0"), ("--batch-size", "-3"), ("--epochs", "0"), ("--epochs", "x")])
def test_non_positive_batch_or_epochs(tmp_path, flag, value):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=1, val_per_class=1)
    name = "-b/--batch-size/--b" if flag in ("-b", "--batch-size") else "--epochs"
    assert_usage_error(run_script(["imagenet_nd.py", root, flag, value]), f"argument {name}: expected a positive integer")


def test_resume_missing_file(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=1, val_per_class=1)
    missing = tmp_path / "nope.pth.tar"
    assert_usage_error(run_script(["imagenet_nd.py", root, "--resume", missing]), "--resume", str(missing))


@pytest.mark.slow
@pytest.mark.parametrize("content, problem", [(b"", "is not a readable checkpoint (damaged: the file is empty)"),
                                              (b"this is not a checkpoint", "is not a PyTorch checkpoint (text, "),
                                              (b"PK\x03\x04broken zip", "is not a readable checkpoint (damaged: ")])
def test_resume_unreadable_file(tmp_path, content, problem):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=4, val_per_class=1)
    damaged = tmp_path / "damaged.pth.tar"
    damaged.write_bytes(content)
    result = run_script(["imagenet_nd.py", root, *FAST_ARGS, "--resume", damaged, "--logdir", tmp_path / "runs"])
    assert_usage_error(result, "--resume", f"{damaged} {problem}")
    assert damaged.read_bytes() == content
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.parametrize("split,workers", [("train", "0"), ("train", "2"), ("val", "2")])
def test_corrupt_jpeg_stops_the_run_naming_the_file(tmp_path, split, workers):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=4, val_per_class=1)
    bad = root / split / "class_1" / "000.JPEG"
    bad.write_bytes(bad.read_bytes()[:200])  # truncated mid-scan
    result = run_script(["imagenet_nd.py", root, *FAST_ARGS, "-j", workers, "--epochs", "1",
                         "--logdir", tmp_path / "runs"], timeout=120)
    assert_usage_error(result, str(bad), "cannot decode image")


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_resume_permission_denied(tmp_path):
    locked = tmp_path / "locked.pth.tar"
    locked.write_bytes(b"x")
    locked.chmod(0)
    assert_usage_error(run_script(["imagenet_nd.py", "--synthetic", "--resume", locked]), "--resume", "permission denied")


@pytest.mark.slow
def test_image_size_the_model_cannot_take(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=2, val_per_class=1)
    result = run_script(["imagenet_nd.py", root, *FAST_ARGS, "-a", "alexnet", "--logdir", tmp_path / "runs"])
    assert_usage_error(result, "--image-size", "alexnet cannot take 32-pixel images")
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_pretrained_weights_unavailable_offline(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=1, val_per_class=1)
    # An empty hub cache and a proxy that refuses at once: the download cannot succeed.
    offline = {"TORCH_HOME": str(tmp_path / "torch-home"), "https_proxy": "http://127.0.0.1:9",
               "HTTPS_PROXY": "http://127.0.0.1:9", "no_proxy": "", "NO_PROXY": ""}
    result = run_script(["imagenet_nd.py", root, *FAST_ARGS, "-b", "2", "--pretrained"], env_extra=offline, timeout=120)
    assert_usage_error(result, "--pretrained", "resnet18", str(tmp_path / "torch-home"), "download.pytorch.org")


def test_unknown_flag(tmp_path):
    assert_usage_error(run_script(["imagenet_nd.py", "--synthetic", "--bogus"]), "unrecognized arguments: --bogus")


@pytest.mark.parametrize("argv,fragment", [
    (["--start-epoch", "5", "--epochs", "5"], "--start-epoch"),
    (["--val-resize", "100", "--image-size", "224"], "--val-resize"),
    (["--lr", "0"], "--lr"),
    (["--momentum", "1.5"], "--momentum"),
    (["--lr-steps", "60", "30"], "--lr-steps"),
    (["--desired-acc", "150"], "--desired-acc"),
    (["--desired-acc", "0"], "--desired-acc"),
    (["--warmup-epochs", "9", "--epochs", "5"], "--warmup-epochs"),
    (["--run-name", "a/b"], "--run-name"),
    (["-j", "-1"], "-j/--workers"),
    (["--report-dir", "reports"], "--report-dir"),  # only with --evaluate
    (["--io-interval", "-1"], "--io-interval"),
    (["--throughput-warmup-steps", "-1"], "--throughput-warmup-steps"),
    (["--seed", str(2**32)], "--seed: expected an integer from 0 to"),  # NumPy's seed range (issue 21)
])
def test_value_checks_name_the_flag(argv, fragment):
    with pytest.raises(UsageError, match=fragment.replace("-", r"\-")):
        parse("nd", ["--synthetic", *argv])


@pytest.mark.parametrize("text,percent", [("0.75", 75.0), ("75", 75.0), ("1", 100.0), ("100", 100.0), ("0.5", 50.0)])
def test_desired_acc_accepts_fraction_or_percent(text, percent):
    assert parse("nd", ["--synthetic", "--desired-acc", text]).desired_acc == pytest.approx(percent)


@pytest.mark.slow
def test_cuda_requested_without_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert_usage_error(run_script(["imagenet_nd.py", "--synthetic", "--device", "cuda"]), "--device")


@pytest.mark.slow
def test_report_dir_never_overwrites_an_earlier_report(tmp_path):
    (tmp_path / "val_report.csv").write_text("an earlier report")
    with pytest.raises(UsageError, match=r"\-\-report\-dir: .*val_report.csv exists"):
        parse("nd", ["--synthetic", "--evaluate", "--report-dir", str(tmp_path)])
    assert (tmp_path / "val_report.csv").read_text() == "an earlier report"


def _hub_weights_file(torch_home, arch="resnet18"):
    import torchvision
    from urllib.parse import urlparse

    url = torchvision.models.get_model_weights(arch).DEFAULT.url
    folder = torch_home / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    return folder / os.path.basename(urlparse(url).path)


@pytest.mark.slow
def test_cached_pretrained_weights_that_would_run_code_are_refused_without_running_it(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=2, val_per_class=1)
    cached = _hub_weights_file(tmp_path / "torch-home")
    marker = tmp_path / "pwned"
    torch.save({"conv1.weight": torch.zeros(1), "payload": RunsCode(str(marker))}, cached)
    result = run_script(["imagenet_nd.py", root, *FAST_ARGS, "--pretrained", "--logdir", tmp_path / "runs"],
                        env_extra={"TORCH_HOME": str(tmp_path / "torch-home")})
    assert_usage_error(result, f"argument --pretrained: {cached} is not a plain weights file")
    assert not marker.exists() and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_cached_plain_pretrained_weights_load(tmp_path):
    import torchvision

    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=2, val_per_class=1)
    cached = _hub_weights_file(tmp_path / "torch-home")
    torch.manual_seed(7)
    source = torchvision.models.resnet18()
    torch.save(source.state_dict(), cached)
    result = run_script(["imagenet_nd.py", root, *FAST_ARGS, "--pretrained", "--evaluate", "-b", "2"],
                        env_extra={"TORCH_HOME": str(tmp_path / "torch-home")})
    assert result.returncode == 0, result.stderr
    assert "validation: loss" in result.stdout


@pytest.mark.slow
def test_one_image_per_step_that_batchnorm_cannot_take(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=2, val_per_class=1)
    result = run_script(["imagenet_nd.py", root, *FAST_ARGS, "-b", "1", "--logdir", tmp_path / "runs"])
    assert_usage_error(result, "argument -b/--batch-size: one image per step is too few for resnet18 at 32-pixel "
                               "images", "use -b 2 or more")
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_crafted_checkpoint_is_refused_by_resume_and_evaluate_without_running_it(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=2, val_per_class=1)
    marker = tmp_path / "pwned"
    evil = tmp_path / "downloaded.pth.tar"
    torch.save({"state_dict": {}, "epoch": 3, "payload": RunsCode(str(marker))}, evil)
    for extra in ([], ["--evaluate"]):
        result = run_script(["imagenet_nd.py", root, *FAST_ARGS, "--resume", evil, *extra, "--logdir", tmp_path / "r"])
        assert_usage_error(result, f"argument --resume: {evil} holds code (posix.mknod, which loading it would "
                                   f"call); refused")
        assert not marker.exists() and not (tmp_path / "r").exists()
