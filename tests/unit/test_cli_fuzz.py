"""Argument fuzzing of every entry script's command line (common.cli): random
combinations of flags, each with a plausible or a hostile value, in both the
`--flag value` and `--flag=value` spellings, with a dataset folder that exists,
is missing or is absent. Whatever the combination, parsing either returns a
Config that keeps its invariants (the run would start) or raises a one-line
UsageError naming a flag of the command line (the script prints it and exits
2): never a traceback. The flags come from the parsers themselves, so flags
added later are fuzzed too. Fixed cases pin the hostile values the fuzzer may
not draw every time (names too long for the file system, newlines, folders
that cannot be entered), and a few subprocess runs check the exit status and
the stderr line the scripts make of a UsageError."""
import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, seed, settings, strategies as st

from common.cli import build_parser, parse
from common.config import MODES, PREEMPT_SIGNALS
from common.errors import UsageError, one_line
from helpers import make_image_folder, run_script

# Values some flag may take: each flag's plausible values are those of this pool its type accepts.
PLAUSIBLE_POOL = (
    "0", "1", "2", "3", "5", "10", "15", "30", "60", "90", "128", "224", "256",
    "0.0", "0.1", "0.5", "0.9", "0.99", "1.0", "1e-4", "0.75", "75", "100",
    "10min", "0.5min", "500steps", "USR1", "SIGUSR2", "TERM", "True", "False", "dynamic",
    "resnet18", "auto", "my_run", "tcp://127.0.0.1:23456",
)

# Text a user (or a script gone wrong) may put where a value belongs.
HOSTILE_VALUES = (
    "", " ", "\t", "-", "--", "---", "=", "==", "-x", "--x", "--lr", "-b", "a b", " 5 ", "-1 2",
    "0", "-0", "-1", "-3", "+7", "1.5", "-0.0", "0x10", "1_000", "1e3", "−1",  # U+2212 minus
    "nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e309", "-1e309", "1e-400", "5e-324",
    "9" * 30, "-" + "9" * 30, "9" * 5000,  # past int()'s 4300-digit limit
    "١٠", "²", "ü", "日本語", "🙂", "\u2028", "\x7f", "x" * 300,  # x*300: longer than a file name may be
    "/", ".", "..", "../..", "~", "$HOME", "None", "true", "O4", "tcp://", "0min", "-5steps", "nanmin",
    "two\nlines", "5\n", "\r",
)

# Characters a command line can carry: anything but NUL, and no lone surrogates (argv decodes
# undecodable bytes to \udc80-\udcff surrogates, which the file system encodes back).
ARGV_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)

# Allowed error messages that name no flag.
FLAGLESS_MESSAGES = ("DATA", "unrecognized arguments: ", "the following arguments are required")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """DATA candidates, made once: a tree parse accepts, and paths it must reject."""
    root = tmp_path_factory.mktemp("cli-fuzz")
    good = make_image_folder(root / "data", classes=2, train_per_class=1, val_per_class=1, size=8)
    no_val = root / "no_val"
    (no_val / "train" / "class_0").mkdir(parents=True)
    a_file = root / "a_file"
    a_file.write_text("not a folder")
    return {"good": str(good), "no_val": str(no_val), "file": str(a_file), "missing": str(root / "missing")}


# --- the strategy, from the parser's own actions ---

def _accepts(action: argparse.Action, text: str) -> bool:
    if action.type is None:
        return True
    try:
        action.type(text)
        return True
    except (argparse.ArgumentTypeError, TypeError, ValueError):
        return False


def _plausible_values(action: argparse.Action):
    """A strategy for one plausible value of `action` (None when it has none): its choices, its
    default, the pool's values its type accepts, and numbers its type accepts."""
    if action.choices is not None:
        return st.sampled_from([str(choice) for choice in action.choices])
    defaults = action.default if isinstance(action.default, (list, tuple)) else [action.default]
    default = [str(value) for value in defaults if value not in (None, False)][:1]
    if action.type is None:  # a free string (path, name, URL): mostly its default, else a few pool values
        known = default * 3 + ["auto", "my_run", "tcp://127.0.0.1:23456", "resnet18"]
    else:
        known = default + [text for text in PLAUSIBLE_POOL if text not in default and _accepts(action, text)]
    options = [st.sampled_from(known)] * 2 if known else []
    if _accepts(action, "0.5"):
        high = 120.0 if _accepts(action, "2.5") else 1.0
        options.append(st.floats(0.0, high).map(repr).filter(lambda text: _accepts(action, text)))
    elif _accepts(action, "3"):
        # Small values mostly; now and then any size, up to 2**64, where a range check must say no.
        options.append(st.one_of(st.integers(0, 120), st.integers(0, 120), st.integers(0, 2**64))
                       .map(str).filter(lambda text: _accepts(action, text)))
    return st.one_of(options) if options else None


def _often(strategy, rarely, one_in: int):
    """`strategy`, except one time in `one_in` (on average) `rarely`."""
    return st.sampled_from([False] * (one_in - 1) + [True]).flatmap(lambda rare: rarely if rare else strategy)


def _value(action: argparse.Action):
    hostile = st.one_of(st.sampled_from(HOSTILE_VALUES), ARGV_TEXT)
    plausible = _plausible_values(action)
    return hostile if plausible is None else _often(plausible, hostile, 5)


def _value_count(action: argparse.Action):
    """How many values follow the flag: mostly what nargs wants, sometimes not."""
    if action.nargs is None:
        wanted = st.just(1)
    elif action.nargs == "+":
        wanted = st.integers(1, 4)
    elif action.nargs == "?":
        wanted = st.integers(0, 1)
    elif action.nargs == "*":
        wanted = st.integers(0, 3)
    else:
        wanted = st.just(int(action.nargs))
    return _often(wanted, st.integers(0, 3), 12)


@st.composite
def _flag(draw, action: argparse.Action):
    """One flag with its values, as argv tokens: `--flag v`, `--flag=v`, or `-fv` for short flags."""
    option = draw(st.sampled_from(action.option_strings))
    if action.nargs == 0:  # store_true: alone, or with a value it must refuse
        return draw(_often(st.just([option]), _value(action).map(lambda value: [f"{option}={value}"]), 10))
    values = [draw(_value(action)) for _ in range(draw(_value_count(action)))]
    spelling = draw(st.sampled_from(("space", "equals", "attached")))
    if values and spelling == "equals":
        return [f"{option}={values[0]}", *values[1:]]
    if values and spelling == "attached" and len(option) == 2:
        return [option + values[0], *values[1:]]
    return [option, *values]


def _data_token(datasets):
    chosen = _often(st.just("good"), st.sampled_from(["no_val", "file", "missing"]), 5).map(datasets.get)
    return _often(chosen, st.one_of(st.sampled_from(HOSTILE_VALUES), ARGV_TEXT), 6)


@st.composite
def command_lines(draw, mode: str, datasets):
    """argv for `mode`'s parser: random flags, DATA (or none, or --synthetic), now and then an
    unknown flag, a stray word or a `--`."""
    actions = [action for action in build_parser(mode)._actions
               if action.option_strings and not isinstance(action, argparse._HelpAction)]
    synthetic = next(action for action in actions if "--synthetic" in action.option_strings)
    groups = [draw(_flag(action)) for action in draw(st.lists(st.sampled_from(actions), max_size=6))]
    if draw(st.booleans()):
        groups.append(draw(_flag(synthetic)))
    data = draw(_often(_data_token(datasets), st.none(), 6))
    if data is not None:
        groups.insert(draw(st.integers(0, len(groups))), [data])
    extra = draw(_often(st.none(), st.sampled_from([["--bogus-flag"], ["--bogus=1"], ["stray"], ["--"], ["-Z"]]), 10))
    if extra is not None:
        groups.insert(draw(st.integers(0, len(groups))), extra)
    return [token for group in groups for token in group]


# --- what every outcome must look like ---

def _flags_given(argv, parser: argparse.ArgumentParser) -> set:
    """Option strings of the flags argv spells (any spelling; clusters such as -eb5 count each letter)."""
    options = set(parser._option_string_actions)
    given = set()
    for token in argv:
        if token == "--":
            break
        for option in options:
            if token == option or token.startswith(option + "="):
                given.add(option)
        if token.startswith("-") and not token.startswith("--"):
            given.update(f"-{letter}" for letter in token[1:] if f"-{letter}" in options)
    # A flag given by one spelling is named by any other (-b, --batch-size, --b).
    return {option for flag in given for option in parser._option_string_actions[flag].option_strings}


def _mentions(message: str, option: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", message) is not None


def check_usage_error(message: str, argv, parser: argparse.ArgumentParser) -> None:
    assert message.strip(), f"empty message for {argv!r}"
    assert len(message.splitlines()) == 1, f"message of {argv!r} is not one line: {message!r}"
    if message.startswith("argument "):
        named = message[len("argument "):].split(":", 1)[0].split("/")
        assert set(named) <= set(parser._option_string_actions), f"{message!r} names an unknown flag ({argv!r})"
        given = _flags_given(argv, parser)
        assert any(_mentions(message, option) for option in given), \
            f"{message!r} names no flag of the command line {argv!r}"
    elif message.startswith("unrecognized arguments: "):
        words = message[len("unrecognized arguments: "):].removesuffix(" (see --help)").split()
        spelled = " ".join(argv)  # as given, as cli.one_line escapes it, or as repr() or unicode_escape write it
        spellings = (spelled, one_line(spelled), repr(argv), spelled.encode("unicode_escape").decode("ascii"))
        assert all(any(word in text for text in spellings) for word in words), f"{message!r}: not from {argv!r}"
    else:
        assert message.startswith(FLAGLESS_MESSAGES), f"{message!r} names no flag ({argv!r})"


def check_config(cfg, mode: str) -> None:
    """The invariants the training code relies on, whatever the flags."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0
    hash(cfg)  # frozen all the way down: tuples, not lists
    json.dumps(cfg.to_dict())  # config.json
    assert cfg.mode == mode
    assert cfg.batch_size >= 1 and cfg.epochs >= 1 and 0 <= cfg.start_epoch < cfg.epochs
    assert cfg.print_freq >= 1 and cfg.workers >= 0 and cfg.keep_checkpoints >= 1 and cfg.seed >= 0
    assert 0 < cfg.lr < math.inf
    assert 0 <= cfg.momentum < 1 and 0 <= cfg.label_smoothing < 1 and 0 <= cfg.hflip <= 1
    assert 0 <= cfg.weight_decay < math.inf and 0 <= cfg.io_interval < math.inf
    assert 0 <= cfg.warmup_epochs <= cfg.epochs
    assert cfg.image_size >= 1 and 1 <= cfg.crop_sizes.val <= cfg.val_resize  # the val crop fits the resized image
    assert cfg.progressive_resizing is None or (1 <= cfg.progressive_resizing[0] <= cfg.progressive_resizing[1] and
                                                cfg.progressive_resizing[2] <= cfg.progressive_resizing[3])
    assert isinstance(cfg.crop_scale, tuple) and 0 < cfg.crop_scale[0] <= cfg.crop_scale[1] <= 1
    assert isinstance(cfg.lr_steps, tuple) and list(cfg.lr_steps) == sorted(set(cfg.lr_steps)) and min(cfg.lr_steps) >= 1
    assert cfg.desired_acc is None or 0 < cfg.desired_acc <= 100
    assert cfg.dropout is None or 0 <= cfg.dropout < 1
    assert cfg.checkpoint_every_steps >= 0 and cfg.checkpoint_every_minutes >= 0  # >= 0 also refuses NaN
    assert cfg.preempt_signal in PREEMPT_SIGNALS
    assert cfg.run_name is None or (cfg.run_name not in ("", ".", "..") and os.sep not in cfg.run_name)
    assert cfg.report_dir is None or cfg.evaluate
    assert cfg.resume in (None, "auto") or Path(cfg.resume).is_file()
    assert cfg.synthetic or all((Path(cfg.data) / split).is_dir() for split in ("train", "val"))
    if mode in ("ddp", "ddp_apex"):
        assert cfg.rank is None or 0 <= cfg.rank < (cfg.world_size or 1)
        assert cfg.dist_url is None or cfg.dist_url.startswith("tcp://")
        assert 0 < cfg.dist_timeout < math.inf
    else:  # the distributed flags do not exist there: their defaults
        assert (cfg.dist_url, cfg.world_size, cfg.rank, cfg.nproc_per_node, cfg.local_rank) == (None,) * 5
    assert 0 <= cfg.seed < 2**32  # NumPy's seed range: a larger one would end in a traceback at start
    if mode == "ddp_apex":
        assert cfg.loss_scale in (None, "dynamic") or 0 < cfg.loss_scale < math.inf
    else:
        assert cfg.opt_level == "O0"


def parse_outcome(mode: str, argv) -> str:
    """Parse argv and check the outcome: 'config', 'usage error' or 'help'; fails on anything else."""
    parser = build_parser(mode)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            cfg = parse(mode, list(argv))
    except UsageError as error:
        check_usage_error(str(error), argv, parser)
        return "usage error"
    except SystemExit as stop:  # only --help (-h, or -h in a cluster such as -eh) may exit
        assert stop.code == 0 and printed.getvalue().startswith("usage:"), f"SystemExit({stop.code}) for {argv!r}"
        return "help"
    except Exception as error:
        pytest.fail(f"{type(error).__name__} for {argv!r}: {error}")
    check_config(cfg, mode)
    return "config"


# --- the tests ---

@pytest.mark.parametrize("mode", MODES)
def test_random_command_lines_start_or_name_a_flag(mode, datasets):
    outcomes = []

    # Repeatable (derandomize; a seed of its own per mode, as nd's and dp's parsers are alike) for a
    # given source tree: Hypothesis also draws literals found in the project's modules, so editing
    # common/ may change which command lines are drawn.
    @settings(max_examples=250, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @seed(MODES.index(mode))
    @given(argv=command_lines(mode, datasets))
    def fuzz(argv):
        outcomes.append(parse_outcome(mode, argv))

    fuzz()
    # The fuzzing reaches both sides: runs that would start, and refused command lines.
    assert outcomes.count("config") >= 10, outcomes
    assert outcomes.count("usage error") >= 10, outcomes


@pytest.mark.parametrize("mode", MODES)
def test_every_flag_with_a_plausible_value_alone_starts(mode, datasets):
    """Each flag on its own, with its default spelled out, parses: the fuzzer's 'valid' side is valid."""
    parser = build_parser(mode)
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        defaults = action.default if isinstance(action.default, (list, tuple)) else [action.default]
        if action.nargs == 0:
            values = []
        elif None in defaults:
            values = [str(action.choices[0])] if action.choices else None
        else:
            values = [str(value) for value in defaults]
        if values is None:
            continue  # no default to spell out (paths, URLs, ranks): the fuzzer covers them
        argv = [datasets["good"], action.option_strings[-1], *values]
        assert parse_outcome(mode, argv) == "config", argv


# Fixed hostile command lines: names longer than a file system allows and values holding a newline
# (which broke the promise when this file was written), and values at the edge of a flag's range.
EDGE_CASES = [
    pytest.param("nd", ["x" * 300], id="DATA-name-too-long"),
    pytest.param("nd", ["--synthetic", "--resume", "x" * 300], id="resume-name-too-long"),
    pytest.param("nd", ["--synthetic", "-e", "--report-dir", "x" * 300], id="report-dir-name-too-long"),
    pytest.param("nd", ["--synthetic", "--lr", " -1\n"], id="lr-negative-with-newline"),
    pytest.param("nd", ["bad\ndata"], id="DATA-with-newline"),
    pytest.param("nd", ["--synthetic", "--resume", "no\nsuch.pth.tar"], id="resume-with-newline"),
    pytest.param("nd", ["--synthetic", "data", "stray\nword"], id="unrecognized-word-with-newline"),
    pytest.param("nd", ["--synthetic", "--epochs", "9" * 5000], id="epochs-past-int-digit-limit"),
    pytest.param("nd", ["--synthetic", "--lr", "-1e309"], id="lr-minus-overflow"),
    pytest.param("ddp", ["--synthetic", "--rank", "1"], id="rank-without-world-size"),
    pytest.param("ddp_apex", ["--synthetic", "--loss-scale", "inf"], id="loss-scale-inf"),
    pytest.param("dp", ["--synthetic", "--preempt-signal", "99999"], id="preempt-signal-out-of-range"),
    pytest.param("dp", ["--synthetic", "--checkpoint-every", "nanmin"], id="checkpoint-every-nan"),
    pytest.param("nd", ["--synthetic", "--", "--lr"], id="flag-after-double-dash"),
]


@pytest.mark.parametrize("mode,argv", EDGE_CASES)
def test_hostile_edge_cases_start_or_name_a_flag(mode, argv):
    assert parse_outcome(mode, argv) in ("config", "usage error")


@pytest.mark.skipif(os.geteuid() == 0, reason="root passes through folders whatever their permissions")
@pytest.mark.parametrize("flags", [[], ["--resume", "x.pth.tar"], ["-e", "--report-dir", "reports"]],
                         ids=["DATA", "resume", "report-dir"])
def test_paths_inside_an_unreadable_folder_start_or_name_the_flag(tmp_path, flags):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0)
    try:
        if flags:
            argv = ["--synthetic", *flags[:-1], str(locked / flags[-1])]
        else:
            argv = [str(locked / "data")]
        assert parse_outcome("nd", argv) in ("config", "usage error")
    finally:
        locked.chmod(0o700)


@pytest.mark.slow
@pytest.mark.parametrize("script,argv,flag", [
    ("imagenet_nd.py", ["--synthetic", "--lr", "nan"], "argument --lr/--learning-rate: "),
    ("imagenet_dp.py", ["--synthetic", "-b", "0"], "argument -b/--batch-size/--b: "),
    ("imagenet_ddp.py", ["--synthetic", "--epochs=-3"], "argument --epochs: "),
    ("imagenet_ddp_apex.py", ["--synthetic", "--fp16"], "unrecognized arguments: --fp16"),
])
def test_script_exits_2_with_one_line_naming_the_flag(script, argv, flag):
    result = run_script([script, *argv], timeout=120)
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{script}: error: {flag}"), lines[0]
