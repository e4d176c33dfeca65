"""Recipes by name (`--recipe NAME`): one small TOML file per published
training recipe in common/recipes/, naming its source, the result the source
published (top-1, epochs, hardware, wall time, as the source states them),
how the source's learning rate and batch map onto this project's rule, and
the flags that set it here, spelled as on the command line.

This module lists the files, reads and checks one, turns one of its flags
into command-line words and makes config.json's record of what a recipe set;
common.cli applies the flags (before the command line's, which win), and
common.tools.results tables the published figures. Bottom layer, torch-free:
it imports only errors and arguments, and TOML's parser when a file is read.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from common.arguments import did_you_mean
from common.errors import UsageError, error_summary

FOLDER = Path(__file__).resolve().parent / "recipes"
SUFFIX = ".toml"
_REPOSITORY = FOLDER.parent.parent
# A recipe file's tables and keys: all of them, and only these (a misspelt one is a mistake, not ignored).
FILE_KEYS = ("name", "source", "published", "notes", "flags")
# As the source states them: top-1 in percent, the epochs, the hardware, the wall time (text: "77.2 min",
# "~3 hours", "not stated"), and the page that states them (where it is not the recipe's source).
PUBLISHED_KEYS = {"top1": (int, float), "epochs": int, "hardware": str, "wall_time": str, "stated_in": str}
# A flag's long spelling without its dashes: mixup-alpha, lr-steps, b.
_FLAG_KEY = re.compile(r"[a-z0-9][a-z0-9-]*\Z")
_SCALARS = (bool, int, float, str)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One recipe file, read and checked (see FILE_KEYS)."""

    name: str
    path: Path
    source: str  # the URL of the recipe: a repository's configuration, a paper, a page
    published: dict  # PUBLISHED_KEYS
    notes: str  # how the source's lr and batch map onto --lr per 256 images, and what differs
    flags: Dict[str, object]  # long flag spelling (no dashes) -> value: bool for a switch, list for several values

    @property
    def shown_path(self) -> str:
        """The file as config.json and messages show it: relative to the
        repository (common/recipes/NAME.toml) where it is inside it."""
        try:
            return self.path.relative_to(_REPOSITORY).as_posix()
        except ValueError:
            return str(self.path)

    def mistake(self, key: str, what: str) -> UsageError:
        """The one line that names this file and one of its keys."""
        return UsageError(f"recipe file {self.shown_path}: key {key!r}: {what}")


def names(folder: Optional[Path] = None) -> List[str]:
    """The recipes there are (common/recipes/*.toml), by name, sorted: what
    --help lists, without reading a file."""
    folder = FOLDER if folder is None else folder
    try:
        return sorted(path.name[:-len(SUFFIX)] for path in folder.iterdir()
                      if path.name.endswith(SUFFIX) and path.is_file())
    except OSError:
        return []


def read(name: str, folder: Optional[Path] = None) -> Recipe:
    """The recipe called `name`, read and checked; a UsageError naming
    --recipe and the known recipes when there is none of that name."""
    folder = FOLDER if folder is None else folder
    known = names(folder)
    if name not in known:
        raise UsageError(f"argument --recipe: unknown recipe {name!r}{did_you_mean(name, known)} "
                         f"(known: {', '.join(known) or 'none'})")
    return load(folder / f"{name}{SUFFIX}")


def load(path: Path) -> Recipe:
    """A recipe file read and checked: every key of FILE_KEYS and
    PUBLISHED_KEYS present with a value of its type, no other, its name its
    file's, each flag a long spelling with a value TOML and a command line
    share (a bool, number, string, or a list of numbers or strings). A
    mistake is one line naming the file, and the key where there is one."""
    shown = Recipe(path.name[:-len(SUFFIX)], path, "", {}, "", {})
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"recipe file {shown.shown_path}: cannot read it ({error_summary(error)})") from None
    try:
        document = _toml_loads(text)
    except ValueError as error:  # tomllib.TOMLDecodeError is a ValueError
        raise UsageError(f"recipe file {shown.shown_path}: not valid TOML ({error_summary(error)})") from None
    for key in [*FILE_KEYS, *document]:
        if key not in FILE_KEYS or key not in document:
            raise shown.mistake(key, f"{'unknown key' if key not in FILE_KEYS else 'missing'} "
                                     f"(a recipe file holds {', '.join(FILE_KEYS)})")
    for key, kind in {"name": str, "source": str, "notes": str, "published": dict, "flags": dict}.items():
        if not isinstance(document[key], kind) or not document[key]:
            raise shown.mistake(key, f"expected a non-empty {'table' if kind is dict else 'string'}")
    if document["name"] != shown.name:
        raise shown.mistake("name", f"{document['name']!r} is not the file's name, {shown.name!r}")
    _check_published(shown, document["published"])
    for key, value in document["flags"].items():
        _check_flag(shown, key, value)
    return Recipe(document["name"], path, document["source"], document["published"], document["notes"],
                  document["flags"])


def _check_published(recipe: Recipe, published: dict) -> None:
    for key in [*PUBLISHED_KEYS, *published]:
        if key not in PUBLISHED_KEYS or key not in published:
            raise recipe.mistake(f"published.{key}", f"{'unknown key' if key not in PUBLISHED_KEYS else 'missing'} "
                                                    f"(published holds {', '.join(PUBLISHED_KEYS)})")
        value, expected = published[key], {"top1": "a percentage", "epochs": "a positive integer"}.get(key, "text")
        if not isinstance(value, PUBLISHED_KEYS[key]) or isinstance(value, bool) or not value or \
                (key == "top1" and not 0 < value <= 100) or (key == "epochs" and value < 0):
            raise recipe.mistake(f"published.{key}", f"expected {expected}, got {value!r}")


def _check_flag(recipe: Recipe, key: str, value) -> None:
    if not _FLAG_KEY.match(key):
        raise recipe.mistake(f"flags.{key}", "expected a flag's long spelling without its dashes (mixup-alpha)")
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(item, _SCALARS) for item in values) or \
            (isinstance(value, list) and any(isinstance(item, bool) for item in values)):
        raise recipe.mistake(key, f"{value!r}: expected true or false (a switch), a number, a string, or a list of "
                                  f"numbers or strings")


def flag_words(recipe: Recipe, key: str, switch: bool) -> List[str]:
    """The command-line words of one of the recipe's flags: `--key` alone
    for a switch set to true (none for false: switches are off unless
    given), `--key VALUE...` for a flag that takes values."""
    value = recipe.flags[key]
    if switch != isinstance(value, bool):
        raise recipe.mistake(key, f"--{key} is a switch: write true or false" if switch else
                             f"--{key} takes a value, not {str(value).lower()}")
    if switch:
        return [f"--{key}"] if value else []
    return [f"--{key}", *(str(item) for item in (value if isinstance(value, list) else [value]))]


def record(name: str, overridden: Sequence[str], folder: Optional[Path] = None) -> dict:
    """config.json's "recipe": its name, file and source, every flag it set
    (as the file has them) and which of those the command line overrode."""
    recipe = read(name, folder)
    return {"name": recipe.name, "file": recipe.shown_path, "source": recipe.source, "set": dict(recipe.flags),
            "overridden": list(overridden)}


def _toml_loads(text: str) -> dict:
    """TOML's parser: the standard library's tomllib from Python 3.11, tomli
    (the same parser, requirements.txt installs it there) on 3.9 and 3.10.
    Imported here, when a recipe is read, so that the command line without
    --recipe never needs it."""
    try:
        import tomllib
    except ModuleNotFoundError:
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise UsageError("argument --recipe: reading a recipe needs tomli on Python before 3.11: "
                             "pip install -r requirements.txt") from None
    return tomllib.loads(text)
