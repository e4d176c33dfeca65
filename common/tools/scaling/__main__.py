"""python -m common.tools.scaling: the scaling model's command (common.tools.scaling.command_line)."""
from common.errors import run_main
# build_parser: what the docs' commands are checked against (tests/unit/test_docs.py)
from common.tools.scaling.command_line import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    run_main(main)
