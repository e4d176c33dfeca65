"""The names of the image classification models -a/--arch takes:
torchvision's, and timm's as `timm/NAME` (timm is optional:
requirements-timm.txt), known without importing either where possible.

Importing torchvision or timm (and so torch) takes seconds and hundreds of
MiB; the command line needs only the names, for --help and to check -a. The
lists stay the packages' own: each package lists them the first time a
version of it is seen, and they are kept in the user's cache folder, one
small JSON file per package and version (its installed version is read from
the package metadata, without importing it). A cache that is missing,
unreadable or not what this module writes is listed again silently; one
that cannot be written only costs the next start the same import. timm's
list is read only for a `timm/` name or a name neither zoo knows, so a
torchvision run never pays for it.
"""
from __future__ import annotations

import difflib
import functools
import importlib.metadata
import importlib.util
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Callable, List, Optional

from common.errors import UsageError
from common.files import user_cache_folder

TIMM_PREFIX = "timm/"  # -a timm/NAME: timm's model NAME (or NAME.TAG, a tag of its pretrained weights)
TIMM_REQUIREMENTS = "requirements-timm.txt"


@functools.lru_cache(maxsize=1)
def available_architectures() -> List[str]:
    """Names of torchvision's image classification models (torchvision.models
    itself, not its detection/segmentation/video/optical-flow submodules),
    sorted: from the cache of the installed torchvision version, or listed
    by torchvision (and then cached)."""
    return _cached_names("torchvision", lambda: _list_torchvision_architectures())


@functools.lru_cache(maxsize=1)
def timm_architectures() -> Optional[List[str]]:
    """timm's model names (timm.list_models()) and the tagged names of its
    pretrained weights (NAME.TAG), sorted, without the `timm/` prefix; None
    where timm is not installed. Cached per timm version, as torchvision's."""
    if _timm_missing():
        return None
    return _cached_names("timm", lambda: _list_timm_architectures())


def is_timm(arch: str) -> bool:
    """Whether -a names one of timm's models (`timm/NAME`)."""
    return arch.startswith(TIMM_PREFIX)


def check_architecture(arch: str) -> None:
    """-a checked: a name of torchvision's, or `timm/NAME` of timm's with
    timm installed. A name neither knows is one line with the close names of
    both zoos (`resnet50d` suggests `timm/resnet50d`)."""
    if arch in available_architectures():
        return
    timm_names = timm_architectures()
    if is_timm(arch) and timm_names is None:
        raise UsageError(f"argument -a/--arch: {arch} is one of timm's models and timm is not installed "
                         f"(pip install -r {TIMM_REQUIREMENTS})")
    if is_timm(arch) and arch[len(TIMM_PREFIX):] in timm_names:
        return
    close = close_architectures(arch, timm_names or [])
    suggestion = f"; did you mean {', '.join(close[:-1])}{' or ' if len(close) > 1 else ''}{close[-1]}?" if close else ""
    timm_note = "" if timm_names is not None else f"; timm's models need pip install -r {TIMM_REQUIREMENTS}"
    raise UsageError(f"argument -a/--arch: unknown architecture {arch!r}{suggestion} "
                     f"(see --help for the list{timm_note})")


def close_architectures(arch: str, timm_names: List[str], per_zoo: int = 2) -> List[str]:
    """The names closest to a mistyped `arch`, as -a takes them: its exact
    name in the other zoo first, then up to `per_zoo` of each zoo's (difflib;
    the zoo it names first), timm's compared without their prefix and tags."""
    bare = arch[len(TIMM_PREFIX):] if is_timm(arch) else arch
    torchvision_names = available_architectures()
    timm_models = [name for name in timm_names if "." not in name]
    exact = [bare] if bare in torchvision_names else [TIMM_PREFIX + bare] if bare in timm_models else []
    from_torchvision = difflib.get_close_matches(bare, torchvision_names, n=per_zoo)
    from_timm = [TIMM_PREFIX + name for name in difflib.get_close_matches(bare, timm_models, n=per_zoo)]
    close = exact + (from_timm + from_torchvision if is_timm(arch) else from_torchvision + from_timm)
    return [name for index, name in enumerate(close) if name not in close[:index] and name != arch]


def _list_torchvision_architectures() -> List[str]:
    import torchvision  # the slow path, once per torchvision version: why this module exists

    return sorted(torchvision.models.list_models(module=torchvision.models))


def _list_timm_architectures() -> List[str]:
    import timm  # the slow path, once per timm version (and only for a timm/ name or an unknown one)

    return sorted(set(timm.list_models()) | set(timm.list_models(pretrained=True)))


def _timm_missing() -> bool:
    return importlib.util.find_spec("timm") is None


def _cached_names(package: str, list_names: Callable[[], List[str]]) -> List[str]:
    """`package`'s names from the cache of its installed version, or listed
    by `list_names` (and then cached)."""
    version = _installed_version(package)
    cache = _cache_file(package, version) if version else None
    names = _read_cache(cache, package, version) if cache else None
    if names is None:
        names = list_names()
        if cache:
            _write_cache(cache, package, version, names)
    return names


def _installed_version(package: str) -> Optional[str]:
    """A package's version from its metadata; None where it has none (a
    source checkout on sys.path): then nothing is cached."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cache_file(package: str, version: str) -> Optional[Path]:
    folder = user_cache_folder()
    if folder is None:
        return None
    # A local version ("0.21.0+cu124") stays readable; anything else a file name cannot hold becomes "_".
    return folder / "architectures" / f"{package}-{re.sub(r'[^A-Za-z0-9.+_-]', '_', version)}.json"


def _read_cache(path: Path, package: str, version: str) -> Optional[List[str]]:
    """The names cached at `path` for `package` `version`; None when there
    are none, or the file is not a list this module wrote for that version."""
    try:
        with open(path, encoding="utf-8") as handle:
            cached = json.load(handle)
    except (OSError, ValueError):  # missing, unreadable, not JSON (ValueError covers bad UTF-8 too)
        return None
    if not isinstance(cached, dict) or cached.get(package) != version:
        return None
    names = cached.get("architectures")
    if not isinstance(names, list) or not names or not all(isinstance(name, str) and name for name in names):
        return None
    return names


def _write_cache(path: Path, package: str, version: str, names: List[str]) -> None:
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
            json.dump({package: version, "architectures": names}, handle)
        os.replace(temporary, path)
    except OSError:
        pass
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
