"""Train the toy GPT: ``python scripts/train.py --task recall --out runs/recall``.

Writes DIR/metrics.json and DIR/ckpt.pt; ``--resume`` continues from DIR/ckpt.pt.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from attn.api import BACKENDS  # noqa: E402
from attn.models.train import TASKS, TrainConfig, train  # noqa: E402


def _temperature(s: str) -> float | str:
    if s == "learned":
        return s
    try:
        t = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive float or 'learned', got {s!r}")
    if not t > 0:
        raise argparse.ArgumentTypeError(f"temperature must be positive, got {t}")
    return t


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=TASKS, required=True)
    p.add_argument("--steps", type=int, help="total optimizer steps (default: per task)")
    p.add_argument("--backend", choices=BACKENDS, default="auto")
    p.add_argument("--qk-norm", choices=("none", "l2", "rms", "layer"), default="none")
    p.add_argument("--qk-norm-position", choices=("before", "after"), default="before")
    p.add_argument("--temperature", type=_temperature, default=1.0,
                   help="attention temperature: a float, or 'learned' (per head)")
    p.add_argument("--softcap", type=float)
    p.add_argument("--window", type=int, help="sliding window: keys at most this far back")
    p.add_argument("--sinks", action="store_true")
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--block-size", type=int, help="text: context length")
    p.add_argument("--n-layer", type=int)
    p.add_argument("--dim", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: per task)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="run directory")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    cfg = TrainConfig(
        task=a.task, steps=a.steps, backend=a.backend,
        qk_norm=None if a.qk_norm == "none" else a.qk_norm,
        qk_norm_position=a.qk_norm_position, temperature=a.temperature, softcap=a.softcap,
        window=a.window, sinks=a.sinks, kv_heads=a.kv_heads, batch_size=a.batch_size,
        block_size=a.block_size, n_layer=a.n_layer, dim=a.dim, heads=a.heads, lr=a.lr,
        threads=a.threads, seed=a.seed)
    m = train(cfg, a.out, resume=a.resume, progress=not a.no_progress)
    summary = {k: m[k] for k in ("task", "steps", "final_train_loss", "val_loss", "accuracy",
                                 "tokens_per_s", "peak_memory_bytes", "train_time_s")}
    print(json.dumps(summary, indent=2))
    return m


if __name__ == "__main__":
    main()
