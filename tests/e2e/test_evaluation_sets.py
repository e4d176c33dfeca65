"""--evaluate on other labelled sets (--eval-set, ImageNet-V2's index-named folders) and with ImageNet-ReaL's
labels (--real-labels): scores against a real.json made from a first pass's guesses, so that exactly k of n
counted images are right, at one process and at two with an odd image count."""
import csv
import json
import re
import shutil
import sys

import pytest

import imagenet_nd
from common.errors import UsageError
from common.rundir import CHECKPOINT_NAME
from helpers import FAST_ARGS, MODEL, REPO, finish, make_image_folder, single_run_dir, start


def imagenet_named(data, drop=0):
    """DATA whose val/ files are named as ImageNet's validation images, numbered in the scan's order; the
    first `drop` of them removed first."""
    files = sorted((data / "val").rglob("*.JPEG"))
    for extra in files[:drop]:
        extra.unlink()
    for number, path in enumerate(files[drop:], start=1):
        path.rename(path.with_name(f"ILSVRC2012_val_{number:08d}.JPEG"))
    return data


def index_named_copy(data, folder):
    """val/ as ImageNet-V2 lays a set out: class folders named by class index (here 0, 1, 2)."""
    for index, class_dir in enumerate(sorted((data / "val").iterdir())):
        shutil.copytree(class_dir, folder / str(index))
    return folder


def guesses_of(report_dir, column="predicted"):
    with open(report_dir / "predictions.csv", newline="") as handle:
        return [int(row[column]) for row in csv.DictReader(handle)]


def real_json(path, guesses, left_out, right):
    """real.json whose images `left_out` (0-based) have no real label, images `right` have their guess among
    two real labels, and the others only a class that is not their guess."""
    entries = []
    for index, guess in enumerate(guesses):
        other = (guess + 1) % 3
        entries.append([] if index in left_out else sorted([guess, other]) if index in right else [other])
    path.write_text(json.dumps(entries))
    return path


def evaluation_rows(report_dir):
    with open(report_dir / "evaluation.csv", newline="") as handle:
        return [{key: value for key, value in row.items() if value != ""} for row in csv.DictReader(handle)]


def test_real_top1_and_an_index_named_set_score_as_computed_by_hand(tmp_path, capsys):
    data = imagenet_named(make_image_folder(tmp_path / "data"))  # 9 validation images
    imagenet_nd.main([str(data), *FAST_ARGS, "--epochs", "1", "--logdir", str(tmp_path / "runs")])
    checkpoint = single_run_dir(tmp_path / "runs") / CHECKPOINT_NAME
    evaluate = [str(data), *FAST_ARGS, "--evaluate", "--resume", str(checkpoint)]
    imagenet_nd.main([*evaluate, "--report-dir", str(tmp_path / "first")])
    guesses = guesses_of(tmp_path / "first")
    assert len(guesses) == 9 and min(guesses) >= 0
    # 2 of 9 without real labels; of the 7 counted, images 0, 3 and 8 right: 3/7.
    labels = real_json(tmp_path / "real.json", guesses, left_out={1, 5}, right={0, 3, 8})
    v2 = index_named_copy(data, tmp_path / "v2")
    capsys.readouterr()
    imagenet_nd.main([*evaluate, "--real-labels", str(labels), "--eval-set", f"v2-matched={v2}",
                      "--report-dir", str(tmp_path / "second")])
    out = capsys.readouterr().out
    assert "validation: ReaL top1 42.86% (3/7 images with real labels; 2 without, left out)" in out
    (val_line,) = [line for line in out.splitlines() if line.startswith("validation: loss")]
    (set_line,) = [line for line in out.splitlines() if line.startswith("eval set v2-matched: loss")]
    # The same images under their class indices: the same figures (the seconds aside).
    assert re.sub(r"in [\d.]+ s", "", set_line.replace("eval set v2-matched", "validation")) == \
        re.sub(r"in [\d.]+ s", "", val_line)
    right = sum(guess == index // 3 for index, guess in enumerate(guesses))  # make_image_folder: 3 per class
    assert f"({right}/9)" in val_line
    second = tmp_path / "second"
    assert (second / "v2-matched_report.csv").read_text() == (second / "val_report.csv").read_text()
    rows = evaluation_rows(second)
    assert [(row["set"], row["weights"], row["images"]) for row in rows] == [("val", "model", "9"),
                                                                             ("v2-matched", "model", "9")]
    assert (rows[0]["real_correct"], rows[0]["real_counted"], rows[0]["real_left_out"]) == ("3", "7", "2")
    assert rows[0]["real_top1"] == "42.8571" and "real_top1" not in rows[1]
    assert guesses_of(second) == guesses
    # Mistakes found in the labels or a set end the run before any validation pass, writing nothing.
    (tmp_path / "short.json").write_text(json.dumps([[0]] * 8))
    (v2 / "cats").mkdir()
    for extra, message in ((["--real-labels", str(tmp_path / "short.json")],
                            "ILSVRC2012_val_00000009.JPEG is number 9, past the file's 8 entries"),
                           (["--eval-set", f"v2={v2}"],
                            f"argument --eval-set: {v2 / 'cats'}: the class folder 'cats' is neither")):
        capsys.readouterr()
        with pytest.raises(UsageError, match=re.escape(message)):
            imagenet_nd.main([*evaluate, *extra, "--report-dir", str(tmp_path / "third")])
        out = capsys.readouterr().out
        assert "validation:" not in out and "val   epoch" not in out and not (tmp_path / "third").exists()


@pytest.mark.slow
def test_two_processes_count_every_image_once_with_an_odd_count_and_score_the_ema_too(tmp_path, capsys):
    data = imagenet_named(make_image_folder(tmp_path / "data"), drop=2)  # 7 validation images: 4 + 3
    imagenet_nd.main([str(data), *MODEL, "-b", "4", "-j", "0", "--epochs", "1", "--model-ema",
                      "--model-ema-steps", "1", "--logdir", str(tmp_path / "runs")])
    evaluate = [str(data), *MODEL, "-b", "2", "-j", "0", "--evaluate",
                "--resume", str(single_run_dir(tmp_path / "runs") / CHECKPOINT_NAME)]
    imagenet_nd.main([*evaluate, "--report-dir", str(tmp_path / "first")])
    guesses, ema_guesses = guesses_of(tmp_path / "first"), guesses_of(tmp_path / "first", "predicted_ema")
    labels = real_json(tmp_path / "real.json", guesses, left_out={2}, right={0, 1, 6})  # 3/6
    ema_right = sum(ema_guesses[index] in entry for index, entry in enumerate(json.loads(labels.read_text()))
                    if entry)
    v2 = index_named_copy(data, tmp_path / "v2")
    extra = ["--real-labels", labels, "--eval-set", f"v2={v2}"]
    imagenet_nd.main([*evaluate, *map(str, extra), "--report-dir", str(tmp_path / "one")])
    stdout = finish([start([sys.executable, REPO / "imagenet_ddp.py", *evaluate, *extra, "--nproc-per-node", "2",
                            "--report-dir", tmp_path / "two"])])[0]
    assert "validation: ReaL top1 50.00% (3/6 images with real labels; 1 without, left out)" in stdout
    assert (f"validation of the EMA: ReaL top1 {100 * ema_right / 6:.2f}% ({ema_right}/6 images with real labels; "
            f"1 without, left out)") in stdout
    one, two = evaluation_rows(tmp_path / "one"), evaluation_rows(tmp_path / "two")
    assert [(row["set"], row["weights"], row["images"]) for row in two] == [
        ("val", "model", "7"), ("val", "ema", "7"), ("v2", "model", "7"), ("v2", "ema", "7")]
    figures = ("images", "top1", "top5", "real_correct", "real_counted", "real_left_out")
    assert [[row.get(key) for key in figures] for row in one] == [[row.get(key) for key in figures] for row in two]
    assert guesses_of(tmp_path / "two") == guesses and guesses_of(tmp_path / "two", "predicted_ema") == ema_guesses
