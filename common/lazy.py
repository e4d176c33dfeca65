"""Modules imported at their first use: the entry scripts name torch and the
modules of common/ that import it (about 3 to 5 s and 800 MiB together) at
their top, as a recipe does, yet read their flags first, so that `--help`
and a mistake in a flag answer in well under a second.

Each name stands for its module until an attribute is read from it, which
imports the module (once; importlib keeps it in sys.modules) and reads the
attribute there. Unlike importlib.util.LazyLoader, nothing half-made enters
sys.modules: code that walks sys.modules (inspect, pickle, warnings) would
load such a module in the middle of another's import.

Once the flags are read, import_now() imports them all, before any process
group starts its threads: imported later, inside training, they ended about
1 in 7 two-process CPU runs with SIGABRT at exit ("terminate called without
an active exception"; torch 2.14, TorchCodec 0.17, 2026-11-27), which
importing them first never did in 30 runs.
"""
import importlib
from types import ModuleType
from typing import Any, List, Tuple

_STOOD_IN: List[str] = []  # the modules stood in for in this process, for import_now


class _ImportedWhenUsed:
    """Stands for module `name`; every attribute read is the module's own."""

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(importlib.import_module(self._name), attribute)

    def __setattr__(self, attribute: str, value: Any) -> None:  # a test's monkeypatch lands on the module itself
        setattr(importlib.import_module(self._name), attribute, value)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported at its first use>"


def modules(*names: str) -> Tuple[ModuleType, ...]:
    """Stand-ins for the modules `names` (dotted), each imported at its first use."""
    _STOOD_IN.extend(name for name in names if name not in _STOOD_IN)
    return tuple(_ImportedWhenUsed(name) for name in names)


def import_now() -> None:
    """Import every module stood in for so far in this process (the entry
    scripts call it once their flags are read; a spawned worker, before it
    joins the process group)."""
    for name in _STOOD_IN:
        importlib.import_module(name)
