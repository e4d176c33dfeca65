"""README.md and docs/ stay true: every command they show names a script, module,
batch file or make target that exists, with flags its parser knows; the README
fits on a page. No subprocess: the parsers are built in this process, so the
whole file takes seconds.

What counts as a command: a line of a fenced code block (continuations joined,
`# comments` dropped) or an inline code span that starts with `python `,
`make `, `torchrun ` or `sbatch `, whose first word (after `VAR=value`
prefixes) is python, make, torchrun, srun, sbatch or bash. Placeholders
(DATA, /path/to/imagenet, NODE0, `...`, `<run>`) are positional arguments and
are not checked; `[--flag value]` optional brackets are checked as the flag.
"""
from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

from helpers import REPO

README_MAX_BYTES = 10 * 1024
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPTS = {"imagenet_nd.py": "nd", "imagenet_dp.py": "dp", "imagenet_ddp.py": "ddp", "imagenet_ddp_apex.py": "ddp_apex"}
# Shell files that pass the arguments after their name on to a training script ("$@"), and which
# script that is unless SCRIPT=... says otherwise.
PASSES_ARGUMENTS_TO = {".sbatch": "imagenet_ddp.py", "run_scripts/demo.sh": "imagenet_nd.py"}
LAUNCHERS = ("torchrun", "srun", "sbatch", "bash")
INLINE_STARTS = ("python ", "python3 ", "make ", "torchrun ", "sbatch ")
ENVIRONMENT_PREFIX = re.compile(r"([A-Z_][A-Z0-9_]*)=(\S*)")
FLAG = re.compile(r"--?[A-Za-z][\w-]*(=.*)?")


def is_python(word: str) -> bool:
    """python, python3, python3.11, .venv/bin/python: an interpreter."""
    return re.fullmatch(r"python(\d+(\.\d+)?)?", Path(word).name) is not None


def command_lines(text: str) -> list:
    """(line number, command) of the commands in fenced code blocks (continuations
    joined, comments dropped) and of inline code spans that start with a command."""
    found, fenced, pending, start = [], False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced, pending = not fenced, ""
            continue
        if fenced:
            code = "" if line.lstrip().startswith("#") else line.split(" #")[0].rstrip()
            if not pending:
                start = number
            pending += " " + code
            if code.endswith("\\"):
                pending = pending[:-1]
                continue
            if pending.strip():
                found.append((start, pending.strip()))
            pending = ""
        else:
            found += [(number, span) for span in re.findall(r"`([^`]+)`", line) if span.startswith(INLINE_STARTS)]
    return found


def split_command(command: str):
    """(environment prefixes, words) of a command we check; words is [] for
    anything else (prose in a code block, output, a file tree, an unbalanced quote)."""
    try:
        words = shlex.split(command)
    except ValueError:
        return {}, []
    environment = {}
    while words and ENVIRONMENT_PREFIX.fullmatch(words[0]):
        name, value = ENVIRONMENT_PREFIX.fullmatch(words[0]).groups()
        environment[name], words = value, words[1:]
    if words and (is_python(words[0]) or words[0] in ("make", *LAUNCHERS)):
        return environment, words
    return environment, []


def makefile_targets() -> set:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), flags=re.M))


def option_strings(parser) -> set:
    options = set()
    for action in parser._actions:
        options.update(action.option_strings)
        if isinstance(action.choices, dict):  # subcommands (demo_data digits ...)
            for subparser in action.choices.values():
                options |= option_strings(subparser)
    return options


def script_parser(path: str):
    """The argparse parser of a script the docs run with python, or None when it has none to check."""
    if path in SCRIPTS:
        from common import cli

        return cli.build_parser(SCRIPTS[path])
    if path in ("run_scripts/launch_nodes.py", "tests/slurm_cluster.py", "run_scripts/ray_train.py",
                "run_scripts/ray_tune.py"):
        spec = importlib.util.spec_from_file_location(Path(path).stem, REPO / path)
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
        spec.loader.exec_module(module)  # defines functions only: its main() runs under __main__
        return module.build_parser()
    return None


def is_placeholder(word: str) -> bool:
    """`python -m common.tools.<name>`, `python imagenet_*.py`: a pattern in prose, not a command."""
    return any(mark in word for mark in ("<", "*", "..."))


def flags_of(words: list) -> list:
    """The flag names given: `--x=1` -> `--x`, `[--smooth` -> `--smooth`; negative
    numbers and placeholders are not flags."""
    words = [word.strip("[]") for word in words]
    return [word.split("=")[0] for word in words if FLAG.fullmatch(word)]


def unknown_flags(parser, arguments: list, name: str) -> list:
    known = option_strings(parser)
    # `-j1`: argparse's attached value of a short option.
    return [f"{flag} is not a flag of {name}" for flag in flags_of(arguments)
            if flag not in known and not (flag[1] != "-" and flag[:2] in known)]


def problems_of(command: str) -> list:
    """What is wrong with one command line; [] when it checks out or is not ours to check."""
    environment, words = split_command(command)
    if not words:
        return []
    if words[0] == "make":
        return [f"no make target {target!r}" for target in words[1:]
                if "=" not in target and not target.startswith("-") and target not in makefile_targets()]
    if words[0] in LAUNCHERS:
        return launched_problems(environment, words)
    rest = words[1:]  # python ...
    if not rest or any(is_placeholder(word) for word in rest[:2]):
        return []
    if rest[:2] in (["-m", "torch.distributed.launch"], ["-m", "torch.distributed.run"]):
        # The launcher's own flags come first and are not ours; the script and its flags follow.
        scripts = [index for index, word in enumerate(rest) if word.endswith(".py")]
        return problems_of("python " + shlex.join(rest[scripts[0]:])) if scripts else ["no script after the launcher"]
    if rest[0] == "-m":
        module = rest[1] if len(rest) > 1 else ""
        if not module.startswith("common"):
            return []  # pytest, pip, ...: not this project's
        if importlib.util.find_spec(module) is None:
            return [f"no module {module}"]
        tool = importlib.import_module(module)
        if hasattr(tool, "__path__"):  # a package: `python -m` runs its __main__
            if importlib.util.find_spec(f"{module}.__main__") is None:
                return [f"package {module} has no __main__ to run"]
            tool = importlib.import_module(f"{module}.__main__")
        if not hasattr(tool, "build_parser"):
            return [f"{module} has no build_parser() to check its flags against"]
        return unknown_flags(tool.build_parser(), rest[2:], module)
    if not rest[0].endswith(".py"):
        return []
    if not (REPO / rest[0]).is_file():
        return [f"no script {rest[0]}"]
    parser, arguments, nested = script_parser(rest[0]), rest[1:], []
    if parser is None:
        return []
    if "--" in arguments:  # launch_nodes.py HOSTS -- SCRIPT FLAGS: the rest is a command of its own
        arguments, after = arguments[:arguments.index("--")], arguments[arguments.index("--") + 1:]
        nested = problems_of("python " + shlex.join(after)) if after else []
    return unknown_flags(parser, arguments, rest[0]) + nested


def launched_problems(environment: dict, words: list) -> list:
    """torchrun/srun ... [python] SCRIPT FLAGS, sbatch FILE FLAGS, bash FILE FLAGS:
    the launcher's own flags are not checked; the file must exist, and what it
    runs is checked as a command of its own."""
    after = words[1:]
    if words[0] == "srun":
        starts = [index for index, word in enumerate(after) if is_python(word) or word.endswith(".py")]
        if not starts:
            return []
        program = after[starts[0]:]
        return problems_of(shlex.join(program if is_python(program[0]) else ["python", *program]))
    if words[0] == "torchrun":
        scripts = [index for index, word in enumerate(after) if word.endswith(".py")]
        return problems_of("python " + shlex.join(after[scripts[0]:])) if scripts else ["no script after torchrun"]
    files = [index for index, word in enumerate(after) if word.endswith((".sbatch", ".sh"))]
    if not files:
        return []
    path, arguments = after[files[0]], after[files[0] + 1:]
    if is_placeholder(path):
        return []
    if not (REPO / path).is_file():
        return [f"no file {path}"]
    default = next((script for suffix, script in PASSES_ARGUMENTS_TO.items() if path.endswith(suffix)), None)
    if default is None or not arguments:
        return []
    return problems_of("python " + shlex.join([environment.get("SCRIPT", default), *arguments]))


def test_the_checker_sees_wrong_commands():
    """Each kind of mistake is reported, so the test below cannot pass by checking nothing."""
    assert problems_of("python imagenet_nd.py --no-such-flag DATA") == ["--no-such-flag is not a flag of imagenet_nd.py"]
    assert problems_of("python imagenet_nope.py DATA") == ["no script imagenet_nope.py"]
    assert problems_of("python -m common.tools.nope x") == ["no module common.tools.nope"]
    assert problems_of("make no-such-target") == ["no make target 'no-such-target'"]
    assert problems_of("DATA=x sbatch run_scripts/nope.sbatch -a resnet50") == ["no file run_scripts/nope.sbatch"]
    assert problems_of("torchrun --nproc-per-node 4 imagenet_ddp.py --bogus DATA") == \
        ["--bogus is not a flag of imagenet_ddp.py"]
    assert problems_of("srun --nodes 2 --ntasks-per-node 4 python imagenet_ddp.py --bogus=1 DATA") == \
        ["--bogus is not a flag of imagenet_ddp.py"]
    assert problems_of("CUDA_VISIBLE_DEVICES=0 python imagenet_dp.py --nproc-per-node 2 DATA") == \
        ["--nproc-per-node is not a flag of imagenet_dp.py"]  # a DDP flag that DataParallel lacks
    assert problems_of("python -m common.tools.plots RUNS... --out figures/ [--smoothing 0.6]") == \
        ["--smoothing is not a flag of common.tools.plots"]
    assert problems_of("DATA=x SCRIPT=imagenet_nd.py sbatch run_scripts/slurm_torchrun.sbatch --opt-level O2") == \
        ["--opt-level is not a flag of imagenet_nd.py"]
    assert problems_of("python run_scripts/launch_nodes.py --hosts a,b -- imagenet_ddp.py --bogus DATA") == \
        ["--bogus is not a flag of imagenet_ddp.py"]
    assert command_lines("```\npython imagenet_nd.py \\\n  --bogus DATA   # why\n```\n") == \
        [(2, "python imagenet_nd.py    --bogus DATA")]
    assert command_lines("Run `python imagenet_nd.py --bogus` or `tensorboard --logdir runs`.") == \
        [(1, "python imagenet_nd.py --bogus")]


def test_the_checker_accepts_right_commands():
    assert problems_of("python -m torch.distributed.launch --nproc_per_node=4 imagenet_ddp_apex.py -a resnet50 "
                       "--b 208 --workers 20 --opt-level O9 DATA") == []  # values are not checked, only flags
    assert problems_of("python -m common.tools.demo_data fake-imagenet data/fake --classes 10") == []
    assert problems_of("python -m common.tools.plots RUN_OR_LOG_DIRS... --out figures/ [--smooth 0.6]") == []
    assert problems_of("python imagenet_nd.py -j1 --epochs=2 --lr 0.1 -e /path/to/imagenet") == []
    assert problems_of("make figures RUNS=runs") == []
    assert problems_of("python -m pytest tests -q") == []  # not this project's module: not checked


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_every_command_in_the_docs_exists(page):
    checked, problems = 0, []
    for number, command in command_lines(page.read_text()):
        if split_command(command)[1]:
            checked += 1
        problems += [f"{page.relative_to(REPO)}:{number}: {problem}: {command}" for problem in problems_of(command)]
    assert not problems, "\n" + "\n".join(problems)
    assert checked > 0 or page.name not in ("README.md", "launching.md", "speed.md", "outputs.md")


def anchors(page: Path) -> set:
    """The #anchors GitHub gives a page's headings: lower case, punctuation
    dropped (not - and _), spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_readme_fits_on_a_page_and_links_every_doc():
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= README_MAX_BYTES, f"README.md is {len(readme.encode())} bytes"
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"


def test_every_link_between_the_pages_leads_somewhere():
    broken = []
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path = page.parent / target if target else page
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)}: no file {target}")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.relative_to(REPO)}: no heading #{anchor} in {path.relative_to(REPO)}")
    assert not broken, "\n" + "\n".join(broken)


def requirement_names(path: Path) -> set:
    """The package names a requirements file asks for (comments and version ranges left out)."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower())
    return names


def test_training_needs_no_test_tools_and_make_test_installs_them(tmp_path):
    """Issue 21: a cluster installing requirements.txt gets what training needs, not pytest."""
    import subprocess

    test_tools = {"pytest", "hypothesis"}
    assert requirement_names(REPO / "requirements.txt") & test_tools == set()
    assert test_tools <= requirement_names(REPO / "requirements-test.txt")
    # What `make test` and `make demo` would run in a fresh checkout (-n: print, do not run).
    def planned(target):
        return subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout

    assert "-r requirements.txt" in planned("test") and "-r requirements-test.txt" in planned("test")
    assert "-r requirements.txt" in planned("demo") and "requirements-test.txt" not in planned("demo")
