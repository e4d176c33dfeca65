"""Old path of common.tools.plots, kept for one release: `python -m common.plots`
and `import common.plots` still work; use common.tools.plots."""
import sys

from common.tools import plots as _tool

if __name__ == "__main__":
    from common.errors import run_main

    run_main(_tool.main)
else:
    sys.modules[__name__] = _tool
