"""The shape of common/ (docs/architecture.md): every module imports alone,
the imports between modules form no circle, the bottom layer stays at the
bottom, launchers' environment variables are read in one place, and no class
grows past ~150 lines without saying why."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

from helpers import REPO

COMMON = REPO / "common"
MAX_CLASS_LINES = 150
# The bottom layer: what every module may import, and which imports no other module of common/ than these.
BOTTOM = {"common.errors", "common.config", "common.arguments", "common.hardware"}
# Only the entry scripts and the tools import the command line; and the Ray launchers' driver, which checks
# the training command with the script's own parser before Ray starts.
CLI_IMPORTERS = {"common.tools.bench", "common.ray_cluster"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(COMMON.rglob("*.py"))}
PACKAGES = {"common", "common.tools"}  # their __init__ imports nothing: importing from them is importing a module
# The old paths of the tools (common.bench, ...) are aliases that replace themselves by common.tools.*.
ALIASES = {name for name, path in MODULES.items() if "sys.modules[__name__] = _tool" in path.read_text()}


def imports_of(path: Path) -> set:
    """The modules of common/ that `path` imports, wherever in the file (a
    function-level import counts: one that dodges a circle is still one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from common import data` imports common.data; `from common.x import y` imports common.x.
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        found |= {name for name in names if name in MODULES and name not in PACKAGES}
    return found - {module_name(path)}


GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def test_the_graph_is_read_from_real_imports():
    assert {"common.errors", "common.config", "common.distributed"} <= GRAPH["common.launch"]
    assert "common.engine" in GRAPH["common.engine"] | {"common.engine"}
    assert GRAPH["common.errors"] == set()


def cycles(graph: dict) -> list:
    """Every import circle, each as a list of modules (depth-first search)."""
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for child in sorted(graph.get(node, ())):
            if state.get(child) == "open":
                found.append(stack[stack.index(child):] + [child])
            elif child not in state:
                visit(child, stack + [child])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_common():
    assert cycles(GRAPH) == []


# Imports each module with no module of common/ loaded before it (torch and the rest stay loaded: they
# are not what could hide a circle), in one fresh interpreter; prints the modules that fail.
_IMPORT_EACH_ALONE = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for loaded in [module for module in sys.modules if module == "common" or module.startswith("common.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc(limit=-3).replace(chr(10), " | "))
print(chr(10).join(failed))
"""


def test_each_module_imports_alone():
    names = sorted(set(MODULES) - PACKAGES) + ["common.no_such_module"]  # the last shows a failure is seen
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH_ALONE, *names], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    failed = [line.split(":")[0] for line in done.stdout.splitlines()]
    assert done.returncode == 0 and failed == ["common.no_such_module"], done.stdout[-3000:] + done.stderr[-2000:]


def test_bottom_layer_imports_only_the_bottom_layer():
    for name in BOTTOM:
        assert GRAPH[name] <= BOTTOM, (name, GRAPH[name] - BOTTOM)


def test_only_scripts_and_tools_import_the_command_line():
    importers = {name for name, imported in GRAPH.items() if "common.cli" in imported}
    assert importers <= CLI_IMPORTERS, importers - CLI_IMPORTERS


def test_tools_import_only_the_bottom_layer_and_each_other():
    tools = {name for name in MODULES if name.startswith("common.tools.")}
    # bench (and its data_scale section, and comm_bench, the processes of its comm and scaling sections) runs the
    # training stack it measures; filelist writes what the training scripts' scan finds
    for name in tools - {"common.tools.bench", "common.tools.data_scale", "common.tools.comm_bench",
                         "common.tools.filelist"}:
        assert GRAPH[name] <= BOTTOM | tools, (name, GRAPH[name] - BOTTOM - tools)
    for name in set(MODULES) - tools - ALIASES - {"common.tools"}:
        assert not GRAPH[name] & tools, (name, GRAPH[name] & tools)  # training never needs the tools


def test_old_tool_paths_are_the_new_modules():
    for alias in sorted(ALIASES):
        assert importlib.import_module(alias) is importlib.import_module(alias.replace("common.", "common.tools."))


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT", "SLURM_", "TORCHELASTIC_", "OMP_NUM_THREADS", "RAY_ADDRESS")


def test_launcher_environment_variables_are_read_only_in_launch():
    readers = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    any(node.value == variable or (variable.endswith("_") and node.value.startswith(variable))
                        for variable in LAUNCHER_VARIABLES):
                readers.setdefault(name, set()).add(node.value)
    # Set, not read: Validation B starts imagenet_ddp.py in two network namespaces with one thread each.
    setters = {"common.tools.link_validation": {"OMP_NUM_THREADS"}}
    for name, variables in setters.items():
        if readers.get(name, set()) <= variables:
            readers.pop(name, None)
    assert set(readers) == {"common.launch"}, readers


def long_classes() -> list:
    """(module, class, lines) of classes over MAX_CLASS_LINES whose docstring does not say why they are one piece."""
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                why = "one class" in (ast.get_docstring(node) or "").lower() or \
                      "one piece" in (ast.get_docstring(node) or "").lower()
                if lines > MAX_CLASS_LINES and not why:
                    found.append((name, node.name, lines))
    return found


def test_no_long_class_without_a_reason():
    assert long_classes() == []


def test_entry_scripts_stay_short_recipes():
    for script in ("imagenet_nd.py", "imagenet_dp.py", "imagenet_ddp.py", "imagenet_ddp_apex.py"):
        assert len((REPO / script).read_text().splitlines()) <= 60, script
