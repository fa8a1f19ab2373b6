"""Train the toy GPT: ``python scripts/train.py --task recall --out runs/recall``.

Writes DIR/metrics.json and DIR/ckpt.pt; ``--resume`` continues from DIR/ckpt.pt. Every field
of ``attn.models.train.TrainConfig`` is a flag (attention options included: ``--qk-norm rms``,
``--dropout 0.1``, ``--learn-temperature``, ``--window 64`` ...); see ``--help``.
``--context-parallel P`` shards every sequence across P processes (ring attention): it spawns
them on this machine, or joins the group when started by ``torchrun --nproc-per-node P``.

It runs the installed attn (``pip install .`` or, to edit models/, ``pip install -e .``): the
checkout's source attn/ has no models/ folder, which installs as ``attn.models``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from attn.models.config import add_flags, flag_values
from attn.models.train import TrainConfig, train

# the GPT is causal by construction: a --no-causal flag could only fail
NOT_FLAGS = ("causal",)


def _temperature(s: str) -> float | str:
    """A float, or "learned": TrainConfig's shorthand for --learn-temperature from 1."""
    return s if s == "learned" else float(s)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(p, TrainConfig, skip=NOT_FLAGS, required=("task",),
              parse={"temperature": _temperature},
              helps={"temperature": "or 'learned': --learn-temperature from 1"})
    p.add_argument("--out", type=Path, required=True, help="run directory")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    p.add_argument("--no-progress", action="store_true")
    return p


def config_from_args(argv: list[str] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
    a = build_parser().parse_args(argv)
    return TrainConfig(**flag_values(a, TrainConfig)), a


def main(argv: list[str] | None = None) -> dict:
    cfg, a = config_from_args(argv)
    m = train(cfg, a.out, resume=a.resume, progress=not a.no_progress)
    summary = {k: m[k] for k in ("task", "steps", "final_train_loss", "val_loss", "accuracy",
                                 "tokens_per_s", "peak_memory_bytes", "train_time_s")}
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, every rank returns here
        print(json.dumps(summary, indent=2))
    return m


if __name__ == "__main__":
    main()
