"""Compare any attention implementation with attn's float64 reference, within an honest budget:
at most ``factor`` times plain PyTorch's own error in the same dtype (the naive reference run
there), plus a rounding floor, as flash-attention's tests hold their kernels. How to use it in
your own tests, and the conformance cases: docs/testing.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
from torch import Tensor

from attn.adapters import params_of, takes

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
    notes: list[str] = field(default_factory=list)  # what was not checked, and why

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.comparisons)

    @property
    def worst(self) -> float:
        """The largest error / budget over the comparisons (at most 1 passes)."""
        return max(c.error / c.budget for c in self.comparisons)

    def __getitem__(self, name: str) -> Comparison:
        for c in self.comparisons:
            if c.name == name:
                return c
        raise KeyError(f"{name!r} was not compared; compared: {[c.name for c in self.comparisons]}"
                       + "".join(f"; {n}" for n in self.notes))

    def __str__(self) -> str:
        lines = [f"{'tensor':<14}{'error':>12}{'plain ' + str(self.dtype)[6:]:>16}{'budget':>12}"]
        for c in self.comparisons:
            flag = "" if c.ok else "   <-- over budget"
            lines.append(f"{c.name:<14}{c.error:>12.3e}{c.plain_error:>16.3e}{c.budget:>12.3e}{flag}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def make_inputs(B: int = 2, H: int = 4, N: int = 128, D: int = 64, *, Hkv: int | None = None,
                Nk: int | None = None, Dv: int | None = None, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", seed: int = 0, logit_scale: float = 1.0
                ) -> tuple[Tensor, Tensor, Tensor]:
    """Seeded standard-normal q (B, H, N, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv); q times
    ``logit_scale``, the scores' standard deviation (from ~30 the largest float32 scores pass
    88, where ``exp`` overflows in a softmax without max-subtraction)."""
    if not logit_scale > 0:
        raise ValueError(f"logit_scale must be positive, got {logit_scale}")
    g = torch.Generator().manual_seed(seed)
    Hkv, Nk, Dv = Hkv or H, Nk or N, Dv or D
    shapes = [(B, H, N, D), (B, Hkv, Nk, D), (B, Hkv, Nk, Dv)]
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    return tuple(t.to(dtype=dtype, device=device) for t in (q * logit_scale, k, v))


def _leaf(t: Tensor, dtype: torch.dtype | None, grad: bool) -> Tensor:
    t = t.detach()
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.clone().requires_grad_(grad)


def _split(res, asked_lse: bool) -> tuple[Tensor, Tensor | None]:
    """``fn``'s return value as (out, lse or None): a bare tensor, or a pair of tensors."""
    if isinstance(res, Tensor):
        return res, None
    if isinstance(res, (tuple, list)) and len(res) == 2 and all(isinstance(t, Tensor) for t in res):
        return res[0], res[1]
    kind = (f"a {type(res).__name__} of {len(res)}: "
            f"{[type(t).__name__ for t in res]}" if isinstance(res, (tuple, list))
            else type(res).__name__)
    raise TypeError(f"fn must return the output tensor or (out, lse); it returned {kind}"
                    + (" (it was called with return_lse=True)" if asked_lse else ""))


def _check_shape(name: str, got: Tensor, want: tuple[int, ...], letters: str,
                 q: Tensor, k: Tensor, v: Tensor) -> None:
    if tuple(got.shape) != want:
        raise AssertionError(
            f"fn returned {name} of shape {tuple(got.shape)}, expected {letters} = {want} for "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}. attn's layout is "
            f"(B, H, N, D), as torch's scaled_dot_product_attention; a function written for "
            f"flash-attn's (B, N, H, D) needs q, k, v and out transposed (x.transpose(1, 2))")


def _run(fn: Callable, q: Tensor, k: Tensor, v: Tensor, kwargs: dict, dtype: torch.dtype | None,
         grad: bool, lse: bool | None, seed: int, d_out: Tensor | None, d_lse: Tensor | None
         ) -> dict[str, Tensor]:
    """One call on fresh leaves (cast to ``dtype`` unless None); returns outputs and grads.

    ``lse``: True asks ``fn`` for it and requires it, False neither asks nor keeps it, None
    asks when ``fn``'s signature takes ``return_lse`` and keeps whatever comes back.
    """
    leaves = {n: _leaf(t, dtype, grad) for n, t in (("q", q), ("k", k), ("v", v))}
    kw = {}
    for name, val in kwargs.items():
        if isinstance(val, Tensor):
            learn = val.requires_grad and grad
            val = _leaf(val, dtype, learn)
            if learn:
                leaves[name] = val
        kw[name] = val
    ask = lse if lse is not None else takes(params_of(fn), "return_lse")
    torch.manual_seed(seed)  # dropout masks come from the default generator
    res = fn(leaves["q"], leaves["k"], leaves["v"], **kw, **({"return_lse": True} if ask else {}))
    out, got_lse = _split(res, ask)
    if lse and got_lse is None:
        raise TypeError("check_lse=True, but fn returned only the output when called with "
                        "return_lse=True: return (out, lse), or leave check_lse unset")
    if lse is False:
        got_lse = None
    B, H, Nq = q.shape[:3]
    _check_shape("out", out, (B, H, Nq, v.shape[-1]), "(B, H, Nq, Dv)", q, k, v)
    got = {"out": out.detach().to(torch.float64)}
    if got_lse is not None:
        _check_shape("lse", got_lse, (B, H, Nq), "(B, H, Nq)", q, k, v)
        got["lse"] = got_lse.detach().to(torch.float64)
    if grad:
        loss = (out.to(torch.float64) * d_out).sum()
        if got_lse is not None and d_lse is not None:
            finite = torch.isfinite(got_lse)
            loss = loss + torch.where(finite, got_lse.to(torch.float64), 0.0).mul(d_lse).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        for (n, leaf), g in zip(leaves.items(), grads):
            got["d" + n] = (torch.zeros_like(leaf, dtype=torch.float64) if g is None
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
                         check_lse: bool | None = None, out_factor: float = 2.0,
                         grad_factor: float = 3.0, seed: int = 0, **kwargs) -> Report:
    """Errors of ``fn`` (called ``fn(q, k, v, **kwargs)``) and of plain PyTorch (the reference
    in q's dtype) against float64, each with its budget: out, lse and, when ``grad``, the
    gradients of q, k, v and of every tensor keyword that requires grad. Budgets:
    ``out_factor`` × plain error for out and lse, ``grad_factor`` × for gradients, plus
    ``_FLOOR`` at max(1, the exact tensor's largest entry). ``check_lse`` (None: asked when
    ``fn`` takes ``return_lse``), wrong shapes and refused inputs: docs/testing.md.
    """
    from attn.api import attention  # here, not at import: attn.api may import this module

    if not callable(fn):
        raise TypeError(f"fn must be callable (an attention function called as fn(q, k, v, "
                        f"**kwargs)), got {type(fn).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-d tensor (B, H, N, D), got {got}")
    dtype = q.dtype
    g = torch.Generator().manual_seed(seed + 1)
    B, H, Nq = q.shape[0], q.shape[1], q.shape[2]
    d_out = d_lse = None
    if grad:
        d_out = torch.randn(B, H, Nq, v.shape[-1], generator=g, dtype=torch.float64).to(q.device)
        if check_lse is not False:
            d_lse = torch.randn(B, H, Nq, generator=g, dtype=torch.float64).to(q.device)
    reference = partial(attention, backend="reference")

    def run_reference(dtype_, lse: bool):
        return _run(reference, q, k, v, kwargs, dtype_, grad=grad, lse=lse, seed=seed,
                    d_out=d_out, d_lse=d_lse if lse else None)

    # the reference runs first, so inputs attn.attention refuses raise its clear ValueError
    # before fn sees them
    exact = run_reference(torch.float64, check_lse is not False)
    tested = _run(fn, q, k, v, kwargs, None, grad=grad, lse=check_lse, seed=seed, d_out=d_out,
                  d_lse=d_lse)
    notes = []
    if check_lse is False:
        notes.append("lse not checked (check_lse=False)")
    elif "lse" not in tested:
        # fn gave no lse, so its gradients came from out alone: redo the exact ones likewise
        notes.append("lse not checked: fn returned only the output (out and the gradients "
                     "through out were checked)")
        exact = run_reference(torch.float64, False) if grad else {
            n: t for n, t in exact.items() if n != "lse"}
    plain = run_reference(None, "lse" in exact)

    report = Report(dtype, notes=notes)
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


# -- the conformance cases: one attention function against the whole contract ----------------

@dataclass(frozen=True)
class Case:
    """One row of the conformance matrix: shapes, attn.attention keywords and what to check.

    ``options`` holds the plain keywords (causal, window, softcap, dropout_p, ...); ``mask``
    (``"bool"``, ``"float"``, ``"empty rows"``) and ``sinks`` ask for tensors that
    :meth:`inputs` draws from ``seed``. ``grad`` checks the gradients too, ``lse`` requires and
    checks the lse; a case with ``dropout_p`` is judged by statistics (:func:`check_dropout`).
    ``str(case)`` is its name, so ``ids=str`` names pytest's parameters.
    """

    name: str
    B: int = 2
    H: int = 3
    Nq: int = 17
    Nk: int | None = None
    D: int = 16
    Hkv: int | None = None
    Dv: int | None = None
    options: tuple[tuple[str, object], ...] = ()
    mask: str | None = None
    sinks: bool = False
    logit_scale: float = 2.0
    grad: bool = False
    lse: bool = False
    seed: int = 0

    def __str__(self) -> str:
        return self.name

    @property
    def kwargs(self) -> dict:
        return dict(self.options)

    def inputs(self, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
               ) -> tuple[Tensor, Tensor, Tensor, dict]:
        """q (B, H, Nq, D), k, v and the keywords (masks and sinks drawn here, seeded)."""
        Nk = self.Nk or self.Nq
        q, k, v = make_inputs(self.B, self.H, self.Nq, self.D, Hkv=self.Hkv, Nk=Nk, Dv=self.Dv,
                              dtype=dtype, device=device, seed=self.seed,
                              logit_scale=self.logit_scale)
        kw = self.kwargs
        g = torch.Generator().manual_seed(self.seed + 7)
        if self.mask is not None:
            keep = torch.rand(self.B, 1, self.Nq, Nk, generator=g) > 0.3
            keep[..., 0] |= self.mask != "empty rows"  # no accidental empty row ...
            if self.mask == "empty rows":  # ... except these, on purpose
                keep[:, :, 1::3] = False
            if self.mask == "float":
                bias = torch.randn(self.B, 1, self.Nq, Nk, generator=g, dtype=torch.float64)
                kw["attn_mask"] = bias.masked_fill(~keep, float("-inf")).to(dtype)
            else:
                kw["attn_mask"] = keep
            kw["attn_mask"] = kw["attn_mask"].to(device)
        if self.sinks:
            sinks = torch.randn(self.H, generator=g, dtype=torch.float64).to(dtype)
            kw["sinks"] = sinks.to(device).requires_grad_(self.grad)
        return q, k, v, kw

    def check(self, fn: Callable, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> Report | None:
        """Assert ``fn`` (attn's convention: wrap others with :func:`attn.adapters.adapt`)
        meets this case: :func:`assert_close_to_reference`, or :func:`check_dropout`."""
        q, k, v, kw = self.inputs(dtype, device)
        if kw.get("dropout_p"):
            problem = check_dropout(fn, q, k, v, **kw)
            if problem:
                raise AssertionError(f"{self.name}: {problem}")
            return None
        return assert_close_to_reference(fn, q, k, v, grad=self.grad, check_lse=self.lse, **kw)


_CASES = (
    Case("plain"),
    Case("N=1", Nq=1),
    Case("N=97", B=1, Nq=97),
    Case("N=1025", B=1, H=1, Nq=1025),
    Case("N=1025 causal", B=1, H=1, Nq=1025, options=(("causal", True),)),
    Case("odd sizes", B=3, H=5, Nq=33, D=40),
    Case("causal", options=(("causal", True),)),
    Case("causal Nq<Nk (bottom-right)", Nq=17, Nk=40, options=(("causal", True),)),
    Case("causal Nq>Nk (bottom-right)", Nq=40, Nk=17, options=(("causal", True),)),
    Case("Nq<Nk", Nq=17, Nk=97),
    Case("Nq>Nk", Nq=97, Nk=17),
    Case("GQA", H=4, Hkv=2),
    Case("MQA", H=4, Hkv=1),
    Case("window (8, 0) causal", Nq=40, options=(("causal", True), ("window", (8, 0)))),
    Case("window (4, 4)", Nq=40, options=(("window", (4, 4)),)),
    Case("softcap", logit_scale=6.0, options=(("softcap", 5.0),)),
    Case("sinks", sinks=True),
    Case("mask bool", mask="bool"),
    Case("mask float", mask="float"),
    Case("fully masked rows", mask="empty rows"),
    Case("huge logits", logit_scale=300.0),
    Case("dropout", B=1, H=2, options=(("dropout_p", 0.3),)),
    Case("scale", options=(("scale", 0.3),)),
    Case("gradients", grad=True),
    Case("gradients causal GQA", H=4, Hkv=2, Nq=23, grad=True,
         options=(("causal", True),)),
    Case("gradients sinks", sinks=True, grad=True),
    Case("lse", lse=True, options=(("causal", True),)),
    Case("lse fully masked rows", mask="empty rows", lse=True),
)


def conformance_cases(names: list[str] | tuple[str, ...] | None = None, *,
                      quick: bool = False) -> list[Case]:
    """The conformance matrix's cases (``attn check``'s rows), for
    ``pytest.mark.parametrize("case", conformance_cases(), ids=str)`` and ``case.check(fn)``
    (docs/conformance.md). ``names`` picks cases by name (ValueError naming unknown ones);
    ``quick`` leaves out the N = 1025 rows. Rows your function cannot express raise its own
    error (TypeError, NotImplementedError): skip those, or let ``attn check`` sort them out.
    """
    cases = [c for c in _CASES if not (quick and c.Nq >= 1025)]
    if names is None:
        return cases
    known = {c.name: c for c in cases}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"names: no conformance case {unknown}; the cases are {list(known)}")
    return [known[n] for n in names]


DROPOUT_UNSCALED = ("dropout without rescaling (kept probabilities not divided by 1 - p: "
                    "the mean output is (1 - p) times the exact one)")


def check_dropout(fn: Callable, q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float,
                  samples: int = 64, **kwargs) -> str | None:
    """Dropout judged by its statistics, since its mask is ``fn``'s own: over ``samples``
    seeded calls the outputs must vary, and their mean must be the exact (no-dropout) output
    within 5 standard errors per entry (inverted dropout keeps the mean). None when it holds,
    else what is wrong."""
    from attn.api import attention

    exact = attention(*(t.detach().to(torch.float64) for t in (q, k, v)),
                      **{n: (t.detach().to(torch.float64) if isinstance(t, Tensor)
                             and t.is_floating_point() else t) for n, t in kwargs.items()},
                      backend="reference")
    outs = []
    with torch.no_grad():
        for s in range(samples):
            torch.manual_seed(s)
            res = fn(q, k, v, dropout_p=dropout_p, **kwargs)
            outs.append((res[0] if isinstance(res, (tuple, list)) else res).to(torch.float64))
    outs = torch.stack(outs)
    if not torch.isfinite(outs).all():
        return "the outputs hold NaN or inf"
    spread = outs.std(dim=0)
    if spread.max().item() == 0.0:
        return f"dropout_p={dropout_p} changed nothing: every seed gave the same output"
    mean_err = (outs.mean(dim=0) - exact).abs()
    bound = 5 * spread / samples ** 0.5 + _FLOOR[q.dtype] * max(1.0, exact.abs().max().item())
    worst = (mean_err / bound).max().item()
    if worst > 1.0 and ((outs.mean(dim=0) - (1 - dropout_p) * exact).abs() / bound
                        ).max().item() <= 1.0:
        return f"{DROPOUT_UNSCALED}, p = {dropout_p}"
    if worst > 1.0:
        return (f"the mean of {samples} dropout outputs is {worst:.1f}x further from the exact "
                f"output than 5 standard errors (max |mean - exact| "
                f"{mean_err.max().item():.3e}): is the kept probability rescaled by 1/(1-p)?")
    return None
