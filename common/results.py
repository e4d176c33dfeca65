"""Old path of common.tools.results, kept for one release: `python -m common.results`
and `import common.results` still work; use common.tools.results."""
import sys

from common.tools import results as _tool

if __name__ == "__main__":
    from common.errors import run_main

    run_main(_tool.main)
else:
    sys.modules[__name__] = _tool
