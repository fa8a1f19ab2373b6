"""Context parallelism on CPU: the same flags as `attn bench context-parallel` (see `--help`).

    python scripts/bench_context_parallel.py --world-sizes 1 2 4 --n 2048 8192 32768
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from attn.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "context-parallel", *sys.argv[1:]]))
