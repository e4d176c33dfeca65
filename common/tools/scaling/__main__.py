"""python -m common.tools.scaling: the scaling model's command (common.tools.scaling.command_line)."""
from common.errors import run_main
from common.tools.scaling.command_line import build_parser, main  # build_parser: what the docs' commands are checked against

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    run_main(main)
