"""argparse pieces shared by the entry scripts' parser (common.cli) and the
tools (common.tools): value types whose messages argparse prefixes with the
flag's name, and a parser whose mistakes are UsageErrors (one line, exit
status 2). Bottom layer: imports nothing of common/ but errors.
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

from common.errors import UsageError


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose every parse error is a UsageError: one line
    and exit status 2 under errors.run_main (argparse would print usage)."""

    def error(self, message: str):  # argparse calls this for every parse error
        raise UsageError(f"{message} (see --help)")

    def _get_values(self, action, arg_strings):
        # `--epochs=--`: argparse (3.11) drops the "--" as the end-of-options marker and hands the flag an
        # empty list instead of a value, which no check downstream expects. Found by tests/unit/test_cli_fuzz.py.
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            self.error(f"argument {'/'.join(action.option_strings)}: expected one argument, got '--'")
        return super()._get_values(action, arg_strings)


def int_at_least(minimum: int, what: str, maximum: Optional[int] = None) -> Callable[[str], int]:
    def parse_int(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse_int


positive_int = int_at_least(1, "a positive integer")
non_negative_int = int_at_least(0, "an integer >= 0")
# NumPy's global seed (seeded with the others) takes 32 bits.
seed_int = int_at_least(0, "an integer from 0 to 2**32 - 1 (4294967295)", maximum=2**32 - 1)


def float_in(low: float, high: float, low_open: bool, high_open: bool, what: str) -> Callable[[str], float]:
    def parse_float(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        too_high = value >= high if high_open else value > high
        if value != value or too_low or too_high:  # value != value: NaN
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    return parse_float


positive_float = float_in(0.0, float("inf"), True, True, "a positive number")
non_negative_float = float_in(0.0, float("inf"), False, True, "a number >= 0")
unit_interval = float_in(0.0, 1.0, False, True, "a number in [0, 1)")


def percent(text: str) -> float:
    """--desired-acc: 0.75 and 75 both mean 75% (values <= 1 are fractions)."""
    value = float_in(0.0, 100.0, True, False, "an accuracy in (0, 1] or (1, 100]")(text)
    return value * 100.0 if value <= 1.0 else value
