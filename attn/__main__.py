"""``python -m attn report ...``: the same command as the ``attn`` console script."""

import sys

from attn.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
