"""imagenet_ddp.py itself, run as its own __main__ with a test's hook after every optimizer step:
the training that batch-file tests hand to Slurm or torchrun in the script's place (the slow saver
of test_run_scripts.py, the gated training of test_slurm.py). Nothing in the product: each test
writes a short wrapper script that sets its hooks and calls run_imagenet_ddp; the wrapper finds
this module, and the repository, through TEST_REPO, and both note what happened in TEST_NOTES,
a folder the test reads.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Callable

REPO, NOTES = Path(os.environ["TEST_REPO"]), Path(os.environ["TEST_NOTES"])
sys.path.insert(0, str(REPO))
# Before the wrapper's own patches (the gated training's wraps signal.signal), as in the script's own imports.
import torch  # noqa: E402


def run_imagenet_ddp(after_step: Callable[[], None], note_exit: Callable[[object], None]) -> None:
    """imagenet_ddp.py with this process's arguments, after_step() after each of its SGD steps;
    note_exit(status) as it exits, and the exit goes on."""
    step = torch.optim.SGD.step

    def step_then_hook(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        after_step()
        return result

    torch.optim.SGD.step = step_then_hook
    sys.argv[0] = str(REPO / "imagenet_ddp.py")
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exit:
        note_exit(exit.code)
        raise
