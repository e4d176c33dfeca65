"""Old path of common.tools.bench, kept for one release: `python -m common.bench`
and `import common.bench` still work; use common.tools.bench."""
import sys

from common.tools import bench as _tool

if __name__ == "__main__":
    from common.errors import run_main

    run_main(_tool.main)
else:
    sys.modules[__name__] = _tool
