"""File mechanics, the bottom floor every other module may stand on: writes
that are whole or absent, CSV files that grow by rows (and reading back
only their whole rows), byte counts for people, the room left where a path
is, whether a path is on a file system that every node shares, and the
user's cache folder.

Atomic writes: the content goes to a temporary file beside its name
(.<name>.tmp-<pid>), is flushed to disk, then renamed over the name, and the
rename is flushed too (the directory's fsync): a reader sees the old file or
the new one, never half of one, and so does a node that crashed mid-write
when it comes back. A write that fails (a full disk) raises and leaves the
old file as it was.

Imports nothing of common/: what is here knows nothing of runs, datasets or
processes, and every module can use it (docs/architecture.md).
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import os
import re
import shutil
from pathlib import Path
from typing import BinaryIO, Callable, List, Mapping, Optional, TextIO, Tuple

MIB = 2 ** 20
# How CSV files are opened, both ways: a file name that is not valid UTF-8 (bad_images.csv lists unreadable
# files by name) is kept as its own bytes, instead of failing the write or a later read of the file.
CSV_TEXT = {"encoding": "utf-8", "errors": "surrogateescape", "newline": ""}
# The temporary files of atomic_write and link_atomically (.<name>.tmp-<pid>), and of older versions
# (.<name>.tmp): what a write killed midway (kill -9, a node crash) leaves behind.
TEMPORARY_NAME = re.compile(r"^\..+\.tmp(-\d+)?$")


def temporary_sibling(path: Path) -> Path:
    """Where `path` is written before it is renamed into place: beside it
    (a rename across file systems would be a copy), hidden, and this
    process's own (two writers never share one)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


# --- whole or absent ---

def atomic_write(path: Path, write: Callable[[BinaryIO], None], overwrite: bool = True) -> None:
    """Write to a temporary file beside `path`, flush it to disk, then rename it
    over `path`, and flush the rename: readers see the old file or the new
    one, never half of one, and after a crash of the node, too. Without
    `overwrite` the file is linked into place instead, which raises
    FileExistsError where `path` exists (one made by another writer
    meanwhile, too) and leaves it as it is."""
    temporary = temporary_sibling(path)
    try:
        with open(temporary, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        if overwrite:
            os.replace(temporary, path)
        else:
            os.link(temporary, path)  # atomic, and refuses an existing name
        sync_directory(path.parent)
    finally:
        if temporary.exists():
            temporary.unlink()


def atomic_write_text(path: Path, write: Callable[[TextIO], None], overwrite: bool = True) -> None:
    """atomic_write for text (CSV_TEXT's encoding: names that are not valid
    UTF-8 are kept as their bytes)."""
    def write_text(handle: BinaryIO) -> None:
        text = io.TextIOWrapper(handle, encoding=CSV_TEXT["encoding"], errors=CSV_TEXT["errors"],
                                newline=CSV_TEXT["newline"])
        write(text)
        text.flush()
        text.detach()  # atomic_write flushes and closes the file itself

    atomic_write(path, write_text, overwrite)


def sync_directory(folder: Path) -> None:
    """Flush `folder`'s entries to disk, as databases do after a rename: the
    file's own fsync does not cover its name, so a node that crashes right
    after a save could come back with the name pointing at the old file, or
    at none. A filesystem that cannot sync a directory (some network ones
    refuse) keeps its renames as durable as it makes them."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def link_atomically(source: Path, destination: Path) -> None:
    """Make `destination` the same file as `source` (a hard link: no second
    copy on disk; a copy where links are not supported), replacing it at once."""
    temporary = temporary_sibling(destination)
    try:
        try:
            os.link(source, temporary)
        except OSError:
            with open(source, "rb") as original:
                atomic_write(temporary, lambda handle: shutil.copyfileobj(original, handle))
        os.replace(temporary, destination)
        sync_directory(destination.parent)
    finally:
        if temporary.exists():
            temporary.unlink()


# --- CSV files that grow by rows ---

def rewrite_rows(path: Path, columns: List[str], rows: List[dict]) -> None:
    """Replace a CSV file by these rows under these columns (a new file
    renamed over it: later appends never reach a copy kept by a link). A
    write that fails (a full disk) raises and leaves the old file as it was."""
    def write(handle: TextIO) -> None:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)

    atomic_write_text(path, write)


def append_rows(path: Path, columns: List[str], rows: List[dict]) -> None:
    """Append rows to a CSV file, with the header when the file is new; a
    missing value is an empty cell. A file written with other columns (an
    older version's metrics.csv, being resumed) is first rewritten with these,
    its rows kept, so every row matches the header. An append that fails (a
    full disk) raises and is undone: the file is cut back to its size before
    (a new one removed), never left with half a row, nor shorter. A last row
    that a killed process left unfinished (no line break) is cut off first
    (_cut_unfinished_row); rewritten, only whole rows are kept."""
    new_file = not path.is_file()
    if not new_file:
        with open(path, **CSV_TEXT) as handle:  # the header only, unless it differs (io.csv grows long)
            header_line = handle.readline()
        if next(csv.reader([header_line]), None) != columns or not header_line.endswith("\n"):
            rewrite_rows(path, columns, read_whole_rows(path).rows)
        else:
            _cut_unfinished_row(path)
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns)
    if new_file:
        writer.writeheader()
    writer.writerows(rows)
    append_whole(path, text.getvalue().encode(CSV_TEXT["encoding"], CSV_TEXT["errors"]), remove_if_new=new_file)


def _cut_unfinished_row(path: Path, chunk_bytes: int = 65536) -> None:
    """Cut a file back to the end of its last whole line. Appended to, a
    row a process was killed writing would take the next row into its line
    (too many fields: both lost to readers), or, cut inside its last value,
    end as a whole-looking row holding half a number. It was never written
    whole; a resume sets metrics.csv's aside first (RunDirectory.set_aside_after).
    The file's first line ends with a line break (append_rows checked)."""
    with open(path, "rb+") as handle:
        end = position = handle.seek(0, os.SEEK_END)
        while position > 0:
            start = max(0, position - chunk_bytes)
            handle.seek(start)
            chunk = handle.read(position - start)
            line_end = chunk.rfind(b"\n")
            if line_end >= 0:
                if start + line_end + 1 < end:
                    handle.truncate(start + line_end + 1)
                return
            position = start


@dataclasses.dataclass
class WholeRows:
    """A CSV file's header, its whole rows (as dicts), and the line numbers
    (the header is line 1) of the rows that were not read."""
    path: Path
    columns: List[str]
    rows: List[dict]
    cut_lines: List[int]

    def warning(self) -> Optional[str]:
        """One line naming the file and the rows not read; None when every row was whole."""
        if not self.cut_lines:
            return None
        shown = ", ".join(map(str, self.cut_lines[:5])) + (", ..." if len(self.cut_lines) > 5 else "")
        return (f"warning: {self.path}: {len(self.cut_lines)} row(s) not whole (cut short by a crash, or damaged), "
                f"not read: line(s) {shown}; read the {len(self.rows)} whole row(s)")


def read_whole_rows(path: Path, whole: Optional[Callable[[dict], bool]] = None) -> WholeRows:
    """The rows of a CSV file that grows by rows (append_rows) that were
    written whole. A process killed mid-append (kill -9, a node's crash)
    leaves a last line without its line break, where a number may be cut
    in half; a later append on it made one line of too many fields. Such
    rows, any with another number of fields than the header, and any that
    `whole(row)` refuses (a value that is not what its column holds) are
    left out and their lines named (WholeRows.warning). A file that is not
    CSV raises csv.Error; an empty one has no columns."""
    with open(path, **CSV_TEXT) as handle:
        text = handle.read()
    reader = csv.reader(io.StringIO(text, newline=""))
    records, line = [], 1
    for fields in reader:
        if fields:  # not a blank line
            records.append((line, fields))
        line = reader.line_num + 1
    if records and not text.endswith("\n"):
        records[-1] = (records[-1][0], None)  # the last line has no line break: written only in part
    columns = records[0][1] if records and records[0][1] is not None else []
    rows, cut_lines = [], [number for number, fields in records[:1] if fields is None]
    for number, fields in records[1:]:
        row = dict(zip(columns, fields)) if fields is not None and len(fields) == len(columns) else None
        if row is not None and (whole is None or whole(row)):
            rows.append(row)
        else:
            cut_lines.append(number)
    return WholeRows(path, columns, rows, cut_lines)


def append_whole(path: Path, data: bytes, remove_if_new: bool = True) -> None:
    """Append `data` to `path` (created if missing) all or nothing: a write
    that fails partway (a full disk, a quota) is cut off again and the error
    raised, so the file never ends in half a row or record. Unbuffered, so
    no buffer is left to be written behind the cut when the file is closed."""
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size_before = os.fstat(descriptor).st_size
        try:
            remaining = memoryview(data)
            while remaining:
                remaining = remaining[os.write(descriptor, remaining):]
        except OSError:
            os.ftruncate(descriptor, size_before)  # frees blocks: it needs no room
            if remove_if_new and size_before == 0:
                with contextlib.suppress(OSError):
                    path.unlink()
            raise
    finally:
        os.close(descriptor)


# --- sizes and places ---

def format_bytes(count: Optional[int]) -> str:
    """A byte count for people: decimal units (1 KB = 1000 B, as df -H and
    disk makers count), one decimal above bytes; "0 B" for none."""
    if not count:
        return "0 B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if count < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000


def room_at(path: Path) -> Tuple[int, int]:
    """(free bytes, free inodes) for an unprivileged writer on the file
    system that holds `path`, or would hold it once the folders on the way
    to it are made."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    stats = os.statvfs(where)
    return stats.f_bavail * stats.f_frsize, stats.f_favail


# File systems that every node of a cluster sees alike (a dataset on one is listed once per job, by rank 0;
# a node-local copy is checked on each node: common.dataset_lists.find_lists). FUSE mounts count too.
SHARED_FILESYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "cifs", "smb3", "glusterfs",
                      "wekafs", "panfs", "afs", "pvfs2", "orangefs", "9p", "virtiofs")


def on_shared_filesystem(path: str) -> bool:
    """Whether `path` is on a network or cluster file system (by its type in /proc/self/mountinfo)."""
    fstype = filesystem_type(path)
    return fstype in SHARED_FILESYSTEMS or fstype.startswith("fuse")


def filesystem_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """The type of the file system holding `path` (the longest mount point above it)."""
    target, best, fstype = os.path.realpath(path), "", "unknown"
    try:
        with open(mountinfo) as handle:
            for line in handle:
                before, _, after = line.partition(" - ")
                mount_point = before.split()[4].replace("\\040", " ")
                inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) > len(best):
                    best, fstype = mount_point, after.split()[0]
    except (OSError, IndexError):
        pass
    return fstype


# --- the user's cache folder ---

CACHE_FOLDER_NAME = "imagenet-reference"  # the architectures' names and the file lists' scans, each in a subfolder


def user_cache_folder(environ: Mapping[str, str] = os.environ) -> Optional[Path]:
    """This project's folder in the user's cache folder, by the XDG base
    directory rules: $XDG_CACHE_HOME when it is an absolute path (a relative
    one is ignored, as the specification says: it would put the cache inside
    whatever folder a run starts in), else ~/.cache. None without either (no
    home folder, as some containers run)."""
    configured = environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(configured):
        return Path(configured) / CACHE_FOLDER_NAME
    try:
        return Path.home() / ".cache" / CACHE_FOLDER_NAME
    except (RuntimeError, KeyError):  # Path.home() of a user with no home folder
        return None
