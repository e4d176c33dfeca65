"""Modules loaded when first used: the entry scripts name torch and the
modules of common/ that import it (about 3 to 5 s and 800 MiB together)
at their top, as a recipe does, yet read their flags first, so that
`--help` and a mistake in a flag answer in well under a second.

importlib.util.LazyLoader is the standard library's own way to do this:
the module object exists at once and runs its code at the first attribute
read. A module already imported (by a test, a launcher) is returned as it is.
"""
import importlib.util
import sys
from types import ModuleType
from typing import Tuple


def modules(*names: str) -> Tuple[ModuleType, ...]:
    """The modules `names` (dotted), each loaded at its first use."""
    return tuple(_lazy(name) for name in names)


def _lazy(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    if parent:  # `common.data` is also the attribute `data` of common, as after an import
        setattr(sys.modules[parent], child, module)
    return module
