"""common.evaluation: ImageNet-ReaL's top-1 on given guesses, real.json read and matched to files by name,
each image's guess kept by dataset index, --eval-set's class folders (by name or index), and the flags' checks."""
import json

import numpy as np
import pytest
import torch

from common.cli import parse
from common.distributed import single_process
from common.errors import UsageError
from common.evaluation import (Predictions, RealScore, eval_set_classes, read_real_labels, real_labels_of, real_top1,
                               scan_eval_set)
import common.evaluation as evaluation


# --- ReaL's score ---

def test_real_top1_counts_a_guess_right_when_it_is_any_real_label_and_leaves_out_images_without_one():
    guesses = np.array([3, 1, 0, 2, 2, -1, 4])
    labels = [(3,), (0, 1), (1, 2), (), (0,), (1,), ()]
    # right: image 0 (3 in {3}), image 1 (1 in {0,1}); wrong: 2 (0), 4 (2); left out: 3, 6; not read: 5.
    score = real_top1(guesses, labels)
    assert score == RealScore(correct=2, counted=4, left_out=2)
    assert score.top1 == 50.0
    assert score.describe() == "ReaL top1 50.00% (2/4 images with real labels; 2 without, left out)"


def test_real_top1_of_a_set_without_any_real_label_is_nan_not_a_division_error():
    score = real_top1(np.array([0, 1]), [(), ()])
    assert (score.correct, score.counted, score.left_out) == (0, 0, 2) and np.isnan(score.top1)


# --- each image's guess ---

def test_predictions_keep_each_images_guess_by_dataset_index_and_mark_images_never_read():
    predictions = Predictions(6, torch.device("cpu"))
    # Two batches of another process's order (indices 4, 0 then 2); ties go to topk's first, as in common.meters.
    predictions.add(torch.tensor([4, 0]), torch.tensor([[0.1, 0.9, 0.0], [2.0, 1.0, 3.0]]))
    predictions.add(torch.tensor([2]), torch.tensor([[5.0, 5.0, 1.0]]))
    tie = torch.tensor([[5.0, 5.0, 1.0]]).topk(3, dim=1).indices[0, 0].item()
    assert predictions.gathered(single_process("cpu")).tolist() == [2, -1, tie, -1, 1, -1]


# --- real.json ---

def write_json(path, value):
    path.write_text(json.dumps(value) if not isinstance(value, str) else value)
    return str(path)


def test_real_labels_are_matched_to_the_validation_files_by_their_names(tmp_path):
    path = write_json(tmp_path / "real.json", [[1], [], [0, 2], [2]])
    samples = [("/d/val/c2/ILSVRC2012_val_00000004.JPEG", 2), ("/d/val/c0/ILSVRC2012_val_00000001.JPEG", 0),
               ("val/c1/ILSVRC2012_val_00000002.JPEG (in shards/val-000000.tar)", 1)]  # a sharded split's name
    assert real_labels_of(read_real_labels(path), samples, 3, path) == [(2,), (1,), ()]


@pytest.mark.parametrize("content, fragment", [
    ("[[1], [2", "not JSON"),
    ('{"1": [2]}', "expected a JSON list of lists of class indices, got dict"),
    ("[[1], [2, -1]]", "entry 2 (ILSVRC2012_val_00000002.JPEG) is [2, -1], not a list of class indices"),
    ("[[1], [true]]", "entry 2 (ILSVRC2012_val_00000002.JPEG) is [True], not a list of class indices"),
    ("[[1], 3]", "entry 2 (ILSVRC2012_val_00000002.JPEG) is 3, not a list of class indices"),
])
def test_a_malformed_real_json_is_one_line_naming_the_file_and_the_entry(tmp_path, content, fragment):
    path = write_json(tmp_path / "real.json", content)
    with pytest.raises(UsageError) as error:
        read_real_labels(path)
    assert str(error.value).startswith(f"argument --real-labels: {path}: ") and fragment in str(error.value)
    assert "\n" not in str(error.value)


def test_a_real_json_over_the_size_limit_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    path = write_json(tmp_path / "real.json", [[0]] * 100)
    monkeypatch.setattr(evaluation, "MAX_REAL_LABELS_BYTES", 100)
    with pytest.raises(UsageError, match=r"--real-labels: .*real.json: 500 B, more than the 100 B a real.json can take"):
        read_real_labels(path)


@pytest.mark.parametrize("name, fragment", [
    ("digit_007.JPEG", "is not named ILSVRC2012_val_<8 digits>.JPEG"),
    ("ILSVRC2012_val_00000009.JPEG", "is number 9, past the file's 3 entries"),
    ("ILSVRC2012_val_00000003.JPEG", "entry 3 (ILSVRC2012_val_00000003.JPEG) holds class 7, but the model has 3 "
                                     "classes (0..2)"),
])
def test_a_validation_file_real_json_cannot_score_is_one_line_naming_it(tmp_path, name, fragment):
    path = write_json(tmp_path / "real.json", [[0], [1], [7]])
    with pytest.raises(UsageError) as error:
        real_labels_of(read_real_labels(path), [("/d/val/c0/ILSVRC2012_val_00000001.JPEG", 0), (f"/d/val/c1/{name}", 1)],
                       3, path)
    assert fragment in str(error.value) and str(error.value).startswith("argument --real-labels: ")


# --- --eval-set's class folders ---

CLASSES = ["n01440764", "n01443537", "n01484850"]


def make_set(root, folders, per_folder=2):
    for folder in folders:
        (root / folder).mkdir(parents=True)
        for index in range(per_folder):
            (root / folder / f"{index}.JPEG").write_bytes(b"\xff\xd8")  # scanned, not decoded
    return root


def test_eval_set_folders_named_as_the_training_classes_keep_their_class_indices(tmp_path):
    root = make_set(tmp_path / "set", ["n01484850", "n01440764"])
    assert eval_set_classes(root, CLASSES) == {"n01440764": 0, "n01484850": 2}
    assert sorted((path.rsplit("/", 2)[1], label) for path, label in scan_eval_set(str(root), CLASSES)) == [
        ("n01440764", 0), ("n01440764", 0), ("n01484850", 2), ("n01484850", 2)]


def test_imagenet_v2_folders_named_by_class_index_are_those_training_classes(tmp_path):
    root = make_set(tmp_path / "set", ["0", "2", "1"])
    assert eval_set_classes(root, CLASSES) == {"0": 0, "1": 1, "2": 2}
    assert sorted(label for _, label in scan_eval_set(str(root), CLASSES)) == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("folders, bad", [(["0", "n01440764"], "n01440764"), (["0", "3"], "3"), (["0", "01"], "01"),
                                         (["cats"], "cats")])
def test_an_eval_set_folder_neither_a_class_nor_an_index_is_one_line_naming_it(tmp_path, folders, bad):
    root = make_set(tmp_path / "set", folders)
    with pytest.raises(UsageError) as error:
        eval_set_classes(root, CLASSES)
    assert str(error.value) == (f"argument --eval-set: {root / bad}: the class folder {bad!r} is neither a training "
                                f"class (e.g. 'n01440764') nor a class index 0..2")


# --- the flags ---

@pytest.mark.parametrize("argv, message", [
    (["--eval-set", "v2=DIR"], "argument --eval-set: only with --evaluate"),
    (["--real-labels", "real.json"], "argument --real-labels: only with --evaluate"),
    (["-e", "--eval-set", "v2"], "argument --eval-set: expected NAME=DIR, got 'v2'"),
    (["-e", "--eval-set", "val=DIR"], "argument --eval-set: NAME 'val': letters, digits"),
    (["-e", "--eval-set", "../x=DIR"], "argument --eval-set: NAME '../x': letters, digits"),
    (["-e", "--eval-set", "v2=missing"], "argument --eval-set: v2=missing: no such directory"),
    (["-e", "--eval-set", "v2=DIR", "--eval-set", "v2=DIR"], "argument --eval-set: NAME v2 is given twice"),
    (["-e", "--real-labels", "missing.json"], "argument --real-labels: no such file: missing.json"),
    (["-e", "--eval-set", "v2=DIR", "--report-dir", "REPORTS"], "argument --report-dir: REPORTS/v2_report.csv exists"),
    (["-e", "--report-dir", "REPORTS2"], "argument --report-dir: REPORTS2/predictions.csv exists"),
])
def test_evaluation_flags_are_checked_in_one_line(tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    for split in ("train", "val"):
        (data / split / "c").mkdir(parents=True)
    (tmp_path / "DIR").mkdir()
    for folder, name in (("REPORTS", "v2_report.csv"), ("REPORTS2", "predictions.csv")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text("")
    with pytest.raises(UsageError) as error:
        parse("nd", [str(data), *argv])
    assert str(error.value).startswith(message)


def test_evaluation_flags_are_refused_with_synthetic_data(tmp_path):
    with pytest.raises(UsageError, match="argument --eval-set: not with --synthetic"):
        parse("nd", ["--synthetic", "-e", "--eval-set", f"v2={tmp_path}"])


def test_evaluation_flags_reach_the_config_in_their_order(tmp_path):
    for split in ("train", "val"):
        (tmp_path / split / "c").mkdir(parents=True)
    (tmp_path / "real.json").write_text("[]")
    cfg = parse("nd", [str(tmp_path), "-e", "--eval-set", f"b={tmp_path}", "--eval-set", f"a={tmp_path}/val",
                       "--real-labels", str(tmp_path / "real.json")])
    assert cfg.eval_sets == (("b", str(tmp_path)), ("a", f"{tmp_path}/val"))
    assert cfg.real_labels == str(tmp_path / "real.json")
