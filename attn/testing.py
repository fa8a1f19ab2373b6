"""Compare any attention implementation with attn's float64 reference, within an honest budget.

The budget follows flash-attention's tests: an implementation in a low precision may be off
from the exact (float64) answer by at most ``factor`` times what plain PyTorch — the naive
reference run in that same precision — is off, plus a rounding floor of a few ulps at unit
scale (or at the tensor's largest entry, if larger). So a bf16 kernel is held to bf16 standards, a float64 one to float64.

Use it in your own tests::

    from functools import partial
    import attn, attn.testing

    q, k, v = attn.testing.make_inputs(B=2, H=4, N=97, D=64, dtype=torch.bfloat16)
    report = attn.testing.assert_close_to_reference(my_attention, q, k, v, causal=True)
    print(report)   # one line per checked tensor: error, plain PyTorch's error, budget

``fn`` must accept attn.attention's keywords that you pass (and ``return_lse`` when
``check_lse``); it is called as ``fn(q, k, v, **kwargs)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

# The rounding floor, per unit of max(1, largest |exact| entry): about an ulp for the half
# types, ~16 ulps for float32 (FlashAttention's Δ = rowsum(dO∘O) and dP = dO·Vᵀ round
# differently, so dS = P∘(dP − Δ) keeps ~ulp(dP) where the exact dS is 0), and slack for
# summation order in float64.
_PER_ELEMENT = ("out", "lse", "dq", "dk", "dv")
_FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2.0**-11,
          torch.bfloat16: 2.0**-8}


@dataclass
class Comparison:
    name: str
    error: float  # max |tested - exact|
    plain_error: float  # max |plain PyTorch in the same dtype - exact|
    budget: float

    @property
    def ok(self) -> bool:
        return self.error <= self.budget


@dataclass
class Report:
    dtype: torch.dtype
    comparisons: list[Comparison] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.comparisons)

    def __getitem__(self, name: str) -> Comparison:
        return next(c for c in self.comparisons if c.name == name)

    def __str__(self) -> str:
        lines = [f"{'tensor':<14}{'error':>12}{'plain ' + str(self.dtype)[6:]:>16}{'budget':>12}"]
        for c in self.comparisons:
            flag = "" if c.ok else "   <-- over budget"
            lines.append(f"{c.name:<14}{c.error:>12.3e}{c.plain_error:>16.3e}{c.budget:>12.3e}{flag}")
        return "\n".join(lines)


def make_inputs(B: int = 2, H: int = 4, N: int = 128, D: int = 64, *, Hkv: int | None = None,
                Nk: int | None = None, Dv: int | None = None, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Seeded standard-normal q (B, H, N, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv)."""
    g = torch.Generator().manual_seed(seed)
    Hkv, Nk, Dv = Hkv or H, Nk or N, Dv or D
    shapes = [(B, H, N, D), (B, Hkv, Nk, D), (B, Hkv, Nk, Dv)]
    return tuple(torch.randn(s, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
                 for s in shapes)


def _leaf(t: Tensor, dtype: torch.dtype | None, grad: bool) -> Tensor:
    t = t.detach()
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.clone().requires_grad_(grad)


def _run(fn: Callable, q: Tensor, k: Tensor, v: Tensor, kwargs: dict, dtype: torch.dtype | None,
         grad: bool, check_lse: bool, seed: int, d_out: Tensor | None, d_lse: Tensor | None
         ) -> dict[str, Tensor]:
    """One call on fresh leaves (cast to ``dtype`` unless None); returns outputs and grads."""
    leaves = {n: _leaf(t, dtype, grad) for n, t in (("q", q), ("k", k), ("v", v))}
    kw = {}
    for name, val in kwargs.items():
        if isinstance(val, Tensor):
            learn = val.requires_grad and grad
            val = _leaf(val, dtype, learn)
            if learn:
                leaves[name] = val
        kw[name] = val
    torch.manual_seed(seed)  # dropout masks come from the default generator
    res = fn(leaves["q"], leaves["k"], leaves["v"], **kw, **({"return_lse": True} if check_lse else {}))
    out, lse = res if check_lse else (res, None)
    got = {"out": out.detach().to(torch.float64)}
    if lse is not None:
        got["lse"] = lse.detach().to(torch.float64)
    if grad:
        loss = (out.to(torch.float64) * d_out).sum()
        if lse is not None and d_lse is not None:
            finite = torch.isfinite(lse)
            loss = loss + torch.where(finite, lse.to(torch.float64), 0.0).mul(d_lse).sum()
        names = list(leaves)
        grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
        for n, g in zip(names, grads):
            got["d" + n] = (torch.zeros_like(leaves[n], dtype=torch.float64) if g is None
                            else g.detach().to(torch.float64))
    return got


def _max_err(a: Tensor, exact: Tensor, name: str) -> float:
    if name == "lse":  # -inf rows must agree exactly; compare the finite ones
        inf_a, inf_e = torch.isinf(a), torch.isinf(exact)
        if not torch.equal(inf_a, inf_e):
            return float("inf")
        a, exact = a[~inf_e], exact[~inf_e]
    if a.numel() == 0:
        return 0.0
    if not torch.isfinite(a).all():
        return float("inf")
    return (a - exact).abs().max().item()


def compare_to_reference(fn: Callable, q: Tensor, k: Tensor, v: Tensor, *, grad: bool = True,
                         check_lse: bool = True, out_factor: float = 2.0,
                         grad_factor: float = 3.0, seed: int = 0, **kwargs) -> Report:
    """Errors of ``fn`` and of plain PyTorch (the reference in q's dtype) against float64.

    Checks out, lse (when ``check_lse``) and, when ``grad``, the gradients of q, k, v and of
    every tensor keyword that requires grad (temperature, sinks, softcap, attn_mask), from
    a random upstream gradient on out (and lse). Budgets: ``out_factor`` × plain error for
    out and lse, ``grad_factor`` × for gradients, each plus a rounding floor of a few ulps
    at max(1, the exact tensor's largest entry) (``_FLOOR``); gradients of variant
    parameters, each a sum over many scores, also get a random-walk term
    ``2·eps·sqrt(terms summed per entry)`` at that scale.
    """
    from attn.api import attention  # here, not at import: attn.api may import this module

    dtype = q.dtype
    g = torch.Generator().manual_seed(seed + 1)
    B, H, Nq = q.shape[0], q.shape[1], q.shape[2]
    d_out = torch.randn(B, H, Nq, v.shape[-1], generator=g, dtype=torch.float64) if grad else None
    d_lse = torch.randn(B, H, Nq, generator=g, dtype=torch.float64) if grad and check_lse else None
    if d_out is not None:
        d_out, d_lse = d_out.to(q.device), None if d_lse is None else d_lse.to(q.device)

    def reference(*a, **kw):
        return attention(*a, **kw, backend="reference")

    common = dict(grad=grad, check_lse=check_lse, seed=seed, d_out=d_out, d_lse=d_lse)
    exact = _run(reference, q, k, v, kwargs, torch.float64, **common)
    plain = _run(reference, q, k, v, kwargs, None, **common)
    tested = _run(fn, q, k, v, kwargs, None, **common)

    report = Report(dtype)
    for name, ex in exact.items():
        factor = out_factor if name in ("out", "lse") else grad_factor
        plain_err = _max_err(plain[name], ex, name)
        finite = ex[torch.isfinite(ex)]
        magnitude = max(1.0, finite.abs().max().item() if finite.numel() else 0.0)
        floor = _FLOOR[dtype] * magnitude
        if name not in _PER_ELEMENT:
            # a variant parameter's gradient sums n_terms scores per entry: rounding noise
            # grows like sqrt(n_terms) and the max over a handful of entries is a noisy
            # estimate of plain PyTorch's, so allow a random walk of ~2 ulps per term
            n_terms = B * H * Nq * k.shape[2] / max(1, ex.numel())
            floor += 2 * torch.finfo(dtype).eps * magnitude * n_terms ** 0.5

        err = _max_err(tested[name], ex, name) if name in tested else float("inf")
        report.comparisons.append(Comparison(name, err, plain_err, factor * plain_err + floor))
    return report


def assert_close_to_reference(fn: Callable, q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Report:
    """:func:`compare_to_reference`, raising AssertionError with the table when over budget."""
    report = compare_to_reference(fn, q, k, v, **kwargs)
    if not report.ok:
        shown = {k_: (tuple(v_.shape) if isinstance(v_, Tensor) else v_) for k_, v_ in kwargs.items()}
        raise AssertionError(
            f"attention differs from the float64 reference beyond budget "
            f"(q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, {dtype_name(q.dtype)}, "
            f"{shown}):\n{report}")
    return report


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
