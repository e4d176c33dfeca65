"""`python -m common.tools.bench`: the benchmark's command (command_line.main)."""
from common.errors import run_main
from common.tools.bench.command_line import build_parser, main  # build_parser: what the docs' commands are checked against

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    run_main(main)
