"""Sample from a checkpoint: ``python scripts/generate.py runs/text/ckpt.pt --prompt "def "``.

Text checkpoints take a string prompt; recall checkpoints answer a freshly drawn recall
sequence (the prompt is its pairs and first query) and print whether the answer is right.
It runs the installed attn, as scripts/train.py does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from attn.models.data import RecallTask, decode, encode
from attn.models.gpt import model_from_checkpoint


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ckpt", type=Path)
    p.add_argument("--prompt", default="def ")
    p.add_argument("--tokens", type=int, default=200, help="new tokens to sample")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    model, state = model_from_checkpoint(a.ckpt)
    model.eval()
    g = torch.Generator().manual_seed(a.seed)
    task = state["train_config"]["task"]
    if task == "text":
        idx = encode(a.prompt).unsqueeze(0).repeat(a.samples, 1)  # (S, T)
        out = model.generate(idx, a.tokens, a.temperature, a.top_k, generator=g)
        text = "\n-----\n".join(decode(row) for row in out)
    else:
        rt = RecallTask(**state["train_config"]["recall"])
        x, y = rt.batch(a.samples, g)
        t0 = 2 * rt.pairs + 1  # pairs and the first query
        out = model.generate(x[:, :t0], 1, temperature=0.0)
        lines = []
        for row, got, want in zip(x, out[:, -1], y[:, t0 - 1]):
            lines.append(f"pairs {row[:2 * rt.pairs].tolist()} query {row[t0 - 1].item()} -> "
                         f"{got.item()} (expected {want.item()}, "
                         f"{'right' if got == want else 'wrong'})")
        text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
