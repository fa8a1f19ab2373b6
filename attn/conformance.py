"""The conformance matrix behind ``attn check``: run every case of
:func:`attn.testing.conformance_cases` on a function in attn's convention
(:mod:`attn.adapters`), judge it against the float64 reference (:mod:`attn.testing`'s
budget) and diagnose a wrong row by :data:`HYPOTHESES` or locate it by :func:`where`. The
statuses and when a run passes: docs/conformance.md.
"""

from __future__ import annotations

import math
import re
import traceback
from dataclasses import asdict, dataclass, field
from functools import partial
from itertools import groupby
from typing import Callable

import torch
from torch import Tensor

from attn.adapters import Adapted, adapt, load_target
from attn.api import attention
from attn.masks import dense_keep
from attn.testing import (DROPOUT_UNSCALED, Case, check_dropout, compare_to_reference,
                          conformance_cases, dtype_name)

STATUSES = ("correct", "not supported", "wrong", "NaN", "error")
_UNSUPPORTED = (NotImplementedError, TypeError, ValueError)


@dataclass
class Row:
    """One case's verdict. ``detail``: the exception, the errors over budget; ``diagnosis``:
    the hypotheses that fit; ``where``: the error's location when none fits."""

    case: str
    status: str
    detail: str = ""
    diagnosis: list[str] = field(default_factory=list)
    where: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("wrong", "NaN", "error")

    def text(self) -> str:
        if self.status == "correct":
            return "supported and correct"
        if self.status == "not supported":
            return f"not supported ({self.detail})"
        parts = [f"{self.status}: {self.detail}" if self.detail else self.status]
        if self.diagnosis:
            parts.append("diagnosis: " + "; ".join(self.diagnosis))
        elif self.where:
            parts.append(f"no named hypothesis fits; the error lives in {self.where}")
        return " — ".join(parts)


@dataclass
class CheckResult:
    target: str
    style: str
    layout: str
    detected: str
    dtype: str
    device: str
    rows: list[Row]

    @property
    def ok(self) -> bool:
        return not any(r.failed for r in self.rows)

    def as_dict(self) -> dict:
        return {"target": self.target, "style": self.style, "layout": self.layout,
                "detected": self.detected, "dtype": self.dtype, "device": self.device,
                "ok": self.ok, "rows": [asdict(r) for r in self.rows]}

    def table(self) -> str:
        """One line per case, except the cases the function does not support: one line per
        reason, naming the cases and the keywords it could not express."""
        shown = [r for r in self.rows if r.status != "not supported"]
        width = max([len(r.case) for r in shown] + [len("not supported")]) + 2
        lines = [f"attn check {self.target}: style {self.detected}; layout {self.layout}; "
                 f"{self.dtype} on {self.device}", "",
                 f"{'case':<{width}}result"]
        lines += [f"{r.case:<{width}}{r.text()}" for r in shown]
        for (head, why), (cases, keywords) in _unsupported_groups(self.rows).items():
            what = f"{head} {', '.join(keywords)}{why}" if keywords else head
            lines.append(f"{'not supported':<{width}}{len(cases)} case"
                         f"{'s' if len(cases) > 1 else ''} ({', '.join(cases)}): {what}")
        counts = {s: sum(r.status == s for r in self.rows) for s in STATUSES}
        lines += ["", ", ".join(f"{n} {s}" for s, n in counts.items() if n)
                  + (" — passed" if self.ok else " — FAILED")]
        return "\n".join(lines)


# an adapter's refusal: "raised NotImplementedError: f (attn style) cannot express
# window=(8, 0): its signature has no such parameter" -> head, keyword, value, why
_REFUSAL = re.compile(r"^(?P<head>.*cannot express) (?P<keyword>\w+)(?P<value>[^:]*)"
                      r"(?P<why>: .*)?$")


def _unsupported_groups(rows: list[Row]) -> dict[tuple[str, str], tuple[list[str], list[str]]]:
    """The not-supported rows grouped by reason: (head, why) -> (cases, keywords)."""
    groups: dict[tuple[str, str], tuple[list[str], list[str]]] = {}
    for r in rows:
        if r.status != "not supported":
            continue
        m = _REFUSAL.match(r.detail)
        reason = (m["head"], m["why"] or "") if m else (r.detail, "")
        cases, keywords = groups.setdefault(reason, ([], []))
        cases.append(r.case)
        if m and m["keyword"] not in keywords:
            keywords.append(m["keyword"])
    return groups


# -- hypotheses: the exact answer with one known mistake -------------------------------------

def _exact(q: Tensor, k: Tensor, v: Tensor, kw: dict, *, lse: bool = False):
    return attention(q, k, v, **kw, return_lse=lse, backend="reference")


def _keep(q: Tensor, k: Tensor, kw: dict, *, top_left: bool = False) -> Tensor | None:
    """causal, window and a bool attn_mask as one bool mask (True = attend)."""
    return dense_keep(q.shape[2], k.shape[2], causal=kw.get("causal", False),
                      window=kw.get("window"), attn_mask=kw.get("attn_mask"), top_left=top_left)


def _top_left(q, k, v, kw):
    if not kw.get("causal") or q.shape[2] == k.shape[2]:
        return None
    rest = {n: t for n, t in kw.items() if n not in ("causal", "window", "attn_mask")}
    mask = kw.get("attn_mask")
    if mask is not None and mask.dtype != torch.bool:
        keep = _keep(q, k, {**kw, "attn_mask": None}, top_left=True)
        return _exact(q, k, v, {**rest, "attn_mask": mask.masked_fill(~keep, -math.inf)})
    return _exact(q, k, v, {**rest, "attn_mask": _keep(q, k, kw, top_left=True)})


def _scale(q, kw) -> float:
    return q.shape[-1] ** -0.5 if kw.get("scale") is None else kw["scale"]


def _scores(q: Tensor, k: Tensor, kw: dict) -> Tensor:
    """The scaled scores (B, H, Nq, Nk), k's heads repeated for GQA."""
    return q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) * _scale(q, kw)


def _scale_wrong(twice: bool):  # the scale left out, or applied twice
    def hypothesis(q, k, v, kw):
        s = _scale(q, kw)
        return None if s == 1.0 else _exact(q, k, v, {**kw, "scale": s * s if twice else 1.0})
    return hypothesis


def _gqa_repeat(q, k, v, kw):
    H, Hkv = q.shape[1], k.shape[1]
    if Hkv in (1, H):
        return None
    g = H // Hkv  # head h reads kv head h % Hkv: what k.repeat(1, g, 1, 1) gives
    return _exact(q, k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1), kw)


def _masked_scores(q: Tensor, k: Tensor, kw: dict) -> Tensor:
    """:func:`_scores` with a float attn_mask added and every masked-out key at -inf."""
    s, mask, keep = _scores(q, k, kw), kw.get("attn_mask"), _keep(q, k, kw)
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask
    return s if keep is None else s.masked_fill(~keep, -math.inf)


def _wrong_axis(q, k, v, kw):
    if kw.get("sinks") is not None or kw.get("softcap") is not None:
        return None
    p = torch.softmax(_masked_scores(q, k, kw), dim=-2).nan_to_num(0.0)  # over the queries
    return p @ v.repeat_interleave(q.shape[1] // v.shape[1], 1)


def _transposed(q, k, v, kw):
    if any(isinstance(t, Tensor) for t in kw.values()) or q.shape[1] == 1:
        return None
    try:  # the function took (B, H, N, D) for flash-attn's (B, N, H, D)
        return _exact(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), kw).transpose(1, 2)
    except (ValueError, RuntimeError):
        return None


def _empty_uniform(q, k, v, kw):
    out, lse = _exact(q, k, v, kw, lse=True)
    empty = torch.isinf(lse) & (lse < 0)
    if not empty.any():
        return None
    mean_v = v.repeat_interleave(q.shape[1] // k.shape[1], 1).mean(dim=2, keepdim=True)
    return torch.where(empty[..., None], mean_v, out)


def _mask_inverted(q, k, v, kw):
    mask = kw.get("attn_mask")
    if mask is None or mask.dtype != torch.bool:
        return None  # True read as "masked", as torch.nn.MultiheadAttention's masks mean
    return _exact(q, k, v, {**kw, "attn_mask": ~mask})


def _without(name):
    def hypothesis(q, k, v, kw):
        if kw.get(name) is None or kw.get(name) is False:
            return None
        return _exact(q, k, v, {**kw, name: False if name == "causal" else None})
    return hypothesis


# name → exact output under that mistake (None when the mistake changes nothing here)
HYPOTHESES: dict[str, Callable] = {
    "causal aligned top-left (attn's causal is bottom-right: query i sees key j iff "
    "j <= i + Nk - Nq)": _top_left,
    "scale missing (scores not multiplied by D**-0.5)": _scale_wrong(False),
    "scale applied twice": _scale_wrong(True),
    "GQA heads grouped by repeat (query head h reads kv head h % Hkv) instead of "
    "repeat_interleave (h // (H // Hkv))": _gqa_repeat,
    "softmax over the wrong axis (normalized over queries, not keys)": _wrong_axis,
    "transposed layout (q, k, v read as (B, N, H, D))": _transposed,
    "fully masked rows average V uniformly (a finite mask value such as finfo.min) "
    "instead of returning zeros": _empty_uniform,
    "sinks ignored": _without("sinks"),
    "softcap ignored": _without("softcap"),
    "causal mask missing (causal=True ignored: every query sees every key)": _without("causal"),
    "attn_mask ignored": _without("attn_mask"),
    "bool attn_mask inverted (True read as masked out; attn's True means attend)":
        _mask_inverted,
}


def _fits(got: Tensor, want: Tensor, tol: float, err_ref: float) -> bool:
    if want.shape != got.shape or not torch.isfinite(want).all():
        return False
    err = (got - want).abs().max().item()
    return err <= max(tol, 0.01 * err_ref) and err < err_ref


def _ranges(idx: list[int], n: int) -> str:
    if len(idx) == n:
        return f"all {n}"
    # idx ascends: a run of consecutive indices keeps x - i constant
    runs = [[x for _, x in run] for _, run in groupby(enumerate(idx), lambda p: p[1] - p[0])]
    spans = [str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs]
    return f"{', '.join(spans[:8])}{' ...' if len(spans) > 8 else ''} of {n}"


def where(bad: Tensor) -> str:
    """Which batch rows, heads, query rows and output columns of a (B, H, Nq, Dv) bool
    tensor hold errors."""
    parts = []
    for dim, label in ((0, "batch"), (1, "heads"), (2, "query rows"), (3, "output columns")):
        hit = bad.any(dim=tuple(d for d in range(4) if d != dim))
        parts.append(f"{label} {_ranges(hit.nonzero().flatten().tolist(), bad.shape[dim])}")
    return "; ".join(parts)


def _diagnose_out(got: Tensor, q, k, v, kw, tol: float) -> tuple[list[str], str]:
    exact = _exact(q, k, v, kw)
    finite = torch.isfinite(got)
    names = []
    if not finite.all():
        _, lse = _exact(q, k, v, kw, lse=True)
        empty = (torch.isinf(lse) & (lse < 0))[..., None].expand_as(got)
        rest_ok = ((got - exact).abs() <= tol) | empty
        if (~finite <= empty).all() and bool(rest_ok[finite].all()):
            names.append("fully masked rows give NaN instead of zeros")
        s = _scores(q, k, kw).amax(-1)
        big = (s > math.log(torch.finfo(torch.float32).max))[..., None].expand_as(got)
        if not names and (~finite <= big).all():
            names.append("softmax without max-subtraction (exp overflows where the largest "
                         "score passes 88)")
        bad = ~finite
    else:
        err_ref = (got - exact).abs().max().item()
        for name, hyp in HYPOTHESES.items():
            want = hyp(q, k, v, kw)
            if want is not None and _fits(got, want, tol, err_ref):
                names.append(name)
        bad = (got - exact).abs() > tol
    return names, ("" if names else where(bad))


def _lse_fits(got: Tensor, want: Tensor | None, empty: Tensor, tol: float) -> bool:
    """``got`` is ``want`` on every row with a key (no row of ``want`` is judged elsewhere)."""
    return (want is not None and want.shape == got.shape and not empty.all()
            and torch.equal(torch.isinf(got) & empty, empty)
            and (got[~empty] - want[~empty]).abs().max().item() <= tol)


def _row_max(q, k, kw) -> Tensor | None:
    """max_j of each row's scores (the online softmax's m_i), -inf on rows without a key;
    None where a variant (softcap, a float mask, sinks, ALiBi, temperature) changes them."""
    if any(kw.get(n) is not None for n in ("softcap", "sinks", "alibi_slopes", "score_mod",
                                            "mask_mod")) or kw.get("temperature", 1.0) != 1.0:
        return None
    mask = kw.get("attn_mask")
    if mask is not None and mask.dtype != torch.bool:
        return None
    return _masked_scores(q, k, kw).amax(-1)  # (B, H, Nq)


def _diagnose_lse(got: Tensor, q, k, v, kw, tol: float) -> list[str]:
    _, exact = _exact(q, k, v, kw, lse=True)
    empty = torch.isinf(exact)
    names = []
    if _lse_fits(got, exact / math.log(2), empty, tol / math.log(2)):
        names.append("lse in base 2 (log2 instead of the natural log)")
    m_i = _row_max(q, k, kw)
    if m_i is not None and _lse_fits(got, exact - m_i, empty, tol):
        names.append("lse of the scores scaled down by their row max (log l_i without m_i "
                     "added back: lse = m_i + log l_i)")
    if _scale(q, kw) != 1.0 and _lse_fits(got, _exact(q, k, v, {**kw, "scale": 1.0},
                                                       lse=True)[1], empty, tol):
        names.append("lse of the unscaled scores (q·k before the scale; the output uses the "
                     "scaled ones)")
    if empty.any() and (got[empty] == math.inf).all() and (
            got[~empty] - exact[~empty]).abs().max().item() <= tol:
        names.append("lse +inf on rows with no key (flash-attn's convention; attn's is -inf)")
    return names


def _short(e: BaseException, name: str = "") -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if name and msg.startswith(name + " "):  # the adapter's refusals open with the target's name
        msg = msg[len(name) + 1:]
    return f"raised {type(e).__name__}" + (f": {msg[:200]}" if msg else "")


def run_case(fn: Adapted | Callable, case: Case, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> Row:
    """One row: run ``case`` on ``fn`` (attn's convention), judge it, diagnose it."""
    q, k, v, kw = case.inputs(dtype, device)
    _short_ = partial(_short, name=getattr(fn, "name", ""))

    def refused(e: Exception) -> Row:  # the function could not express the case, or crashed
        return Row(case.name, "not supported" if isinstance(e, _UNSUPPORTED) else "error",
                   _short_(e))

    if kw.get("dropout_p"):
        try:
            problem = check_dropout(fn, q, k, v, **kw)
        except Exception as e:  # noqa: BLE001 - the user's function may raise anything
            return refused(e)
        if problem is None:
            return Row(case.name, "correct")
        return Row(case.name, "NaN" if "NaN" in problem else "wrong", problem,
                   [DROPOUT_UNSCALED] if problem.startswith(DROPOUT_UNSCALED) else [])

    try:
        with torch.no_grad():
            res = fn(q, k, v, **kw, **({"return_lse": True} if case.lse else {}))
    except Exception as e:  # noqa: BLE001
        return refused(e)
    got, got_lse = (res[0], res[1]) if isinstance(res, (tuple, list)) else (res, None)
    B, H, Nq, Dv = q.shape[0], q.shape[1], q.shape[2], v.shape[-1]
    if not isinstance(got, Tensor) or tuple(got.shape) != (B, H, Nq, Dv):
        shape = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
        row = Row(case.name, "wrong", f"out has shape {shape}, expected (B, H, Nq, Dv) = "
                                      f"{(B, H, Nq, Dv)}")
        if shape == (B, Nq, H, Dv) and Nq != H:
            row.diagnosis.append("transposed layout: out came back (B, N, H, D); give "
                                 "--layout bnhd")
        return row

    q64, k64, v64 = (t.to(torch.float64) for t in (q, k, v))
    kw64 = {n: (t.detach().to(torch.float64) if isinstance(t, Tensor) and t.is_floating_point()
                else t) for n, t in kw.items()}
    try:
        report = compare_to_reference(fn, q, k, v, grad=case.grad, check_lse=case.lse, **kw)
    except AssertionError as e:
        return Row(case.name, "wrong", _short_(e))
    except Exception as e:  # noqa: BLE001
        if case.grad and isinstance(e, RuntimeError) and not isinstance(e, _UNSUPPORTED):
            # no autograd graph, or a backward that refuses
            return Row(case.name, "not supported", "gradients: " + _short_(e))
        return refused(e)
    if report.ok:
        return Row(case.name, "correct")

    over = [c for c in report.comparisons if not c.ok]
    detail = ", ".join(f"{c.name} error {c.error:.2e} > budget {c.budget:.2e}" for c in over)
    got64 = got.detach().to(torch.float64)
    nan = not torch.isfinite(got64).all()
    row = Row(case.name, "NaN" if nan else "wrong", detail)
    out_cmp = report["out"]
    if nan or not out_cmp.ok:
        row.diagnosis, row.where = _diagnose_out(got64, q64, k64, v64, kw64, out_cmp.budget)
    elif "lse" in [c.name for c in over] and got_lse is not None:
        row.diagnosis = _diagnose_lse(got_lse.detach().to(torch.float64), q64, k64, v64, kw64,
                                      report["lse"].budget)
    else:
        row.where = "the gradients only (the output is correct): " + ", ".join(
            c.name for c in over)
    return row


def check(target: str | Callable, *, style: str = "auto", layout: str | None = None,
          dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
          cases: list[Case] | None = None, name: str | None = None) -> CheckResult:
    """Run the conformance matrix on ``target`` (``"pkg.mod:fn"``, ``"file.py:fn"`` or a
    callable in any style :func:`attn.adapters.adapt` knows)."""
    if isinstance(target, str):
        name = name or target
        target = load_target(target)
    fn = adapt(target, style=style, layout=layout, name=name)
    rows = []
    for case in cases if cases is not None else conformance_cases():
        try:
            rows.append(run_case(fn, case, dtype, device))
        except Exception as e:  # noqa: BLE001 - a bug here must not hide the other rows
            rows.append(Row(case.name, "error", "attn check itself failed: " + _short(e)
                            + "\n" + traceback.format_exc(limit=3)))
    return CheckResult(fn.name, fn.style, fn.layout, fn.detected, dtype_name(dtype),
                       str(device), rows)


def comparison_markdown(results: list[CheckResult]) -> str:
    """One markdown table, a row per case and a column per target."""
    head = "| case | " + " | ".join(f"`{r.target}`" for r in results) + " |"
    lines = [head, "|" + "---|" * (len(results) + 1)]
    for i, row in enumerate(results[0].rows):
        cells = ("✓" if r.rows[i].status == "correct" else r.rows[i].text() for r in results)
        lines.append(f"| {row.case} | " + " | ".join(
            c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)


# -- built-in targets for the comparison table (docs/conformance.md) ---------------------------

reference = partial(attention, backend="reference")
tiled = partial(attention, backend="tiled")
triton = partial(attention, backend="triton")


def flex_eager(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
               window: tuple[int, int] | None = None, attn_mask: Tensor | None = None,
               scale: float | None = None, softcap: float | None = None,
               return_lse: bool = False):
    """torch's ``flex_attention``, not compiled, with attn's keywords expressed as its
    ``score_mod`` and block mask: causal and window bottom-right, a bool ``attn_mask`` in the
    mask, a float one and ``softcap`` in the score. No sinks, no dropout."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, n_q, n_k = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    keep = dense_keep(n_q, n_k, causal=causal, window=window, attn_mask=attn_mask,
                      device=q.device)
    bias = None
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        bias = attn_mask.expand(B, H, n_q, n_k)
    block_mask = None
    if keep is not None:
        dense = keep.expand(B, H, n_q, n_k)
        block_mask = create_block_mask(lambda b, h, i, j: dense[b, h, i, j], B, H, n_q, n_k,
                                       device=str(q.device))

    def score_mod(s, b, h, i, j):
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if bias is not None:
            s = s + bias[b, h, i, j]
        return s

    mod = score_mod if (softcap is not None or bias is not None) else None
    return flex_attention(q, k, v, score_mod=mod, block_mask=block_mask, scale=scale,
                          enable_gqa=q.shape[1] != k.shape[1], return_lse=return_lse)
