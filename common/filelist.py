"""A dataset's (path, class index) samples, held compactly.

A Python list of (str, int) tuples costs about 175 bytes an image in
objects, and it is not only memory: a data-loading worker forked from the
training process shares those pages until it reads a sample, which writes
the objects' reference counts, so page by page each worker ends up with a
private copy (the copy-on-read growth PyTorch's DataLoader documentation
warns about). At ImageNet's 1.28M images a worker that reads every sample
once copied 227 MB (tests/test_data.py's reader; FileList: 0.2 MB), in each
of the 80 workers a node has at the upstream's launch.

FileList keeps the paths' bytes in one numpy buffer, the offset where each
one ends in a second array and the class indices in a third: three objects,
whatever the number of images. Reading a sample builds the tuple it returns
and writes to no page of the list.
"""
from __future__ import annotations

import operator
import os
from collections.abc import Sequence
from typing import Iterable, List, Tuple, Union

import numpy as np


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
        ends = np.cumsum(np.fromiter(map(len, names), dtype=np.int64, count=len(names)))
        self.path_bytes = np.frombuffer(b"".join(names), dtype=np.uint8)
        self.path_ends = ends.astype(np.uint32) if not len(ends) or ends[-1] < 2 ** 32 else ends
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
        start = int(self.path_ends[index - 1]) if index else 0
        name = self.path_bytes[start:int(self.path_ends[index])].tobytes()
        return self.prefix + os.fsdecode(name), int(self.targets[index])

    def __repr__(self) -> str:
        return f"FileList({len(self)} samples under {self.prefix!r}, {self.nbytes} bytes)"
