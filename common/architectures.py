"""The names of torchvision's image classification models (-a/--arch), known
without importing torchvision where possible.

Importing torchvision (and so torch) takes seconds and hundreds of MiB;
the command line needs only the names, for --help and to check -a. The
list stays torchvision's own: torchvision itself lists them the first time
a version of it is seen, and they are kept in the user's cache folder, one
small JSON file per torchvision version (its installed version is read from
the package metadata, without importing it). A cache that is missing,
unreadable or not what this module writes is listed again silently; one
that cannot be written only costs the next start the same import.
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import re
import tempfile
from pathlib import Path
from typing import List, Optional

from common.files import user_cache_folder


@functools.lru_cache(maxsize=1)
def available_architectures() -> List[str]:
    """Names of torchvision's image classification models (torchvision.models
    itself, not its detection/segmentation/video/optical-flow submodules),
    sorted: from the cache of the installed torchvision version, or listed
    by torchvision (and then cached)."""
    version = _installed_torchvision_version()
    cache = _cache_file(version) if version else None
    names = _read_cache(cache, version) if cache else None
    if names is None:
        names = _list_torchvision_architectures()
        if cache:
            _write_cache(cache, version, names)
    return names


def _list_torchvision_architectures() -> List[str]:
    import torchvision  # the slow path, once per torchvision version: why this module exists

    return sorted(torchvision.models.list_models(module=torchvision.models))


def _installed_torchvision_version() -> Optional[str]:
    """torchvision's version from its package metadata; None where it has none
    (a source checkout on sys.path): then nothing is cached."""
    try:
        return importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        return None


def _cache_file(version: str) -> Optional[Path]:
    folder = user_cache_folder()
    if folder is None:
        return None
    # A local version ("0.21.0+cu124") stays readable; anything else a file name cannot hold becomes "_".
    return folder / "architectures" / f"torchvision-{re.sub(r'[^A-Za-z0-9.+_-]', '_', version)}.json"


def _read_cache(path: Path, version: str) -> Optional[List[str]]:
    """The names cached at `path` for torchvision `version`; None when there
    are none, or the file is not a list this module wrote for that version."""
    try:
        with open(path, encoding="utf-8") as handle:
            cached = json.load(handle)
    except (OSError, ValueError):  # missing, unreadable, not JSON (ValueError covers bad UTF-8 too)
        return None
    if not isinstance(cached, dict) or cached.get("torchvision") != version:
        return None
    names = cached.get("architectures")
    if not isinstance(names, list) or not names or not all(isinstance(name, str) and name for name in names):
        return None
    return names


def _write_cache(path: Path, version: str, names: List[str]) -> None:
    """Write the names atomically (a temporary file renamed over `path`):
    a process reading it meanwhile sees the old file, or none, never half of
    one. A folder that cannot be written leaves the cache out."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump({"torchvision": version, "architectures": names}, handle)
        os.replace(temporary, path)
    except OSError:
        pass
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
