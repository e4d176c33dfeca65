"""The shape of common/ (docs/architecture.md): every module imports alone,
the imports between modules form no circle, each module imports only the
ones listed before it in the architecture's module table (file mechanics,
common/files.py, at the bottom), the command line stays free of torch,
launchers' environment variables are read in one place, and no class grows
past ~150 lines, no module past ~600 and no function past ~60 without
saying why."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from helpers import REPO, run_with_cached_architectures

COMMON = REPO / "common"
MAX_CLASS_LINES = 150
# The bottom layer, the table's first rows: what every module may import, and which imports no other module of
# common/ than these.
BOTTOM = {"common.errors", "common.files", "common.ports", "common.config", "common.arguments", "common.hardware",
          "common.provenance", "common.recipes"}
ARCHITECTURE = REPO / "docs" / "architecture.md"
# A row of its module table: `common/name.py`, or a folder, `common/tools/`, that stands for all its modules.
TABLE_ROW = re.compile(r"^\| `common/([\w/]+?)(\.py|/)` \|", re.MULTILINE)
# Only the entry scripts and the tools import the command line; and the Ray launchers' driver, which checks
# the training command with the script's own parser before Ray starts.
CLI_IMPORTERS = {"common.tools.bench.measurements", "common.ray_cluster"}
# The command line and what it imports: no torch (seconds and hundreds of MiB), so that --help and a mistake's
# one line come at once. They import only each other at module level (a function may import more, when it runs).
TORCH_FREE = {"common.errors", "common.files", "common.config", "common.arguments", "common.ports",
              "common.architectures", "common.launcher", "common.process_signals", "common.flags", "common.cli",
              "common.provenance", "common.recipes"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(COMMON.rglob("*.py"))}
# Their __init__ imports nothing: importing from them is importing a module.
PACKAGES = {"common", "common.tools", "common.tools.bench"}


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


def floors(table: str) -> dict:
    """Each module of common/ -> the row of docs/architecture.md's module
    table it is listed in, counted from 0, the bottom floor. A folder's row
    holds every module under it, and a folder inside it (common/tools/bench/)
    shares its row's floor."""
    floor = {}
    for row, (name, kind) in enumerate(TABLE_ROW.findall(table)):
        module = "common." + name.strip("/").replace("/", ".")
        row = floor.get(module, row)  # a folder inside a folder of the table (tools/bench/) shares its floor
        floor[module] = row
        if kind == "/":
            floor.update({inside: row for inside in MODULES if inside.startswith(module + ".")})
    return floor


FLOOR = floors(ARCHITECTURE.read_text())


def upward_imports(graph: dict, floor: dict) -> list:
    """(module, imported) for each import of a module listed after the importer
    (modules of one folder's row may import each other)."""
    return sorted((name, imported) for name, modules in graph.items() for imported in modules
                  if floor[imported] > floor[name])


def test_the_graph_is_read_from_real_imports():
    assert {"common.errors", "common.config", "common.distributed"} <= GRAPH["common.spawn"]
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
    assert GRAPH["common.files"] <= {"common.errors"}  # file mechanics: nothing of runs, datasets or processes


def test_the_module_table_is_read_from_the_architecture_page():
    assert {name for name, floor in FLOOR.items() if floor < len(BOTTOM)} == BOTTOM  # the bottom floor comes first
    assert FLOOR["common.files"] < FLOOR["common.dataset_lists"] < FLOOR["common.data"] < FLOOR["common.rundir"]
    assert FLOOR["common.tools.bench.command_line"] == FLOOR["common.tools.scaling"] == max(FLOOR.values())
    assert set(MODULES) - PACKAGES <= set(FLOOR), sorted(set(MODULES) - PACKAGES - set(FLOOR))  # each has its row


def test_upward_import_finder_finds_one():
    floor = {"a": 0, "b": 1, "t.x": 2, "t.y": 2}
    assert upward_imports({"a": {"b"}, "b": set(), "t.x": {"t.y", "a"}, "t.y": {"t.x"}}, floor) == [("a", "b")]


def test_each_module_imports_only_the_ones_listed_before_it():
    assert upward_imports({name: GRAPH[name] for name in set(MODULES) - PACKAGES}, FLOOR) == []


def module_level_imports(path: Path) -> set:
    """Every module that the statements at the top of `path` import (not those inside functions)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_the_command_line_imports_no_torch_at_module_level():
    for name in TORCH_FREE:
        imported = module_level_imports(MODULES[name])
        assert not {module for module in imported if module.split(".")[0] in ("torch", "torchvision", "numpy")}, name
        assert {module for module in imported if module in MODULES} - PACKAGES <= TORCH_FREE, name


# In a fresh interpreter: import the command line, show --help, make mistakes, and list the torch modules loaded.
_PARSE_WITHOUT_TORCH = """
import contextlib, io, sys
from common import cli
from common.errors import UsageError

def torch_modules():
    return sorted(name for name in sys.modules if name.startswith(("torch", "torchvision")))

after_import = torch_modules()
help_text = io.StringIO()
with contextlib.redirect_stdout(help_text):
    try:
        cli.parse("ddp_apex", ["--help"])
    except SystemExit:
        pass
assert "resnet50" in help_text.getvalue() and "--ddp-comm-hook" in help_text.getvalue(), help_text.getvalue()
mistakes = (["--epochs", "0"], ["-a", "resnet5", "--synthetic"], ["--synthetic", "--start-epoch", "3", "--epochs", "2"],
            ["--synthetic", "--data-backend", "nvjpeg"], ["--synthetic", "--ddp-comm-hook", "int8"], ["/no/such/data"])
for argv in mistakes:
    try:
        cli.parse("ddp_apex", argv)
    except UsageError:
        continue
    raise AssertionError(f"no UsageError for {argv}")
try:
    cli.run(lambda: cli.parse("nd", ["--synthetic", "--lr", "-1"]))
except SystemExit as stopped:
    assert stopped.code == 2, stopped.code
print(after_import, torch_modules())
"""


def test_help_and_mistakes_import_no_torch(tmp_path):
    # The architectures' names are cached per torchvision version: the first start of a version lists them
    # (importing torchvision), as the helper does here; every later start reads the cache.
    done = run_with_cached_architectures(_PARSE_WITHOUT_TORCH, tmp_path / "cache")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.strip() == "[] []", done.stdout
    assert "error: argument --lr" in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr


def test_only_scripts_and_tools_import_the_command_line():
    importers = {name for name, imported in GRAPH.items() if "common.cli" in imported}
    assert importers <= CLI_IMPORTERS, importers - CLI_IMPORTERS


def test_tools_import_only_the_bottom_layer_and_each_other():
    tools = {name for name in MODULES if name.startswith("common.tools.")}
    # bench's sections, the processes it measures in (measurements; comm_bench, those of its comm and scaling
    # sections) and its data_scale section run the training stack it measures; filelist writes what the training
    # scripts' scan finds; export builds a run's model from its checkpoint. The rest of bench (its command, report,
    # FLOPs, GPU monitor, ...) is held to the rule.
    for name in tools - {"common.tools.bench.sections", "common.tools.bench.measurements",
                         "common.tools.bench.data_scale", "common.tools.bench.comm_bench", "common.tools.filelist",
                         "common.tools.pack_shards", "common.tools.export"}:
        assert GRAPH[name] <= BOTTOM | tools, (name, GRAPH[name] - BOTTOM - tools)
    for name in set(MODULES) - tools - {"common.tools"}:
        assert not GRAPH[name] & tools, (name, GRAPH[name] & tools)  # training never needs the tools


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT", "SLURM_", "TORCHELASTIC_", "OMP_NUM_THREADS", "RAY_ADDRESS")


def test_launcher_environment_variables_are_read_only_in_launcher():
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
    assert set(readers) == {"common.launcher"}, readers


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
# What a docstring says when a long piece is long on purpose ("one piece: ..."), and why.
REASONS = ("one piece", "one class", "one module", "one function")


def _gives_a_reason(node) -> bool:
    return any(words in (ast.get_docstring(node) or "").lower() for words in REASONS)


def oversized() -> list:
    """(module, kind, name, lines) of the modules over MAX_MODULE_LINES, the
    classes over MAX_CLASS_LINES and the functions over MAX_FUNCTION_LINES of
    common/, the entry scripts and run_scripts/ whose docstring does not say
    why they are one piece."""
    limits = {ast.ClassDef: ("class", MAX_CLASS_LINES), ast.FunctionDef: ("function", MAX_FUNCTION_LINES),
              ast.AsyncFunctionDef: ("function", MAX_FUNCTION_LINES)}
    paths = [*MODULES.values(), *REPO.glob("imagenet_*.py"), *(REPO / "run_scripts").glob("*.py")]
    found = []
    for path in paths:
        tree = ast.parse(path.read_text())
        where = str(path.relative_to(REPO))
        module_lines = len(path.read_text().splitlines())
        if module_lines > MAX_MODULE_LINES and not _gives_a_reason(tree):
            found.append((where, "module", path.stem, module_lines))
        for node in ast.walk(tree):
            kind, limit = limits.get(type(node), (None, None))
            if kind is not None and node.end_lineno - node.lineno + 1 > limit and not _gives_a_reason(node):
                found.append((where, kind, node.name, node.end_lineno - node.lineno + 1))
    return found


def test_no_long_module_class_or_function_without_a_reason():
    assert oversized() == []


def test_the_size_check_finds_a_long_function_and_accepts_its_reason(tmp_path):
    body = "\n".join(f"    x{index} = {index}" for index in range(MAX_FUNCTION_LINES))
    long_function = ast.parse(f"def f():\n{body}\n").body[0]
    explained = ast.parse(f'def f():\n    """Long, but one piece: the steps share every local."""\n{body}\n').body[0]
    assert long_function.end_lineno - long_function.lineno + 1 > MAX_FUNCTION_LINES
    assert not _gives_a_reason(long_function) and _gives_a_reason(explained)


def test_entry_scripts_stay_short_recipes():
    for script in ("imagenet_nd.py", "imagenet_dp.py", "imagenet_ddp.py", "imagenet_ddp_apex.py"):
        assert len((REPO / script).read_text().splitlines()) <= 60, script
