"""Custom memory sweep: the same flags as `attn bench memory` (see `--help`).

    python scripts/bench_memory.py --n 1024 4096 16384 --backends tiled sdpa --mode fwd+bwd
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from attn.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "memory", *sys.argv[1:]]))
