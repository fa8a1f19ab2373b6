"""``attn gpu-check``'s smoke stage (docs/gpu.md): every variant of the triton kernels at a
few small shapes against the float64 reference, and the same call twice giving the same bits.
"""

from __future__ import annotations

import torch

import attn
from attn.bench.gpu_record import StageContext, exc_line
from attn.testing import compare_to_reference, make_inputs
from attn.bench.gpu_stages import _device, _variant_kwargs

# the variants of the smoke, in the order they run at each shape
VARIANTS = ("plain", "causal", "window", "softcap", "alibi", "sinks", "gqa", "bool_mask",
            "float_mask", "dropout", "varlen", "temperature")
# the dry run's: the interpreter takes ~2 s a case on 2 cores, so four cases that take every
# path of this module (attn.attention, a learned parameter's gradient, dropout's seed, varlen);
# tests/test_variants.py runs every variant on the interpreter
DRY_VARIANTS = ("causal", "sinks", "dropout", "varlen")


def _grid(dry_run: bool) -> list[tuple[str, int, int]]:
    """(dtype, head dim, N) in priority order: all N of a (dtype, D) in a row, since they
    share its kernels' builds."""
    if dry_run:
        return [("float32", 16, 17)]
    return [(dtype, D, N) for dtype, D in (("bfloat16", 128), ("bfloat16", 64),
                                           ("float32", 64), ("float32", 128))
            for N in (300, 17, 1)]


def _varlen_case(N: int, dev: str):
    """Packed sequences as a (1, H, N, D) call: ``fn`` packs and runs
    attn.varlen_attention on triton; the reference gets the same packing as a
    block-diagonal causal mask (the ``attn_mask`` keyword, which ``fn`` leaves to it)."""
    lengths = [n for n in (N // 4, N - N // 4) if n]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(N)
    keep = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
    cu, longest = cu.to(dev), max(lengths)

    def fn(q, k, v, attn_mask=None, return_lse=False):
        packed = [x[0].transpose(0, 1).contiguous() for x in (q, k, v)]
        res = attn.varlen_attention(*packed, cu, cu, longest, longest, causal=True,
                                    backend="triton", return_lse=return_lse)
        out, lse = res if return_lse else (res, None)
        out = out.transpose(0, 1).unsqueeze(0)
        return (out, lse.unsqueeze(0)) if return_lse else out
    return fn, {"attn_mask": keep.to(dev)}


def _case(variant: str, dtype_name: str, D: int, N: int, dev: str):
    """q, k, v, the attn.attention keywords and ``fn(q, k, v, **kw)`` on triton."""
    dtype = getattr(torch, dtype_name)
    B, H = (1, 2) if dev == "cpu" else (2, 4)  # the interpreter's cost is per program
    B = 1 if variant == "varlen" else B
    q, k, v = make_inputs(B=B, H=H, Hkv=H // 2 if variant == "gqa" else None, N=N, D=D,
                          dtype=dtype, device=dev, seed=N + D, logit_scale=2.0)
    if variant == "varlen":
        fn, kw = _varlen_case(N, dev)
        return q, k, v, kw, fn
    kw = _variant_kwargs(variant, H, N, dev)
    if variant == "float_mask":
        kw["attn_mask"] = kw["attn_mask"].to(dtype)
    if variant == "sinks":  # the case's dtype, still a leaf whose gradient is checked
        kw["sinks"] = kw["sinks"].detach().to(dtype).requires_grad_()

    def fn(q, k, v, return_lse=False, **kw):
        return attn.attention(q, k, v, backend="triton", return_lse=return_lse, **kw)
    return q, k, v, kw, fn


def _learned(kw: dict) -> list[str]:
    """The keywords whose tensors take a gradient (sinks), in keyword order."""
    return [n for n, t in kw.items() if isinstance(t, torch.Tensor) and t.requires_grad]


def _bits(fn, q, k, v, kw: dict) -> list:
    """Out, lse and every gradient of one call on fresh leaves (dropout's seed fixed)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    kw = {**kw, **{n: kw[n].detach().clone().requires_grad_() for n in _learned(kw)}}
    torch.manual_seed(0)
    out, lse = fn(*leaves, return_lse=True, **kw)
    g = torch.Generator().manual_seed(1)
    do = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, [*leaves, *(kw[n] for n in _learned(kw))], do)
    return [out.detach(), lse.detach(), *grads]


def check_case(variant: str, dtype_name: str, D: int, N: int, dev: str) -> dict:
    """One smoke case's row fields: ``status`` ok or failed, ``worst`` (the largest
    error / budget over out, lse and the gradients), ``repeatable`` (two calls, same bits)
    and a ``note`` naming what failed."""
    q, k, v, kw, fn = _case(variant, dtype_name, D, N, dev)
    report = compare_to_reference(fn, q, k, v, check_lse=True, **kw)
    first, again = _bits(fn, q, k, v, kw), _bits(fn, q, k, v, kw)
    names = ["out", "lse", "dq", "dk", "dv", *(f"d{n}" for n in _learned(kw))]
    differ = [n for n, a, b in zip(names, first, again) if not torch.equal(a, b)]
    over = [f"{c.name} {c.error:.2e} > {c.budget:.2e}" for c in report.comparisons if not c.ok]
    notes = ([f"over budget: {', '.join(over)}"] if over else []) + (
        [f"not bitwise repeatable: {', '.join(differ)}"] if differ else [])
    return {"status": "ok" if report.ok and not differ else "failed",
            "worst": report.worst if report.worst != float("inf") else None,
            "repeatable": not differ, "note": "; ".join(notes)}


def smoke(ctx: StageContext) -> None:
    """Every variant at each shape of :func:`_grid`, in order, until the box runs short."""
    dev = _device(ctx)
    grid = _grid(ctx.dry_run)
    variants = DRY_VARIANTS if ctx.dry_run else VARIANTS
    if ctx.dry_run:
        ctx.dropped("smoke bf16 and D 64/128 at N = 1, 17, 300; variants "
                    + ", ".join(v for v in VARIANTS if v not in variants),
                    "dry run: four cases at one tiny float32 shape in the interpreter")
    for i, (dtype, D, N) in enumerate(grid):
        for variant in variants:
            if ctx.left() < 5:
                ctx.dropped(f"smoke from {variant} {dtype} D={D} N={N} ({len(grid) - i} "
                            "shape(s) not finished)", "the box ran short")
                return
            what = f"{variant} {dtype} D={D} N={N}"
            ctx.running(f"smoke {what}")
            try:
                got = check_case(variant, dtype, D, N, dev)
            except Exception as exc:  # a crash is this case's result
                got = {"status": "failed", "worst": None, "repeatable": None,
                       "note": exc_line(exc)}
            ctx.row(kind="smoke", variant=variant, dtype=dtype, D=D, N=N, backend="triton",
                    what=what, **got)
            ctx.log(f"smoke {what}: {got['status']}, worst error / budget "
                    f"{'—' if got['worst'] is None else format(got['worst'], '.2f')}"
                    + (f" ({got['note']})" if got["note"] else ""))
