"""``attn bench hf``: a Hugging Face causal LM on CPU with attn_implementation eager, sdpa, attn.

A Llama built from a config (:class:`Shape`), per context N one prompt prefilled and decoded
greedily by each implementation, each prefill's last logits compared with eager's;
docs/benchmarks.md ("A Llama in transformers on CPU") has the method and the numbers.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from attn.bench import report
from attn.bench.sweep import available_memory_bytes
from attn.timing import CPU_ERROR_BYTES, benchmark, peak_bytes

IMPLS = ("attn", "sdpa", "eager")  # attn first: its cache serves a skipped prefill's decode


@dataclass
class Shape:
    layers: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 1024  # narrow MLP: the projections are not what is measured
    vocab: int = 1024

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim


def build_model(shape: Shape):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden,
                      intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                      num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                      head_dim=shape.head_dim, max_position_embeddings=1 << 17)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def predicted_prefill_bytes(impl: str, n: int, s: Shape) -> int:
    """Generous estimate of the prefill's peak above the weights, float32.

    Linear: hidden states, q/k/v/o and MLP activations, the KV cache (kept). Eager adds, per
    layer (freed before the next), the float mask (N^2) and about three (H, N, N) score-sized
    tensors (scores, scores + mask, softmax). attn's tiles: a few (H, 256, 512) fp32 blocks.
    """
    f32 = 4
    linear = n * f32 * (10 * s.hidden + 3 * s.intermediate + 2 * s.layers * s.kv_heads * s.head_dim)
    if impl == "eager":
        return linear + (3 * s.heads + 1) * n * n * f32
    return linear + 8 * s.heads * 256 * 512 * f32


@dataclass
class Row:
    impl: str
    context: int
    status: str = "ok"  # ok | skipped | failed
    prefill_peak_bytes: int | None = None
    prefill_s: float | None = None
    prefill_repeats: int = 0
    predicted_bytes: int | None = None
    decode_tokens_per_s: float | None = None  # from the median step
    decode_best_tokens_per_s: float | None = None  # from the fastest step (least disturbed)
    decode_steps: int = 0
    decode_cache_from: str | None = None  # which implementation filled the decoding cache
    logits_max_diff_vs_eager: float | None = None  # last-position prefill logits
    note: str = ""


def prefill(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[:, -1]


def decode_rate(model, cache, logits, steps: int) -> tuple[float, float]:
    """Tokens/s of greedy single-token steps after the prefill's last ``logits``, from the
    median and from the fastest step; then the cache is cut back to the prompt."""
    tok = logits.argmax(-1, keepdim=True)
    times = []
    with torch.no_grad():
        for _ in range(steps + 1):  # the first step is warm-up
            t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
    cache.crop(-(steps + 1))  # back to the prompt, for the next implementation
    times = sorted(times[1:])
    return 1.0 / times[len(times) // 2], 1.0 / times[0]


def measure(args: argparse.Namespace, argv: list[str]) -> tuple[dict, list[Row]]:
    import attn.integrations.hf as hf
    import transformers

    hf.register("attn", backend=args.backend)
    shape = Shape(**{f.name: getattr(args, f.name) for f in fields(Shape)})  # a flag per field
    model = build_model(shape)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    rows: list[Row] = []
    header = report.run_header("cpu", argv)
    header.update({
        "what": "HF LlamaForCausalLM prefill + decode on CPU, attn_implementation eager/sdpa/attn",
        "model": asdict(shape) | {"hidden": shape.hidden, "weights_bytes": weights,
                                  "dtype": "float32"},
        "transformers": transformers.__version__, "attn_backend": args.backend,
        "attn_commit": _git_commit(),
        "loadavg_start": list(os.getloadavg()),
        "memory_method": ("torch.profiler CPU allocator events, peak live bytes above the "
                          f"weights (error <= {CPU_ERROR_BYTES} bytes on a known allocation)"),
        "budget": "a prefill is skipped when its prediction passes 60% of free memory",
    })
    g = torch.Generator().manual_seed(1)
    for n in args.context:
        ids = torch.randint(3, shape.vocab, (1, n), generator=g)
        attn_cache = None
        logits = {}
        for impl in IMPLS:
            row = Row(impl, n, predicted_bytes=predicted_prefill_bytes(impl, n, shape))
            rows.append(row)
            model.set_attn_implementation(impl)
            budget = int(0.6 * available_memory_bytes("cpu"))
            cache = first = None
            if row.predicted_bytes > budget:
                row.status = "skipped"
                row.note = (f"predicted {row.predicted_bytes / 2**30:.1f} GiB > 60% of free "
                            f"memory ({budget / 2**30:.1f} GiB)")
            else:
                try:
                    row.prefill_peak_bytes = peak_bytes(lambda: prefill(model, ids))
                    holder = {}

                    def timed():
                        holder["out"] = None  # free the previous cache before the next prefill
                        holder["out"] = prefill(model, ids)

                    t = benchmark(timed, warmup=0, repeats=args.repeats, min_repeats=1,
                                  budget_s=args.budget_s)
                    row.prefill_s, row.prefill_repeats = t.median_ms / 1e3, t.repeats
                    cache, first = holder.pop("out")
                    logits[impl] = first
                    if impl == "attn":
                        attn_cache = (cache, first)
                except (RuntimeError, MemoryError) as exc:
                    row.status, row.note = "failed", f"{type(exc).__name__}: {exc}"[:300]
            if cache is None and attn_cache is not None:
                cache, first = attn_cache
                row.decode_cache_from = "attn"
            elif cache is not None:
                row.decode_cache_from = impl
            if cache is not None and args.decode_steps > 0:
                row.decode_tokens_per_s, row.decode_best_tokens_per_s = decode_rate(
                    model, cache, first, args.decode_steps)
                row.decode_steps = args.decode_steps
            print(_line(row), file=sys.stderr, flush=True)
            del cache
        if "eager" in logits:
            for row in rows[-len(IMPLS):]:
                if row.impl in logits:
                    row.logits_max_diff_vs_eager = (
                        logits[row.impl] - logits["eager"]).abs().max().item()
    header["loadavg_end"] = list(os.getloadavg())
    return header, rows


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[2], check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _mib(b: int | None) -> str:
    return "—" if b is None else f"{b / 2**20:,.0f}"


def _line(r: Row) -> str:
    return (f"{r.impl:6s} N={r.context:6d} {r.status:8s} peak {_mib(r.prefill_peak_bytes)} MiB "
            f"(pred {_mib(r.predicted_bytes)}) prefill {r.prefill_s} s decode "
            f"{r.decode_tokens_per_s} tok/s {r.note}")


def markdown(header: dict, rows: list[Row]) -> str:
    m = header["model"]
    out = [
        "# attn in transformers: prefill and decode on CPU",
        "",
        f"- model: LlamaForCausalLM from config, {m['layers']} layer(s), {m['heads']} heads, "
        f"{m['kv_heads']} kv heads, head dim {m['head_dim']}, hidden {m['hidden']}, MLP "
        f"{m['intermediate']}, vocab {m['vocab']}, float32, weights "
        f"{m['weights_bytes'] / 2**20:,.0f} MiB",
        f"- device: {header['device_name']} ({header['cpu_count']} CPUs, "
        f"{header['torch_threads']} torch threads); load average at start "
        f"{', '.join(f'{x:.2f}' for x in header['loadavg_start'])}, at end "
        f"{', '.join(f'{x:.2f}' for x in header['loadavg_end'])}",
        f"- torch {header['torch']}, transformers {header['transformers']}, python "
        f"{header['python']}, attn backend {header['attn_backend']!r}, commit "
        f"{header['attn_commit']}, {header['date']}",
        f"- command: `{header['command']}`",
        f"- memory: {header['memory_method']}; {header['budget']}",
        "",
        "| context | impl | prefill peak MiB above weights | prefill s | sdpa s / s "
        "| decode tok/s, median step | best step | decode cache from | logits vs eager |",
        "|--:|:--|--:|--:|--:|--:|--:|:--|--:|",
    ]
    by = {(r.impl, r.context): r for r in rows}
    for r in rows:
        sd = by.get(("sdpa", r.context))
        ratio = (f"{sd.prefill_s / r.prefill_s:.2f}" if sd and sd.prefill_s and r.prefill_s
                 else "—")
        peak = _mib(r.prefill_peak_bytes) if r.status == "ok" else (
            f"skipped (predicted {r.predicted_bytes / 2**30:,.1f} GiB)" if r.status == "skipped"
            else r.status)
        out.append(f"| {r.context} | {r.impl} | {peak} | {report._fmt(r.prefill_s, '.2f')} | {ratio} "
                   f"| {report._fmt(r.decode_tokens_per_s, '.1f')} "
                   f"| {report._fmt(r.decode_best_tokens_per_s, '.1f')} "
                   f"| {r.decode_cache_from or '—'} "
                   f"| {report._fmt(r.logits_max_diff_vs_eager, '.1e')} |")
    notes = [f"- {r.impl} at {r.context}: {r.note}" for r in rows if r.note]
    return "\n".join(out + ([""] + notes if notes else [])) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Shape()
    p.add_argument("--out", type=Path, default=Path("out/bench-hf"),
                   help="folder for results.json and results.md")
    p.add_argument("--context", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--heads", "-H", type=int, default=d.heads)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads)
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--intermediate", type=int, default=d.intermediate, help="MLP width")
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--backend", default="auto", help="attn backend behind attn_implementation")
    p.add_argument("--repeats", type=int, default=3, help="timed prefills at most per point")
    p.add_argument("--budget-s", type=float, default=60.0,
                   help="stop repeating a prefill after this many seconds of timed runs")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's, one per core)")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    header, rows = measure(args, argv)
    report.write_results(args.out, header, [asdict(r) for r in rows], markdown(header, rows))
    return 1 if any(r.status == "failed" for r in rows) else 0
