"""A dataset's lists: its classes and each split's (path, class index)
samples, from a scan of DATA, the cache of an earlier scan, or --file-list;
held compactly, and found once per job.

Layout read: DATA/train/<class>/<image> and DATA/val/<class>/<image>, as
torchvision's ImageFolder; class indices come from train/ and val/ uses the
same mapping. Image files are found by extension, case-insensitive (what
they really are is the decoder's business: common.pipelines); other files
(and FIFOs, sockets, hidden files) are ignored, and a folder that cannot be
listed stops the run, naming it.

Held compactly: a Python list of (str, int) tuples costs about 200 bytes an
image in objects, and it is not only memory: a data-loading worker forked
from the training process shares those pages until it reads a sample, which
writes the objects' reference counts, so page by page each worker ends up
with a private copy (the copy-on-read growth PyTorch's DataLoader
documentation warns about). At ImageNet's 1.28M images a worker that reads
every sample once copied 265 MiB of them (the bench's data-scale section;
FileList: 0.14 MiB), in each of the 80 workers a node has at the upstream's
launch. FileList keeps the paths' bytes in one numpy buffer, the offset
where each one ends in a second array and the class indices in a third:
three objects, whatever the number of images. Reading a sample builds the
tuple it returns and writes to no page of the list.

Found once per job (find_lists): the primary process reads --file-list (a
text file of "split/relative/path label" lines, the format of DALI's file
reader, that `python -m common.tools.filelist` writes), or the cache of an
earlier scan (a small .npz file, used while every folder the scan listed
keeps its modification and change times), or scans DATA; the others
receive its lists.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import operator
import os
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np

from common.distributed import Context, decided_by_primary, spans_processes
from common.errors import UsageError
from common.files import atomic_write, on_shared_filesystem, user_cache_folder
from common.image_files import read_file
from common.storage import Fetched

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SPLITS = ("train", "val")


class FileList(Sequence):
    """The samples (path, class index) in order, as a read-only sequence.
    Paths are stored as the file system's bytes (os.fsencode), so a name that
    is not valid UTF-8 comes back as the same str the scan found. `prefix`,
    which every path starts with (the split folder and a separator, for a
    scanned tree), is stored once."""

    def __init__(self, samples: Iterable[Tuple[str, int]] = (), prefix: str = ""):
        names: List[bytes] = []
        targets: List[int] = []
        for path, target in samples:
            if not path.startswith(prefix):
                raise ValueError(f"{path!r} does not start with the list's prefix {prefix!r}")
            names.append(os.fsencode(path[len(prefix):]))
            targets.append(target)
        self.prefix = prefix
        self.path_bytes, self.path_ends = pack(names)
        self.targets = np.asarray(targets, dtype=np.int16 if max(targets, default=0) < 2 ** 15 else np.int64)

    @property
    def nbytes(self) -> int:
        """The memory the samples take (their arrays)."""
        return self.path_bytes.nbytes + self.path_ends.nbytes + self.targets.nbytes

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: Union[int, slice]):
        if isinstance(index, slice):
            return [self[position] for position in range(*index.indices(len(self)))]
        index = operator.index(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        return self.prefix + os.fsdecode(unpack_one(self.path_bytes, self.path_ends, index)), int(self.targets[index])

    def __repr__(self) -> str:
        return f"FileList({len(self)} samples under {self.prefix!r}, {self.nbytes} bytes)"

    def same_samples(self, other: "FileList") -> bool:
        """Whether `other` holds the same samples after its prefix (DATA's
        place may differ from node to node), in the same order."""
        return (np.array_equal(self.path_ends, other.path_ends) and np.array_equal(self.targets, other.targets)
                and np.array_equal(self.path_bytes, other.path_bytes))

    def with_prefix(self, prefix: str) -> "FileList":
        """The same samples under another prefix (the arrays are shared, not copied)."""
        moved = copy.copy(self)
        moved.prefix = prefix
        return moved

    def arrays(self, name: str) -> Dict[str, np.ndarray]:
        """The list as named arrays (for np.savez); from_arrays reads them back."""
        prefix_bytes, _ = pack([os.fsencode(self.prefix)])
        return {f"{name}_prefix": prefix_bytes, f"{name}_path_bytes": self.path_bytes,
                f"{name}_path_ends": self.path_ends, f"{name}_targets": self.targets}

    @classmethod
    def from_arrays(cls, arrays, name: str) -> "FileList":
        listed = cls()
        listed.prefix = os.fsdecode(arrays[f"{name}_prefix"].tobytes())
        listed.path_bytes, listed.path_ends = arrays[f"{name}_path_bytes"], arrays[f"{name}_path_ends"]
        listed.targets = arrays[f"{name}_targets"]
        if len(listed.path_ends) != len(listed.targets):
            raise ValueError(f"{name}: {len(listed.path_ends)} paths but {len(listed.targets)} classes")
        return listed


class ImageFiles(Sequence):
    """The reader of a folder tree's images: its FileList's (path, class
    index) samples, each read whole from the file system. A sharded
    dataset's split (common.shards.ShardedSplit) is the other reader: the
    same sequence of (name, class index), each read from its shard."""

    def __init__(self, files: FileList):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index):
        return self.files[index]

    def read(self, index: int) -> Fetched:
        data = read_file(self.files[index][0])
        return Fetched(data, source_bytes=len(data))


def pack(names: List[bytes]) -> Tuple[np.ndarray, np.ndarray]:
    """Byte strings as one uint8 buffer and the offset where each one ends
    (uint32 while the buffer is under 4 GiB)."""
    ends = np.cumsum(np.fromiter(map(len, names), dtype=np.int64, count=len(names)))
    buffer = np.frombuffer(b"".join(names), dtype=np.uint8)
    return buffer, ends.astype(np.uint32) if not len(ends) or ends[-1] < 2 ** 32 else ends


def unpack_one(buffer: np.ndarray, ends: np.ndarray, index: int) -> bytes:
    start = int(ends[index - 1]) if index else 0
    return buffer[start:int(ends[index])].tobytes()


def unpack(buffer: np.ndarray, ends: np.ndarray) -> List[bytes]:
    return [unpack_one(buffer, ends, index) for index in range(len(ends))]


@dataclasses.dataclass
class DatasetLists:
    """A dataset's class names and both splits' samples; the notes to show
    before training (the scan's warnings); and the folders the scan listed,
    each with its times (folder_times) read before listing it: a folder's
    times change when a file in it is added, removed or renamed, so a cached
    scan whose folders all keep theirs still lists the tree."""
    classes: List[str]
    train: FileList
    val: FileList
    notes: List[str] = dataclasses.field(default_factory=list)
    folders: List[Tuple[str, int, int]] = dataclasses.field(default_factory=list)


def folder_times(folder: str) -> Tuple[str, int, int]:
    """(folder, modification time, change time), in ns. Either changes when
    a file in the folder is added, removed or renamed; the modification time
    can be set back afterwards (touch -r, rsync -t, a restore tool), but the
    change time cannot: setting the other times sets it to now."""
    status = os.stat(folder)
    return folder, status.st_mtime_ns, status.st_ctime_ns


# --- scanning DATA ---

class FolderOwners:
    """Which class folder first reached each real folder, across the splits
    scanned with it. A folder reached from two class folders (a symbolic link
    to another class's or the other split's folder) puts the same files
    under two labels, or validates on training images: said, not refused,
    as some trees are built that way on purpose."""

    def __init__(self):
        self.owner: Dict[str, str] = {}  # real folder -> the class folder (as listed) that reached it first
        self.shared: Dict[Tuple[str, str], str] = {}  # (first class folder, second one) -> one real folder of both

    def claim(self, real_folder: str, class_dir: str) -> None:
        first = self.owner.setdefault(real_folder, class_dir)
        if first != class_dir:
            self.shared.setdefault((first, class_dir), real_folder)

    def warnings(self) -> List[str]:
        return [f"warning: {second} reaches the same files as {first} ({real}, through a symbolic link): they count "
                f"under both, so the same images have two labels, or are validated on after training on them"
                for (first, second), real in self.shared.items()]


def _image_files(class_dir: Path, owners: Optional[FolderOwners] = None,
                 folders: Optional[List[Tuple[str, int, int]]] = None) -> List[str]:
    """Image files under a class folder (recursively, following symlinks),
    by extension, case-insensitive. Hidden files and folders, other
    extensions and anything that is not a regular file (a FIFO would block
    the reader forever) are ignored; a broken symlink is kept, so the
    --bad-images policy reports it. A folder that cannot be listed stops the
    run, naming it: silently fewer images would be a different dataset.
    `owners` notes which real folders this class folder reached; `folders`
    gets each folder listed, with its times read before listing it (the
    cache's check: load_cache)."""
    found = []
    pending = [str(class_dir)]
    seen = set()  # real paths: a symlink back up the tree must not loop forever
    while pending:
        folder = pending.pop()
        real_folder = os.path.realpath(folder)
        if real_folder in seen:
            continue
        seen.add(real_folder)
        if owners is not None:
            owners.claim(real_folder, str(class_dir))
        try:
            if folders is not None:
                folders.append(folder_times(folder))
            entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
        except OSError as error:
            raise UsageError(f"{folder}: cannot list the folder ({error.strerror})") from None
        subfolders = []
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if _follows_to(entry, os.DirEntry.is_dir):  # os.walk order: files first, then subfolders, sorted
                subfolders.append(entry.path)
            elif entry.name.lower().endswith(IMAGE_EXTENSIONS) and (_follows_to(entry, os.DirEntry.is_file) or
                                                                     _is_broken_link(entry)):
                found.append(entry.path)
        pending.extend(reversed(subfolders))
    return found


def _follows_to(entry: os.DirEntry, kind) -> bool:
    """entry.is_dir() or .is_file(), following symlinks; False where that
    fails (a link loop, a target that cannot be looked at)."""
    try:
        return kind(entry)
    except OSError:
        return False


def _is_broken_link(entry: os.DirEntry) -> bool:
    """A symlink whose target cannot be reached: missing, a loop, not permitted."""
    if not entry.is_symlink():
        return False
    try:
        os.stat(entry.path)
        return False
    except OSError:
        return True


def scan_split(split_dir: Path, class_to_idx: Optional[Dict[str, int]] = None,
               owners: Optional[FolderOwners] = None,
               folders: Optional[List[Tuple[str, int, int]]] = None) -> Tuple[List[str], FileList]:
    """The classes and (path, class index) samples of one split folder.

    With `class_to_idx` (train's mapping, when scanning val/) every class
    folder must be one of train's classes. `owners`, shared by the splits
    of a dataset, notes folders reached from two class folders; `folders`
    gets every folder listed and its times (_image_files).
    """
    try:
        if folders is not None:
            folders.append(folder_times(str(split_dir)))
        entries = [entry for entry in os.scandir(split_dir) if not entry.name.startswith(".")]
    except OSError as error:
        raise UsageError(f"{split_dir}: cannot list the folder ({error.strerror})") from None
    for entry in entries:  # a class folder whose link points nowhere would shift every later class index
        if not _follows_to(entry, os.DirEntry.is_dir) and _is_broken_link(entry):
            raise UsageError(f"{entry.path}: class folder is a broken symbolic link (to {os.readlink(entry.path)})")
    classes = sorted(entry.name for entry in entries if _follows_to(entry, os.DirEntry.is_dir))
    if not classes:
        raise UsageError(f"{split_dir}: no class folders (expected {split_dir}/<class>/<images>)")
    if class_to_idx is None:
        class_to_idx = {name: index for index, name in enumerate(classes)}

    def samples():
        for name in classes:
            if name not in class_to_idx:
                raise UsageError(f"{split_dir / name}: class {name!r} is not among the classes of train/")
            files = _image_files(split_dir / name, owners, folders)
            if not files:
                raise UsageError(f"{split_dir / name}: class folder has no images "
                                 f"(looked for {', '.join(IMAGE_EXTENSIONS)})")
            yield from ((path, class_to_idx[name]) for path in files)

    return classes, FileList(samples(), prefix=str(split_dir) + os.sep)


def scan_dataset(root: Path) -> DatasetLists:
    """Scan DATA's train/ and val/ (val with train's class indices)."""
    owners, folders = FolderOwners(), []
    classes, train = scan_split(root / "train", owners=owners, folders=folders)
    _, val = scan_split(root / "val", {name: index for index, name in enumerate(classes)}, owners, folders)
    return DatasetLists(classes, train, val, owners.warnings(), folders)



# --- the scan's cache ---

CACHE_VERSION = 2  # 2: each folder's change time beside its modification time


def cache_file(data: str) -> Optional[Path]:
    """Where the scan of the dataset folder `data` is cached: in the user's
    cache folder (files.user_cache_folder: an absolute XDG_CACHE_HOME, else
    ~/.cache), one file per dataset (by its real path), so every run of the
    user on that data shares it; not in LOGDIR, whose folders are the runs.
    None without either (no home folder)."""
    folder = user_cache_folder()
    if folder is None:
        return None
    real = os.path.realpath(data)
    digest = hashlib.sha1(os.fsencode(real)).hexdigest()[:12]
    return folder / "file-lists" / f"{os.path.basename(real) or 'root'}-{digest}.npz"


def _strings(name: str, values: Iterable[str]) -> Dict[str, np.ndarray]:
    buffer, ends = pack([os.fsencode(value) for value in values])
    return {f"{name}_bytes": buffer, f"{name}_ends": ends}


def _read_strings(arrays, name: str) -> List[str]:
    return [os.fsdecode(value) for value in unpack(arrays[f"{name}_bytes"], arrays[f"{name}_ends"])]


def save_cache(path: Path, lists: DatasetLists) -> None:
    """Write `lists` to `path` atomically (readers see the old file or the new one)."""
    arrays = {"version": np.int64(CACHE_VERSION), **_strings("classes", lists.classes),
              **_strings("notes", lists.notes), **_strings("folders", [folder for folder, *_ in lists.folders]),
              "folder_mtimes": np.asarray([mtime for _, mtime, _ in lists.folders], dtype=np.int64),
              "folder_ctimes": np.asarray([ctime for *_, ctime in lists.folders], dtype=np.int64),
              **lists.train.arrays("train"), **lists.val.arrays("val")}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda handle: np.savez(handle, **arrays))


def load_cache(path: Path) -> Optional[DatasetLists]:
    """The cached lists while every folder the scan listed keeps both its
    times (folder_times); None (scan again) when there is no cache, it cannot
    be read, it is of another version, or a folder changed or went away."""
    try:
        with np.load(path, allow_pickle=False) as arrays:
            if int(arrays["version"]) != CACHE_VERSION:
                return None
            folders = list(zip(_read_strings(arrays, "folders"), arrays["folder_mtimes"].tolist(),
                               arrays["folder_ctimes"].tolist()))
            if not folders or any(folder_times(listed[0]) != listed for listed in folders):
                return None
            return DatasetLists(_read_strings(arrays, "classes"), FileList.from_arrays(arrays, "train"),
                                FileList.from_arrays(arrays, "val"), _read_strings(arrays, "notes"), folders)
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None


# --- --file-list's text format ---

MAX_LABEL_DIGITS = 18  # a class number below 10**18: within int64, as FileList keeps them

def write_text_list(handle: BinaryIO, lists: DatasetLists) -> int:
    """--file-list's format: one "split/relative/path label" line per image
    (relative to DATA; train's lines, then val's), in the lists' order, as
    the file system's bytes. Returns the number of lines."""
    lines = 0
    for split, listed in zip(SPLITS, (lists.train, lists.val)):
        for index in range(len(listed)):
            name = unpack_one(listed.path_bytes, listed.path_ends, index)
            if b"\n" in name or b"\r" in name:
                raise UsageError(f"{listed[index][0]!r}: a file name with a line break cannot be listed; rename it")
            handle.write(b"%s/%s %d\n" % (split.encode(), name, listed.targets[index]))
            lines += 1
    return lines


def read_text_list(list_path: str, data: str) -> DatasetLists:
    """--file-list: the lists of a "split/relative/path label" file, paths
    relative to DATA. The class names are the folders under train/ that the
    labels name, 0 to K-1 each naming one; val's lines must use train's
    labels. Every listed file must exist (each folder is listed once to see).
    A val/ path listed twice is refused (validation counts each image once);
    a train/ path listed again is trained on as often as listed, and said in
    a note. Any mistake is a UsageError naming the line or the file."""
    flag = f"argument --file-list: {list_path}"
    by_split, repeats = _read_lines(list_path, flag)
    if repeats["val"]:
        number, first, relative = repeats["val"][0]
        raise UsageError(f"{flag}: line {number}: val/{os.fsdecode(relative)} is listed again (first on line "
                         f"{first}; {len(repeats['val'])} repeated val/ line(s) in all): validation counts each "
                         f"image once; remove the repeats")
    classes = _classes_of(by_split, flag)
    _check_present(by_split, data, flag)
    lists = [FileList(((os.fsdecode(os.fsencode(str(Path(data) / split)) + b"/" + relative), label)
                       for relative, label in by_split[split]), prefix=str(Path(data) / split) + os.sep)
             for split in SPLITS]
    notes = []
    if repeats["train"]:
        number, first, relative = repeats["train"][0]
        notes.append(f"note: --file-list {list_path}: {len(repeats['train'])} training line(s) repeat an earlier "
                     f"line (the first: line {number}, train/{os.fsdecode(relative)}, as line {first}): those "
                     f"images are trained on as often as they are listed")
    return DatasetLists(classes, *lists, notes=notes)


def _read_lines(list_path: str, flag: str) -> Tuple[Dict[str, List[Tuple[bytes, int]]],
                                                     Dict[str, List[Tuple[int, int, bytes]]]]:
    """--file-list's (relative path, label) entries by split, and each
    split's repeats: (line, the earlier line of the same path, the path).
    The paths are compared as written: a path must name its file plainly
    (no empty, '.' or '..' part), so that one file has one spelling."""
    by_split: Dict[str, List[Tuple[bytes, int]]] = {split: [] for split in SPLITS}
    first_lines: Dict[str, Dict[bytes, int]] = {split: {} for split in SPLITS}
    repeats: Dict[str, List[Tuple[int, int, bytes]]] = {split: [] for split in SPLITS}
    try:
        with open(list_path, "rb") as handle:
            for number, line in enumerate(handle, 1):
                line = line.rstrip(b"\r\n")
                if not line.strip():
                    continue
                name, _, label = line.rpartition(b" ")
                split, _, relative = name.partition(b"/")
                if not label.isdigit() or split.decode(errors="replace") not in SPLITS or b"/" not in relative:
                    raise UsageError(f"{flag}: line {number}: expected 'train/<class>/<file> LABEL' or "
                                     f"'val/<class>/<file> LABEL', got {line[:120]!r}")
                if len(label) > MAX_LABEL_DIGITS:  # int() refuses 4,300 digits and more; no class count is near
                    raise UsageError(f"{flag}: line {number}: label {label[:24].decode()}... has {len(label):,} "
                                     f"digits; labels are class numbers, 0 to K-1")
                if any(part in (b"", b".", b"..") for part in relative.split(b"/")):
                    raise UsageError(f"{flag}: line {number}: {name[:120]!r} has an empty, '.' or '..' part; "
                                     f"name each file plainly, as '{split.decode()}/<class>/<file>'")
                first = first_lines[split.decode()].setdefault(relative, number)
                if first != number:
                    repeats[split.decode()].append((number, first, relative))
                by_split[split.decode()].append((relative, int(label)))
    except OSError as error:
        raise UsageError(f"{flag}: cannot read it ({error.strerror})") from None
    return by_split, repeats


def _classes_of(by_split: Dict[str, List[Tuple[bytes, int]]], flag: str) -> List[str]:
    """Train's class names by label (the folder each label's paths start in)."""
    names: Dict[int, set] = collections.defaultdict(set)
    for relative, label in by_split["train"]:
        names[label].add(relative.split(b"/", 1)[0])
    if not by_split["train"] or not by_split["val"]:
        empty = "train" if not by_split["train"] else "val"
        raise UsageError(f"{flag}: no {empty}/ lines")
    if max(names) != len(names) - 1:  # K distinct labels >= 0 are 0 to K-1 exactly when the largest is K-1
        raise UsageError(f"{flag}: train's labels must be 0 to K-1, each used; missing {_smallest_missing(names)}")
    for label, folders in names.items():
        if len(folders) > 1:
            raise UsageError(f"{flag}: label {label} names {len(folders)} class folders under train/ "
                             f"({', '.join(sorted(map(os.fsdecode, folders))[:3])})")
    classes = [os.fsdecode(next(iter(names[label]))) for label in range(len(names))]
    index = {name: label for label, name in enumerate(classes)}
    for relative, label in by_split["val"]:
        folder = os.fsdecode(relative.split(b"/", 1)[0])
        if index.get(folder) != label:
            raise UsageError(f"{flag}: val/{os.fsdecode(relative)} has label {label}, but train/ gives "
                             f"{folder!r} {'label ' + str(index[folder]) if folder in index else 'no label'}")
    return classes


def _smallest_missing(labels) -> int:
    """The smallest label >= 0 not among `labels`: in time and memory of their
    count, whatever their values (a label of 10**15 in a list of ten lines
    costs ten lines' work, not a set of 10**15 numbers)."""
    below = sorted(label for label in labels if label < len(labels))  # the answer is at most len(labels)
    return next((index for index, label in enumerate(below) if label != index), len(below))


def _check_present(by_split: Dict[str, List[Tuple[bytes, int]]], data: str, flag: str) -> None:
    """Every listed file exists: each folder named is listed once."""
    wanted: Dict[bytes, set] = collections.defaultdict(set)
    for split, entries in by_split.items():
        for relative, _ in entries:
            folder, _, name = (split.encode() + b"/" + relative).rpartition(b"/")
            wanted[folder].add(name)
    root = os.fsencode(data)
    missing = []
    for folder, names in wanted.items():
        try:
            present = set(os.listdir(os.path.join(root, folder)))
        except OSError:
            present = set()
        missing.extend(os.path.join(root, folder, name) for name in sorted(names - present))
    if missing:
        raise UsageError(f"{flag}: {len(missing)} listed file(s) missing, e.g. {os.fsdecode(missing[0])}")


# --- once per job ---

def find_lists(data: str, file_list: Optional[str], ctx: Context) -> DatasetLists:
    """The classes and samples of the dataset folder `data` (DATA), found once
    per job: the primary reads `file_list` (--file-list), or the cache of an
    earlier scan while its folders are unchanged, or scans DATA (and caches
    what it found: cache_file); every other process receives the lists from
    it instead of scanning the shared file system too. A mistake the primary
    meets is everyone's. Where DATA is on a node's own disk, the first
    process of each other node also checks its copy against them
    (_check_this_nodes_copy)."""
    found = decided_by_primary(lambda: _read_or_scan(data, file_list), ctx)
    # Rank 0's lists, under this process's DATA: a node may hold its copy elsewhere.
    found = dataclasses.replace(found, **{split: getattr(found, split).with_prefix(str(Path(data) / split) + os.sep)
                                          for split in SPLITS})
    if spans_processes(ctx) and ctx.local_rank == 0 and not ctx.is_primary and not on_shared_filesystem(data):
        _check_this_nodes_copy(data, file_list, found)  # a node-local copy of DATA (staged on local disk) may differ
    return found


def _check_this_nodes_copy(data: str, file_list: Optional[str], primary: DatasetLists) -> None:
    """This node's DATA holds what rank 0's lists name: the first process of
    each other node lists its own copy (not the cache, which is rank 0's) and
    compares. One listing per node, not per process."""
    mine = read_text_list(file_list, data) if file_list else scan_dataset(Path(data))
    for split in SPLITS:
        ours, theirs = getattr(mine, split), getattr(primary, split)
        if not ours.same_samples(theirs):
            shorter = min(len(ours), len(theirs))
            index = next((index for index in range(shorter) if ours[index] != theirs[index]), shorter)
            first = (ours if index < len(ours) else theirs)[index][0]
            raise UsageError(f"DATA {data}: this node's copy differs from rank 0's ({len(ours):,} {split} images "
                             f"here, {len(theirs):,} there; the first that differs: {first})")


def _read_or_scan(data: str, file_list: Optional[str]) -> DatasetLists:
    """The primary's part of find_lists: the lists from `file_list`, the
    cache or a scan (cached), with a last note saying which and how long it took."""
    started = time.monotonic()
    if file_list:
        lists = read_text_list(file_list, data)
        source = f"from --file-list {file_list}"
    else:
        cache = cache_file(data)
        lists = load_cache(cache) if cache is not None else None
        if lists is not None:
            source = f"from the cache {cache} (no folder changed since its scan)"
        else:
            lists = scan_dataset(Path(data))
            source = "scanned; not cached (no home folder: set XDG_CACHE_HOME to an absolute path)"
            try:
                if cache is not None:
                    save_cache(cache, lists)
                    source = f"scanned, cached in {cache}"
            except OSError as error:
                source = f"scanned; not cached ({cache}: {error.strerror or error})"
    images = f"{len(lists.train):,} training and {len(lists.val):,} validation images"
    return dataclasses.replace(lists, notes=[*lists.notes, f"file lists: {images}, {source}, in "
                                                           f"{time.monotonic() - started:.1f} s"])
