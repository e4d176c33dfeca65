"""Which code ran: the git commit of the folder this project's code lives in,
whether its tree held changes not committed, and a hash of those changes,
for config.json (and each line of resumes.jsonl) and every bench row. A
recipe is only quotable with the code that ran it.

The folder is the one holding common/ (CODE_ROOT), wherever the command is
started from. It counts only where it is the top of a git checkout (its own
worktree included): an sdist, a copied folder (even one copied inside some
other checkout), a missing git, a git that fails (a checkout another user
owns, which git refuses as of "dubious ownership" unless safe.directory says
otherwise; this module never changes git's configuration), or one slower
than GIT_SECONDS all give every field None, without a word.

What git_diff_sha256 covers (docs/outputs.md): the bytes of `git diff HEAD`
(staged and unstaged changes to tracked files, binary ones as binary patches,
with fixed options, so the user's diff settings do not change it), then each
untracked file git does not ignore (.gitignore, .git/info/exclude, the global
excludes file), in byte order of its path: its path, its bytes (a symbolic
link: its target, never what it points to) and its length. Bottom layer:
imports nothing of common/, no torch; git runs as a subprocess.
"""
from __future__ import annotations

import hashlib
import os
import selectors
import stat
import subprocess
import time
from pathlib import Path
from typing import Callable, List, Mapping, Optional

CODE_ROOT = Path(__file__).resolve().parent.parent  # the folder holding common/: the code this process runs
# For all of git's answers and the untracked files' reads together: a huge tree or one on a network file system
# must not hold a run's start up by more (a few git calls take ~20 ms on this project's tree).
GIT_SECONDS = 5.0
PROVENANCE_FIELDS = ("git_commit", "git_dirty", "git_diff_sha256")
# git's listings (the top folder and commit, the untracked files' names) are held in memory: at most this much.
_LISTING_LIMIT_BYTES = 64 << 20
_CHUNK_BYTES = 1 << 20
# Variables that would point git at another repository, index or worktree than CODE_ROOT's.
_REDIRECTING_VARIABLES = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY",
                          "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_COMMON_DIR", "GIT_NAMESPACE")
# The user's diff settings (prefixes, renames, algorithm, colour, external and text-conversion drivers) would
# change the patch's bytes, not the change: fixed here, so one change has one hash.
_DIFF = ("diff", "HEAD", "--binary", "--full-index", "--no-color", "--no-ext-diff", "--no-textconv", "--no-renames",
         "--src-prefix=a/", "--dst-prefix=b/", "--diff-algorithm=myers", "--")


class _TooSlow(Exception):
    """The deadline passed, or a listing grew past _LISTING_LIMIT_BYTES."""


def unknown() -> dict:
    """The fields where the code's version cannot be told: every one None."""
    return dict.fromkeys(PROVENANCE_FIELDS)


def code_version(root: Path = CODE_ROOT, timeout_seconds: float = GIT_SECONDS) -> dict:
    """{"git_commit": the full hash of HEAD, "git_dirty": whether tracked files
    differ from it or untracked files that git does not ignore exist,
    "git_diff_sha256": the hash of those changes (module docstring), None when
    clean} for the checkout whose top folder is `root`; unknown() where `root`
    is not one, git is missing or fails, or takes over `timeout_seconds` in
    all. It runs git (three processes): call it once per run, on the primary."""
    deadline = time.monotonic() + timeout_seconds
    try:
        return _version(Path(root), deadline) or unknown()
    except (OSError, _TooSlow):  # git missing or killed, a file gone or unreadable mid-way, too slow
        return unknown()


def describe(fields: Mapping) -> str:
    """A run's or a bench row's code in words, for RESULTS.md: `commit
    9afe4dc1b2c3` (12 digits), `... with uncommitted changes (diff sha256
    1f2e3d4c5b6a)`, or `commit unknown (...)`. Booleans may come as text (a CSV's)."""
    commit = fields.get("git_commit")
    if not commit:
        return "commit unknown (not a git checkout, or git could not tell)"
    if str(fields.get("git_dirty")).lower() != "true":
        return f"commit {str(commit)[:12]}"
    return f"commit {str(commit)[:12]} with uncommitted changes (diff sha256 {str(fields.get('git_diff_sha256'))[:12]})"


def _version(root: Path, deadline: float) -> Optional[dict]:
    head = _git_bytes(["rev-parse", "--show-toplevel", "--verify", "HEAD"], root, deadline)
    lines = head.decode("utf-8", "surrogateescape").splitlines() if head is not None else []
    if len(lines) != 2 or not os.path.samefile(lines[0], root):
        return None  # not a checkout, no commit yet, or a folder inside another project's checkout
    digest = hashlib.sha256()
    diff_bytes = [0]

    def hash_diff(chunk: bytes) -> None:
        digest.update(chunk)
        diff_bytes[0] += len(chunk)

    if not _run_git(list(_DIFF), root, deadline, hash_diff):
        return None
    untracked = _git_bytes(["ls-files", "--others", "--exclude-standard", "-z"], root, deadline)
    if untracked is None:
        return None
    names = sorted(name for name in untracked.split(b"\0") if name)
    for name in names:
        _hash_untracked(digest, root, name, deadline)
    dirty = bool(diff_bytes[0] or names)
    return {"git_commit": lines[1], "git_dirty": dirty, "git_diff_sha256": digest.hexdigest() if dirty else None}


def _hash_untracked(digest, root: Path, name: bytes, deadline: float) -> None:
    """An untracked file's path, bytes and length into `digest`, read a chunk at
    a time within the deadline. Opened without following a link and without
    waiting (a FIFO must not block): a link counts as its target's name, any
    other non-regular file (a socket, a nested checkout's folder) as its path alone."""
    path = os.path.join(os.fsencode(root), name)
    digest.update(b"\0" + name + b"\0")
    if os.path.islink(path):
        target = os.readlink(path)
        digest.update(b"link\0" + target + b"\0" + str(len(target)).encode())
        return
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            digest.update(b"other\0")
            return
        digest.update(b"file\0")
        length = 0
        while chunk := os.read(descriptor, _CHUNK_BYTES):
            if time.monotonic() > deadline:
                raise _TooSlow
            digest.update(chunk)
            length += len(chunk)
        digest.update(b"\0" + str(length).encode())
    finally:
        os.close(descriptor)


def _git_bytes(args: List[str], root: Path, deadline: float) -> Optional[bytes]:
    """git's standard output (at most _LISTING_LIMIT_BYTES), or None where it failed."""
    chunks: List[bytes] = []

    def keep(chunk: bytes) -> None:
        chunks.append(chunk)
        if sum(map(len, chunks)) > _LISTING_LIMIT_BYTES:
            raise _TooSlow

    return b"".join(chunks) if _run_git(args, root, deadline, keep) else None


def _git_environment() -> dict:
    environment = {name: value for name, value in os.environ.items() if name not in _REDIRECTING_VARIABLES}
    # Reading only: git diff would otherwise refresh the index file, which a user's git command may hold.
    environment["GIT_OPTIONAL_LOCKS"] = "0"
    return environment


def _run_git(args: List[str], root: Path, deadline: float, sink: Callable[[bytes], None]) -> bool:
    """Run `git args` in `root`, each chunk of its output handed to `sink` as it
    comes (a large diff is never held whole); whether it exited with status 0.
    Past the deadline it is killed and _TooSlow raised. Its stderr (git's
    "fatal: ..." lines) is dropped: an unknown version is said by the fields."""
    process = subprocess.Popen(["git", *args], cwd=root, env=_git_environment(), stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    raise _TooSlow
                chunk = os.read(process.stdout.fileno(), _CHUNK_BYTES)
                if not chunk:
                    break
                sink(chunk)
        return process.wait(max(deadline - time.monotonic(), 0.0)) == 0
    except subprocess.TimeoutExpired:
        raise _TooSlow from None
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
