"""``attn bench kv-accuracy``: what a quantized KV cache costs in accuracy, on the toy GPT.

A checkpoint of :mod:`attn.models` (default: the committed text GPT) evaluated teacher-forced
on the validation split with every layer's K/V round-tripped through a
:class:`attn.kvcache.PagedKVCache` of each format (:data:`CACHES`): the mean cross-entropy
per predicted token, against a float32 row without a cache (docs/benchmarks.md, "Decoding from
quantized and paged caches").
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from attn.bench import report
from attn.kvcache import PagedKVCache
from attn.kvquant import KVQuant, bytes_per_token

CHECKPOINT = Path(__file__).resolve().parents[2] / "benchmarks" / "checkpoints" / \
    "text-gpt-4x128-gqa2.pt"
# (label, storage dtype, format): the cache types, the per-channel keys (KIVI) and one
# full-precision window
CACHES = (
    ("bf16", torch.bfloat16, None),
    ("int8 (per token, head)", torch.float32, KVQuant("int8")),
    ("int8 (groups of 32)", torch.float32, KVQuant("int8", group=32)),
    ("int4 (groups of 32)", torch.float32, KVQuant("int4")),
    ("fp8_e4m3 (per head)", torch.float32, KVQuant("fp8_e4m3")),
    ("int8, K per channel, last page fp32", torch.float32,
     KVQuant("int8", k_per_channel=True, recent_pages=1)),
    ("int4, K per channel, last page fp32", torch.float32,
     KVQuant("int4", k_per_channel=True, recent_pages=1)),
    ("int4, last 2 pages fp32", torch.float32, KVQuant("int4", recent_pages=2)),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", type=Path, default=CHECKPOINT,
                   help="an attn.models checkpoint (default: the committed text GPT)")
    p.add_argument("--batches", type=int, default=8, help="validation batches")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--page", type=int, default=16, help="positions per cache page")
    p.add_argument("--out", type=Path, default=Path("out/bench-kv-accuracy"))


class _RoundTrip:
    """One layer's cache for :class:`attn.models.GPT`: appends into a PagedKVCache and hands
    attention back what the cache holds, dequantized (B, Hkv, length, D)."""

    def __init__(self, B: int, Hkv: int, T: int, D: int, page: int, dtype: torch.dtype,
                 quant: KVQuant | None) -> None:
        pages = -(-T // page)
        self.cache = PagedKVCache.allocate(B * pages, page, Hkv, D, max_seqs=B,
                                           max_pages=pages, dtype=dtype, quant=quant)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.append(k.float(), v.float())
        self.length += k.shape[2]
        return tuple(x.to(k.dtype) for x in self.cache.batch_kv())  # (B, Hkv, N, D)


def _loss(model, x: torch.Tensor, y: torch.Tensor, caches) -> float:
    logits, _ = model(x, caches=caches)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum").item()


def run(args: argparse.Namespace, argv: list[str]) -> int:
    from attn.models.data import TextCorpus
    from attn.models.gpt import model_from_checkpoint

    model, state = model_from_checkpoint(args.ckpt)
    model = model.float().eval()
    cfg = model.cfg
    att = cfg.attention
    Hkv = att.kv_heads or att.heads
    D = cfg.dim // att.heads
    T = cfg.block_size
    corpus = TextCorpus.load()
    batches = [corpus.batch("val", args.batch_size, T, torch.Generator().manual_seed(i))
               for i in range(args.batches)]
    tokens = sum(y.numel() for _, y in batches)
    rows = []
    with torch.inference_mode():
        base = sum(_loss(model, x, y, None) for x, y in batches) / tokens
        rows.append(dict(cache="fp32 (no cache)", loss=base, ratio=1.0,
                         bytes_per_token=bytes_per_token(None, Hkv, D, page_size=args.page)))
        for label, dtype, quant in CACHES:
            total = 0.0
            for x, y in batches:
                caches = [_RoundTrip(x.shape[0], Hkv, T, D, args.page, dtype, quant)
                          for _ in range(cfg.n_layer)]
                total += _loss(model, x, y, caches)
            loss = total / tokens
            size = bytes_per_token(quant, Hkv, D, page_size=args.page,
                                   storage_bytes=dtype.itemsize, n_tokens=T)
            rows.append(dict(cache=label, loss=loss, ratio=loss / base, bytes_per_token=size))
            print(f"{label}: loss {loss:.4f} ({100 * (loss / base - 1):+.2f}%), "
                  f"{size:.0f} bytes per token", flush=True)
    header = {**report.run_header("cpu", argv), "checkpoint": str(args.ckpt),
              "step": state.get("step"), "tokens": tokens, "page": args.page,
              "block_size": T, "heads_kv": Hkv, "head_dim": D, "n_layer": cfg.n_layer}
    lines = ["# KV-cache formats: the toy GPT's validation loss", "",
             f"`{header['command']}`: checkpoint `{args.ckpt.name}` (step {header['step']}), "
             f"{tokens} validation tokens (teacher-forced, {args.batches} batches of "
             f"{args.batch_size} x {T}), pages of {args.page}, {cfg.n_layer} layers x "
             f"{Hkv} kv heads x D = {D}; {header['device_name']}, torch {header['torch']}.", "",
             "bytes per token: one layer's K and V, scales included; a full-precision window "
             f"averaged over {T} tokens.", "",
             "| cache | val loss | vs fp32 | bytes per token (one layer) | vs fp32 |",
             "|:--|--:|--:|--:|--:|"]
    full = rows[0]["bytes_per_token"]
    for r in rows:
        lines.append(f"| {r['cache']} | {r['loss']:.4f} | {100 * (r['ratio'] - 1):+.2f}% | "
                     f"{r['bytes_per_token']:.0f} | {r['bytes_per_token'] / full:.3f} |")
    report.write_results(args.out, header, rows, "\n".join(lines) + "\n")
    return 0
