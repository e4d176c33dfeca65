"""common.provenance: the commit, the dirty flag and a hash of exactly the
uncommitted changes of a git checkout made by the test; every field None
outside a checkout, without git, or with a git that refuses or hangs; and a
real run's config.json and resumes.jsonl carrying this repository's commit."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

import imagenet_nd
from common import provenance
from helpers import REPO, make_image_folder

UNKNOWN = {"git_commit": None, "git_dirty": None, "git_diff_sha256": None}
# Committing needs a name; a user's global configuration (signing, hooks) must not reach the test's repository.
_COMMIT = ["-c", "user.name=test", "-c", "user.email=test@example.com", "-c", "commit.gpgsign=false",
           "-c", "core.hooksPath=/dev/null"]


def git(root, *args) -> str:
    return subprocess.run(["git", *_COMMIT, *args], cwd=root, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path):
    """A git checkout with one commit: code.py, weights.bin (binary) and a .gitignore of *.log."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: no checkout to make")
    root = tmp_path / "project"
    root.mkdir()
    git(root, "init", "-q")
    (root / "code.py").write_text("lr = 0.1\n")
    (root / "weights.bin").write_bytes(bytes(range(256)) * 4)
    (root / ".gitignore").write_text("*.log\n")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "first")
    return root


def test_a_checkout_gives_its_commit_and_a_hash_of_exactly_its_changes(checkout):
    head = git(checkout, "rev-parse", "HEAD")
    assert provenance.code_version(checkout) == {"git_commit": head, "git_dirty": False, "git_diff_sha256": None}

    (checkout / "code.py").write_text("lr = 0.2\n")
    edited = provenance.code_version(checkout)
    assert edited["git_commit"] == head and edited["git_dirty"] is True
    assert len(edited["git_diff_sha256"]) == 64 and provenance.code_version(checkout) == edited  # same diff, same hash
    git(checkout, "add", "code.py")  # staged or not, the same change against HEAD
    assert provenance.code_version(checkout) == edited
    (checkout / "code.py").write_text("lr = 0.3\n")
    assert provenance.code_version(checkout)["git_diff_sha256"] != edited["git_diff_sha256"]
    (checkout / "code.py").write_text("lr = 0.2\n")
    assert provenance.code_version(checkout) == edited

    # Untracked files count by name and bytes; ignored ones do not.
    (checkout / "notes.txt").write_text("a")
    with_notes = provenance.code_version(checkout)["git_diff_sha256"]
    (checkout / "notes.txt").write_text("b")
    other_notes = provenance.code_version(checkout)["git_diff_sha256"]
    (checkout / "notes.txt").rename(checkout / "notes2.txt")
    renamed = provenance.code_version(checkout)["git_diff_sha256"]
    assert len({edited["git_diff_sha256"], with_notes, other_notes, renamed}) == 4
    (checkout / "train.log").write_text("ignored")
    assert provenance.code_version(checkout)["git_diff_sha256"] == renamed

    # A binary file: two different changes, two hashes (a plain `git diff` says only "Binary files differ").
    (checkout / "notes2.txt").unlink()
    git(checkout, "checkout", "HEAD", "--", "code.py")
    hashes = set()
    for byte in (1, 2):
        (checkout / "weights.bin").write_bytes(bytes(range(256)) * 3 + bytes([byte]) * 256)
        hashes.add(provenance.code_version(checkout)["git_diff_sha256"])
    assert len(hashes) == 2 and None not in hashes

    git(checkout, "checkout", "HEAD", "--", "weights.bin")
    assert provenance.code_version(checkout) == {"git_commit": head, "git_dirty": False, "git_diff_sha256": None}


def test_the_users_diff_settings_leave_the_hash_alone(checkout):
    (checkout / "code.py").write_text("lr = 0.2\nepochs = 90\n")
    plain = provenance.code_version(checkout)
    for setting in ("diff.noprefix=true", "diff.algorithm=patience", "color.diff=always", "diff.mnemonicPrefix=true",
                    "diff.external=false"):
        git(checkout, "config", *setting.split("="))
    assert provenance.code_version(checkout) == plain


def test_untracked_links_count_as_their_targets_and_nested_checkouts_as_names(checkout):
    (checkout / "zeros").symlink_to("/dev/zero")  # followed, it would never end
    (checkout / "vendor").mkdir()
    git(checkout / "vendor", "init", "-q")
    linked = provenance.code_version(checkout)
    assert linked["git_dirty"] is True and linked["git_diff_sha256"] is not None
    (checkout / "zeros").unlink()
    (checkout / "zeros").symlink_to("/dev/null")
    assert provenance.code_version(checkout)["git_diff_sha256"] != linked["git_diff_sha256"]


def test_a_folder_that_is_not_the_top_of_a_checkout_is_unknown(checkout, tmp_path):
    copied = shutil.copytree(checkout, tmp_path / "copied", ignore=shutil.ignore_patterns(".git"))
    assert provenance.code_version(copied) == UNKNOWN
    # A copy inside another project's checkout is not that project's code.
    inside = shutil.copytree(copied, checkout / "vendored")
    assert provenance.code_version(inside) == UNKNOWN
    git(checkout, "add", "vendored")
    git(checkout, "commit", "-q", "-m", "vendored")
    assert provenance.code_version(inside) == UNKNOWN
    assert provenance.code_version(tmp_path / "no such folder") == UNKNOWN


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed: no checkout to make")
def test_a_checkout_without_a_commit_is_unknown(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    assert provenance.code_version(tmp_path) == UNKNOWN


def test_without_git_on_the_path_every_field_is_unknown(checkout, tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert provenance.code_version(checkout) == UNKNOWN


def fake_git(folder, body: str):
    folder.mkdir()
    script = folder / "git"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return folder


def test_a_git_that_refuses_the_checkout_is_unknown_and_says_nothing(checkout, tmp_path, monkeypatch, capfd):
    """As git answers for a checkout another user owns (shared clusters), unless safe.directory allows it."""
    refusing = fake_git(tmp_path / "refusing", f"echo \"fatal: detected dubious ownership in repository at "
                                               f"'{checkout}'\" >&2; exit 128")
    monkeypatch.setenv("PATH", f"{refusing}{os.pathsep}{os.environ['PATH']}")
    assert provenance.code_version(checkout) == UNKNOWN
    assert capfd.readouterr() == ("", "")


def test_a_git_that_hangs_is_given_up_on_at_the_timeout(checkout, tmp_path, monkeypatch):
    hanging = fake_git(tmp_path / "hanging", "exec sleep 120")
    monkeypatch.setenv("PATH", f"{hanging}{os.pathsep}{os.environ['PATH']}")
    started = time.monotonic()
    assert provenance.code_version(checkout, timeout_seconds=0.5) == UNKNOWN
    assert time.monotonic() - started < 60  # the hanging git would take 120 s


def test_git_variables_that_point_elsewhere_are_not_followed(checkout, tmp_path, monkeypatch):
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    (other / "x").write_text("x")
    git(other, "add", "x")
    git(other, "commit", "-q", "-m", "other")
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(other))
    expected = git(checkout, "--git-dir", str(checkout / ".git"), "rev-parse", "HEAD")
    assert provenance.code_version(checkout)["git_commit"] == expected != git(other, "rev-parse", "HEAD")


def this_repository() -> dict:
    """What the tests see of this repository, by git directly: its commit and
    whether `git status` lists anything (dirty here perhaps, clean in CI's
    clone); all None where it is no git checkout (an sdist) or git is missing."""
    if shutil.which("git") is None:
        return UNKNOWN
    head = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=REPO, capture_output=True, text=True)
    lines = head.stdout.split()
    if head.returncode != 0 or not os.path.samefile(lines[0], REPO):
        return UNKNOWN
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True,
                            check=True).stdout
    return {"git_commit": lines[1], "git_dirty": bool(status)}


def test_a_runs_config_json_and_each_resume_record_the_code_that_ran(tmp_path, monkeypatch):
    data = make_image_folder(tmp_path / "data", classes=2, train_per_class=2, val_per_class=1, size=16)
    monkeypatch.chdir(tmp_path)  # the code's folder, not the working directory, is the one that counts
    argv = [str(data), "-a", "resnet18", "--image-size", "16", "--val-resize", "16", "-b", "4", "-j", "0", "-p", "100",
            "--epochs", "1", "--logdir", str(tmp_path / "runs"), "--run-name", "run"]
    imagenet_nd.main(argv)  # one step and one validation batch
    imagenet_nd.main(argv + ["--resume", "auto"])  # nothing left to train: a resume that records and ends
    run_dir = tmp_path / "runs" / "run"
    recorded = json.loads((run_dir / "config.json").read_text())["environment"]
    (resumed,) = [json.loads(line)["environment"] for line in (run_dir / "resumes.jsonl").read_text().splitlines()]
    expected = this_repository()
    for environment in (recorded, resumed):
        assert {field: environment[field] for field in expected} == expected
        assert (environment["git_diff_sha256"] is None) == (not environment["git_dirty"])
        if environment["git_dirty"]:
            assert environment["git_diff_sha256"] == provenance.code_version()["git_diff_sha256"]
