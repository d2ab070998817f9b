"""``python -m aelastic run|serve|status ...``: the same as the ``aelastic`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
