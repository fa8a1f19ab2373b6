"""``attn bench hf-quant``: what a quantized KV cache changes in a Hugging Face decoder's output.

Random-weight decoders of the families ``tests/test_hf.py`` runs (and a larger Llama,
``--large``) decode random prompts greedily with each cache type (:func:`cache_types`),
compared with HF's float32 ``DynamicCache`` (results.md defines the columns, docs/hf.md
summarises them); ``--step-tokens N`` adds one decode step's time after an N-token prompt.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from attn.bench import report
from attn.bench.hf import Shape, build_model
from attn.kvcache import PagedKVCache
from attn.kvquant import KVQuant

FAMILIES = ("llama", "mistral", "gemma2", "gpt_oss", "qwen3")
NO_SDPA = ("gemma2", "gpt_oss")  # HF runs these with eager only


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--large", action="store_true",
                   help="also a Llama of 4 layers, width 512 (8 heads of 64, 2 kv heads)")
    p.add_argument("--batch", type=int, default=4, help="prompts per model")
    p.add_argument("--prompt", type=int, default=24, help="tokens per prompt")
    p.add_argument("--new", type=int, default=32, help="new tokens per prompt")
    p.add_argument("--steps", type=int, default=4, help="decode steps whose logits are compared")
    p.add_argument("--page", type=int, default=8, help="positions per page of attn's caches")
    p.add_argument("--step-tokens", type=int, nargs="*", default=[],
                   help="prompt lengths of the step-time table (none: no table)")
    p.add_argument("--repeats", type=int, default=9, help="timed decode steps per point")
    p.add_argument("--out", type=Path, default=Path("out/bench-hf-quant"))


def build(family: str, large: bool = False):
    """A random-weight decoder of ``family`` (the shapes of tests/test_hf.py, or larger)."""
    import transformers as T

    if large:
        common = dict(vocab_size=512, hidden_size=512, intermediate_size=1024,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      initializer_range=0.05)
    else:
        common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
    common.update(max_position_embeddings=8192, tie_word_embeddings=False, pad_token_id=0,
                  bos_token_id=None, eos_token_id=None)
    head = common["hidden_size"] // common["num_attention_heads"]
    # family: (transformers' class prefix, its config's keywords beyond the common ones)
    families = {
        "llama": ("Llama", {}), "mistral": ("Mistral", dict(sliding_window=5)),
        "gemma2": ("Gemma2", dict(head_dim=head, sliding_window=5, attn_logit_softcapping=2.0,
                                  final_logit_softcapping=30.0, query_pre_attn_scalar=24)),
        "gpt_oss": ("GptOss", dict(head_dim=head, sliding_window=5, num_local_experts=4,
                                   num_experts_per_tok=2, experts_implementation="eager",
                                   intermediate_size=32)),
        "qwen3": ("Qwen3", dict(head_dim=head))}
    if family not in families:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    name, extra = families[family]
    torch.manual_seed(0)
    model = getattr(T, f"{name}ForCausalLM")(getattr(T, f"{name}Config")(**{**common, **extra}))
    if family == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    return model.eval()


def _bf16_cache(config):
    """HF's Cache whose layers store K/V in bfloat16 pages (an unquantized PagedKVCache) and
    hand them back dense in the model's dtype."""
    from transformers.cache_utils import Cache, DynamicLayer

    class Bf16Layer(DynamicLayer):
        def update(self, k, v, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(k, v)
                self.pages = PagedKVCache.allocate(k.shape[0] * 64, 128, k.shape[1], k.shape[3],
                                                   max_seqs=k.shape[0], max_pages=64,
                                                   dtype=torch.bfloat16)
            self.pages.append(k, v)
            self.keys, self.values = (x.to(k.dtype) for x in self.pages.batch_kv())
            return self.keys, self.values

    return Cache(layers=[Bf16Layer() for _ in range(config.num_hidden_layers)])


def cache_types(head_dim: int, page: int, residual: int) -> dict:
    """label -> (attention implementation or None for the family's dense one, factory(config,
    max_tokens) -> cache)."""
    from transformers import DynamicCache, QuantizedCache

    from attn.integrations.hf import AttnQuantizedCache

    g = min(32, head_dim)

    def attn_cache(quant):
        return "attn", lambda cfg, n: AttnQuantizedCache(cfg, quant, max_tokens=n, page_size=page)

    def quanto(bits):
        return None, lambda cfg, n: QuantizedCache(backend="quanto", config=cfg, nbits=bits,
                                                   q_group_size=g, residual_length=residual)

    return {
        "fp32 (DynamicCache)": (None, lambda cfg, n: DynamicCache(config=cfg)),
        "bf16": (None, lambda cfg, n: _bf16_cache(cfg)),
        "attn int8": attn_cache(KVQuant("int8")),
        "attn int4": attn_cache(KVQuant("int4", group=g)),
        "attn fp8_e4m3": attn_cache(KVQuant("fp8_e4m3")),
        "attn int4, K per channel, last page fp32": attn_cache(
            KVQuant("int4", group=g, k_per_channel=True, recent_pages=1)),
        "quanto int4 (HF QuantizedCache)": quanto(4),
        "quanto int2 (HF QuantizedCache)": quanto(2),
    }


def _teacher_forced(model, ids, tokens, cache):
    """Logits (B, 1 + new, V): the prompt's last position, then each baseline token fed in."""
    out = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]]
    for t in range(tokens.shape[1] - 1):
        out.append(model(input_ids=tokens[:, t:t + 1], past_key_values=cache,
                         use_cache=True).logits[:, -1])
    return torch.stack(out, 1)


def agreement(model, family: str, types: dict, args) -> list[dict]:
    dense = "eager" if family in NO_SDPA else "sdpa"
    g = torch.Generator().manual_seed(1)
    V = model.config.vocab_size
    ids = torch.randint(3, V, (args.batch, args.prompt), generator=g)
    n = args.prompt + args.new + 1
    gen = dict(max_new_tokens=args.new, do_sample=False, pad_token_id=0)
    rows = []
    with torch.no_grad():
        model.set_attn_implementation(dense)
        base_cfg = types["fp32 (DynamicCache)"]
        want = model.generate(ids, past_key_values=base_cfg[1](model.config, n),
                              **gen)[:, args.prompt:]
        base = _teacher_forced(model, ids, want, base_cfg[1](model.config, n))
        for label, (impl, make) in types.items():
            model.set_attn_implementation(impl or dense)
            try:
                got = model.generate(ids, past_key_values=make(model.config, n),
                                     **gen)[:, args.prompt:]
                logits = _teacher_forced(model, ids, want, make(model.config, n))
            except Exception as exc:  # e.g. quanto missing: recorded, the table goes on
                rows.append(dict(family=family, cache=label, error=f"{type(exc).__name__}: "
                                 f"{str(exc)[:300]}"))
                print(f"{family} {label}: {rows[-1]['error']}", flush=True)
                continue
            same = got == want
            prefix = torch.where(same.all(1), args.new, (~same).int().argmax(1)).float()
            d = (logits[:, :args.steps + 1] - base[:, :args.steps + 1]).abs()
            rows.append(dict(
                family=family, cache=label, attention=impl or dense,
                agreement=float((logits.argmax(-1) == base.argmax(-1)).float().mean()),
                identical_prefix=float(prefix.mean()), max_dlogit=float(d.max()),
                mean_dlogit=float(d.mean()), logit_scale=float(base.abs().max())))
            r = rows[-1]
            print(f"{family} {label}: agreement {r['agreement']:.3f}, prefix "
                  f"{r['identical_prefix']:.1f}/{args.new}, max |dlogit| {r['max_dlogit']:.3g}",
                  flush=True)
    return rows


def step_times(lengths: list[int], types: dict, args) -> list[dict]:
    """One decode step after an N-token prompt, per cache type: every cache is prefilled
    first, then the caches take turns for ``--repeats`` rounds (a busy moment of a shared
    machine lands on all of them alike); median per cache, the first round dropped."""
    # hidden and MLP widths and the vocabulary: 1024 (Shape's defaults)
    model = build_model(Shape(layers=2, heads=8, kv_heads=2, head_dim=128))
    picked = ("fp32 (DynamicCache)", "attn int8", "attn int4", "quanto int4 (HF QuantizedCache)")
    rows = []
    for n in lengths:
        ids = torch.randint(3, 1024, (1, n), generator=torch.Generator().manual_seed(n))
        caches, times, errors = {}, {label: [] for label in picked}, {}
        with torch.no_grad():
            for label in picked:
                impl, make = types[label]
                model.set_attn_implementation(impl or "sdpa")
                try:
                    caches[label] = make(model.config, n + args.repeats + 2)
                    model(input_ids=ids, past_key_values=caches[label], use_cache=True,
                          logits_to_keep=1)
                except Exception as exc:  # recorded in the table
                    errors[label] = f"{type(exc).__name__}: {str(exc)[:300]}"
            for r in range(args.repeats + 1):
                tok = torch.tensor([[3 + r]])
                for label in caches:
                    model.set_attn_implementation(types[label][0] or "sdpa")
                    t0 = time.perf_counter()
                    model(input_ids=tok, past_key_values=caches[label], use_cache=True)
                    times[label].append(time.perf_counter() - t0)
        for label in picked:
            if label in errors:
                rows.append(dict(tokens=n, cache=label, error=errors[label]))
                continue
            rows.append(dict(tokens=n, cache=label, attention=types[label][0] or "sdpa",
                             step_ms=1e3 * statistics.median(times[label][1:])))
            print(f"N={n} {label}: {rows[-1]['step_ms']:.2f} ms", flush=True)
    return rows


def _markdown(header: dict, rows: list[dict], steps: list[dict], args) -> str:
    lines = ["# Quantized KV caches in Hugging Face decoders: agreement with fp32", "",
             f"`{header['command']}`; {header['date']}, {header['device_name']} "
             f"({header['cpu_count']} CPUs), torch {header['torch']}, "
             f"transformers {header['transformers']}, optimum-quanto {header['quanto']}, "
             f"{header['torch_threads']} threads, load average {header['loadavg_1min']:.1f} "
             "at the end.", "",
             f"Random-weight decoders (see `attn/bench/hf_quant.py`), {args.batch} prompts of "
             f"{args.prompt} random tokens, {args.new} greedy new tokens, pages of {args.page} "
             f"(attn), quanto residual length {header['quanto_residual']}. Agreement: share of "
             f"teacher-forced steps whose argmax equals the fp32 DynamicCache run's; prefix: "
             f"free-running new tokens equal to it before the first that differs (mean of "
             f"{args.batch}); |Δlogit|: over the prefill's last position and the first "
             f"{args.steps} teacher-forced steps.", "",
             "| model | cache | attention | agreement | identical prefix | max abs dlogit | "
             "mean abs dlogit |", "|:--|:--|:--|--:|--:|--:|--:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r['cache']} | - | error: {r['error']} | | | |")
            continue
        lines.append(f"| {r['family']} | {r['cache']} | {r['attention']} | "
                     f"{100 * r['agreement']:.1f}% | {r['identical_prefix']:.1f} / {args.new} | "
                     f"{r['max_dlogit']:.3g} | {r['mean_dlogit']:.3g} |")
    if steps:
        lines += ["", "## One decode step after a long prompt", "",
                  "Llama, 2 layers, 8 heads of 128, 2 kv heads, batch 1, the whole model's step; "
                  f"the caches take turns, median of {args.repeats} rounds after a warm-up "
                  "round; attn's caches have no full-precision window, quanto's keeps its "
                  f"last {header['step_residual']} tokens in fp32. The machine may be shared "
                  "(compare within one prompt length).", "",
                  "| prompt tokens | cache | attention | step ms |", "|--:|:--|:--|--:|"]
        for r in steps:
            cell = f"{r['step_ms']:.2f}" if "step_ms" in r else f"error: {r['error']}"
            lines.append(f"| {r['tokens']} | {r['cache']} | {r.get('attention', '-')} | "
                         f"{cell} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, argv: list[str]) -> int:
    import transformers

    from attn.integrations import hf

    hf.register("attn")

    try:
        from importlib.metadata import version

        quanto = version("optimum-quanto")
    except Exception:  # not installed: its rows record the error
        quanto = "not installed"
    residual = 2 * args.page
    rows = []
    models = [(f, False) for f in args.families] + ([("llama", True)] if args.large else [])
    for family, large in models:
        model = build(family, large)
        head = model.config.hidden_size // model.config.num_attention_heads
        label = f"{family} (large)" if large else family
        rows += agreement(model, label, cache_types(head, args.page, residual), args)
    step_residual = 128  # quanto's default residual length
    steps = step_times(args.step_tokens, cache_types(128, args.page, step_residual), args) \
        if args.step_tokens else []
    header = {**report.run_header("cpu", argv), "transformers": transformers.__version__,
              "quanto": quanto, "quanto_residual": residual, "step_residual": step_residual}
    report.write_results(args.out, header, rows, _markdown(header, rows, steps, args),
                         step_times=steps)
    return 0
