"""``python -m jaxsync.bench [options]``: the same as ``python -m jaxsync bench``.

May import: ``jaxsync.bench.cli`` only.
"""

import sys

from .cli import main

if __name__ == "__main__":  # not when pytest imports it for doctests
    sys.exit(main())
