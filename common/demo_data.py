"""Old path of common.tools.demo_data, kept for one release: `python -m common.demo_data`
and `import common.demo_data` still work; use common.tools.demo_data."""
import sys

from common.tools import demo_data as _tool

if __name__ == "__main__":
    from common.errors import run_main

    run_main(_tool.main)
else:
    sys.modules[__name__] = _tool
