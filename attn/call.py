"""The one place a call is checked, resolved and dispatched: input checks shared by every
entry point, ``AttentionCall`` (a call without tensors), ``select_backend``,
:func:`resolve` (a call's arguments → its ``AttentionCall``, ``LaunchSpec`` and ``Operands``)
and :func:`run` (one backend on a resolved call), and the rules every entry point follows
(accumulation dtype, dropout seed). How an entry point uses them: docs/design.md, "A call's
path".
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from attn import choose, fused, mods, tiled, transforms
from attn.masks import Band, as_4d, simplify_mask
from attn.reference import reference_attention, reference_packed
from attn.sdpa import sdpa_attention
from attn.spec import LaunchSpec, Operands, ScoreTerms, acc_dtype


BACKENDS = ("auto", "reference", "tiled", "fused", "triton", "sdpa")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class AttentionCall:
    """What a backend needs to know to say whether it can run a call (no tensors inside)."""

    device: str  # "cpu", "cuda", ...
    dtype: torch.dtype
    head_dim: int
    head_dim_v: int
    n_q: int
    n_k: int
    band: Band = Band()
    mask: str | None = None  # None, "bool" or "float"
    mask_grad: bool = False  # a float attn_mask that requires grad
    # the mask is key padding only ((B or 1, 1, 1, Nk) bool, each row's kept keys one run):
    # a cut of the keys rather than a mask for the fused backend (attn.choose's classes)
    mask_padding: bool = False
    softcap: str | None = None  # None, "fixed" or "learned"
    sinks: bool = False
    temperature_tensor: bool = False
    dropout: bool = False
    return_lse: bool = False
    score_mod: bool = False  # a FlexAttention score_mod (attn.flex)
    mask_mod: bool = False  # a mask_mod or block mask (attn.flex)
    varlen: bool = False  # packed sequences (attn.varlen; n_q / n_k are the longest ones)
    alibi: bool = False  # ALiBi slopes
    terms: tuple[str, ...] = ()  # the static score variants' terms (spec.ScoreTerms' names)
    grad: bool = False  # grad mode on and an input requires grad (split-KV is forward-only)
    # the torch.func transforms / forward-mode AD the call runs under (attn.transforms.active)
    transform: str | None = None


@dataclass(frozen=True)
class BackendChoice:
    name: str
    reason: str  # why this backend, and why not the preferred one when it fell back


def _mods_unsupported(call: AttentionCall, native_varlen: bool = False) -> str | None:
    if call.score_mod or call.mask_mod:
        return ("score_mod / mask_mod / block masks (run by the tiled backend, which applies "
                "them per tile)")
    if call.varlen and not native_varlen:
        return "packed varlen sequences (tiled and triton run them)"
    return None


def _sdpa_unsupported(call: AttentionCall) -> str | None:
    if call.terms:
        return f"the score term(s) {list(call.terms)} (torch's SDPA has no score step)"
    if call.softcap is not None:
        return "softcap (torch's SDPA has no score transform)"
    if call.sinks:
        return "sinks (torch's SDPA has no extra softmax denominator term)"
    if call.alibi:
        return ("alibi_slopes (torch's SDPA would need the (Nq, Nk) bias materialized as a "
                "float mask)")
    if call.return_lse:
        return "return_lse (torch's SDPA does not return the log-sum-exp)"
    if call.dropout:
        return ("dropout (torch's SDPA draws its own mask from its own generator; attn's "
                "hash-based mask, shared by the other backends, cannot be passed to it)")
    if call.dtype == torch.float64 and call.device != "cpu":
        return "float64 off the CPU"
    return None


def _transform_unsupported(call: AttentionCall) -> str | None:
    """Why fused does not run a transformed call: its autograd.Function has no vmap or
    forward-mode rule (triton's has both: :func:`_triton_transform_unsupported`)."""
    if call.transform is None:
        return None
    return (f"torch.func transforms and forward-mode AD ({call.transform}): backend='tiled' "
            f"and backend='reference' run vmap, grad, jvp and their compositions "
            f"(backend='triton' too, on CUDA)")


def _triton_transform_unsupported(call: AttentionCall) -> str | None:
    """What of a transformed call triton cannot differentiate: its forward-mode kernel's
    tangents differentiated again (a grad level outside a jvp level), a backward
    differentiated again (a grad level inside another level) where its hand-off to tiled's
    backward cannot serve (a learnable softcap, packed sequences), packed calls under vmap."""
    if call.transform is None:
        return None
    names = call.transform.split("+")  # outermost first, dual tensors ("forward AD") last
    modes = [n for n in names if n in ("grad", "jvp", "forward AD")]
    fwd = [i for i, n in enumerate(modes) if n != "grad"]
    if fwd and "grad" in modes[:fwd[-1]]:
        return (f"reverse mode over forward mode ({call.transform}): its forward-mode "
                f"kernel's tangents are not differentiable again; backend='tiled' and "
                f"backend='reference' differentiate them")
    if "grad" in modes[1:] and (call.softcap == "learned" or call.varlen):
        what = "a learnable softcap" if call.softcap == "learned" else "packed sequences"
        return (f"a differentiated backward ({call.transform}) of {what}: backend='tiled' "
                f"and backend='reference' differentiate their gradients")
    if call.varlen and "vmap" in names:
        return (f"packed sequences under torch.func.vmap ({call.transform}): "
                f"backend='tiled' and backend='reference' run them")
    return None


def unsupported_reason(backend: str, call: AttentionCall) -> str | None:
    """Why ``backend`` cannot compute ``call`` exactly, or None when it can."""
    if backend in ("reference", "tiled"):
        return None
    if backend == "sdpa":
        return _mods_unsupported(call) or _sdpa_unsupported(call)
    if backend == "triton":
        why = _mods_unsupported(call, native_varlen=True) or _triton_transform_unsupported(call)
        if why is not None:
            return why
        try:
            from attn import flash_triton
        except ImportError as exc:  # triton missing, or the module not built on this platform
            return (f"triton is not importable ({exc}); install the extra: "
                    f"pip install 'attn[triton]'")
        return flash_triton.unsupported_reason(call)
    if backend == "fused":
        return _transform_unsupported(call) or fused.call_reason(call)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def select_backend(call: AttentionCall, requested: str = "auto") -> BackendChoice:
    """The backend that runs ``call``: pure, cheap, and it explains itself. An explicit
    request that cannot compute the call raises NotImplementedError. What ``auto`` takes on
    and off CUDA: docs/design.md, "Choosing a backend"; inside triton, decoding calls take
    split-KV (docs/gpu.md, "Split-KV decoding"), and the reason says which path runs.
    """
    if not isinstance(call, AttentionCall):
        raise TypeError(f"call must be an AttentionCall (attn.api.AttentionCall), got "
                        f"{type(call).__name__}")
    if not isinstance(requested, str):
        raise TypeError(f"backend must be a str, one of {BACKENDS}, got "
                        f"{type(requested).__name__}")
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if requested != "auto":
        why = unsupported_reason(requested, call)
        if why is not None:
            raise NotImplementedError(
                f"backend={requested!r} cannot compute this call: {why}. "
                f"backend='tiled' and backend='reference' support every variant.")
        if requested == "tiled":
            return BackendChoice("tiled", f"requested explicitly; {_tiled_reason(call)}")
        return BackendChoice(requested, "requested explicitly")
    if call.device != "cuda":
        return _auto_off_cuda(call)
    op = None
    if not torch.compiler.is_compiling() and unsupported_reason("fused", call) is None:
        op = fused.cuda_verified(call)
    if op is not None:
        return BackendChoice("fused", f"auto: fused on CUDA, torch's {op} kernel per block "
                                      f"(verified exact for this torch, GPU, dtype and head "
                                      f"dim in attn/fused_cuda_table.json)")
    why = unsupported_reason("triton", call)
    if why is None:
        from attn import flash_triton  # importable: unsupported_reason just imported it
        under = ("" if call.transform is None else
                 f"under {call.transform} (fused has no rule for it; triton's autograd "
                 f"Function has vmap and forward-mode rules), ")
        return BackendChoice("triton", f"auto: triton on CUDA, {under}"
                                       f"{flash_triton.split_kv_reason(call)}")
    return BackendChoice("tiled", f"auto: tiled, because triton cannot: {why}; "
                                  f"{_tiled_reason(call)}")


def _auto_off_cuda(call: AttentionCall) -> BackendChoice:
    """``auto`` off CUDA: fused where it can compute the call and the committed table
    (:mod:`attn.choose`) prefers it for this kind of CPU, the call's dtype and class; else
    tiled."""
    # asked first: fused's own checks read torch's private ops, which dynamo cannot trace
    why = ("traced by torch.compile (fused runs eager items)"
           if torch.compiler.is_compiling() else unsupported_reason("fused", call))
    if why is not None:
        return BackendChoice("tiled", f"auto: tiled, because fused cannot: {why}; "
                                      f"{_tiled_reason(call)}")
    cls = choose.call_class(call.n_q, call.n_k, call.grad,
                            call.mask is not None and not call.mask_padding)
    name, because = choose.preferred(choose.cpu_kind(), call.dtype, cls)
    if name == "fused" and cls in ("tiny", "small") and fused.cut_per_sequence(call):
        name, because = "tiled", (f"a {cls} call fused would cut into items per sequence, "
                                  f"where the table's cell measured one op call: {because}")
    if name == "fused":
        return BackendChoice("fused", f"auto: fused, torch's CPU kernel per block ({because})")
    return BackendChoice("tiled", f"auto: tiled ({because}); {_tiled_reason(call)}")


def _tiled_reason(call: AttentionCall) -> str:
    """The tiled path a call will take: steps and GEMM engine, and how the call is cut."""
    split = not (call.mask_mod or call.varlen)
    return (f"{tiled.steps_path_reason(call.device)}; "
            f"{tiled.cpu_path_reason(call.device, call.n_q, call.n_k, split_allowed=split)}")


# -- validation --------------------------------------------------------------------------------

class SdpaInputError(ValueError, RuntimeError):
    """Bad input to the drop-in :func:`attn.scaled_dot_product_attention`: a ValueError
    (attn's convention) and a RuntimeError (what torch's function raises, and what code
    written for it catches). Every input error of the drop-in is one."""


class SdpaTypeError(SdpaInputError, TypeError):
    """A wrong type or dtype given to the drop-in: an :class:`SdpaInputError` that is also
    the TypeError attn's own functions raise for it."""


@contextlib.contextmanager
def sdpa_errors() -> Iterator[None]:
    """The drop-in's contract for errors: attn's ValueErrors (and TypeErrors) raised by the
    checks below, as :class:`SdpaInputError` (:class:`SdpaTypeError`), message unchanged."""
    try:
        yield
    except SdpaInputError:
        raise
    except TypeError as exc:
        raise SdpaTypeError(str(exc)) from exc
    except ValueError as exc:
        raise SdpaInputError(str(exc)) from exc


def _check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_float_qkv(names: tuple[str, str, str], tensors: tuple[object, object, object],
                     dims: int, layout: str) -> None:
    """Each of q, k, v (``names``: the caller's) a floating tensor of ``dims`` dims (``layout``
    names them in the message), the three in one dtype on one device."""
    for name, t in zip(names, tensors):
        _check_tensor(name, t)
        if t.dim() != dims:
            raise ValueError(f"{name} must have {dims} dims {layout}, got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    (nq, nk, nv), (q, k, v) = names, tensors
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{nq}, {nk}, {nv} must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{nq}, {nk}, {nv} must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}")


def _validate_qkv(q: Tensor, k: Tensor, v: Tensor, names: tuple[str, str, str] = ("q", "k", "v"),
                  layout: str = "(B, H, N, D)", *, allow_empty: bool = False,
                  shown: tuple[Tensor, Tensor, Tensor] | None = None) -> None:
    """Rank, dtype, device and shape agreement of q, k, v (4-d, heads before positions).

    ``names``: what the caller called the three tensors (``query``/``key``/``value``,
    ``k_cache``, ...), so a message names the argument the user passed; ``layout``: the
    caller's layout, for the rank message; ``shown``: the caller's own tensors when q, k, v
    are views of them in another shape (the drop-in's flattened batch dims), for the shapes
    in messages. ``allow_empty``: the batch and the lengths may be 0 (the sizes data gives);
    heads and head dims (the sizes a model fixes) never may."""
    nq, nk, nv = names
    _check_float_qkv(names, (q, k, v), 4, layout)
    sq, sk, sv = (tuple(t.shape) for t in (shown or (q, k, v)))
    shapes = f"{nq} {sq}, {nk} {sk}, {nv} {sv}"
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: {shapes}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{nq} and {nk} head dims differ: {shapes}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"{nk} and {nv} must agree in heads and length: {shapes}")
    if q.shape[1] == 0 or k.shape[1] == 0:
        raise ValueError(f"{nq} and {nk} need at least one head each: {shapes}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{nq} heads must be a multiple of kv heads ({nk}'s, GQA), got "
                         f"H={q.shape[1]}, Hkv={k.shape[1]}: {shapes}")
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        raise ValueError(f"{nq}, {nk}, {nv} need a head dim of at least 1: {shapes}")
    if not allow_empty and (0 in q.shape or 0 in k.shape):
        raise ValueError(f"{nq}, {nk}, {nv} must not be empty: {shapes}")


def _validate_mask(attn_mask: Tensor, q: Tensor, shape: tuple[int, ...], q_name: str = "q"
                   ) -> None:
    _check_tensor("attn_mask", attn_mask)
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool (True = attend) or floating (added to the "
                        f"scores), got {attn_mask.dtype}")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device}, {q_name} on {q.device}")
    if not broadcasts_to(attn_mask.shape, shape):
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                         f"(B, H, Nq, Nk) = {shape}")


def broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to exactly ``target`` (no more dims)."""
    try:
        return len(shape) <= len(target) and torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def _validate_sinks(sinks: object, H: int, q: Tensor) -> None:
    _check_tensor("sinks", sinks)
    if sinks.shape != (H,):
        raise ValueError(f"sinks must have shape (H,) = ({H},), got {tuple(sinks.shape)}")
    if not sinks.is_floating_point() or sinks.device != q.device:
        raise TypeError(f"sinks must be a floating tensor on {q.device}, got {sinks.dtype} "
                        f"on {sinks.device}")


def _validate_alibi(slopes: object, lead: int, lead_name: str, H: int, q: Tensor) -> Tensor:
    """ALiBi slopes ``(H,)`` or ``(lead, H)`` → ``(lead, H)`` (a view): floating, on q's
    device, and constants (no gradient flows to them, as in flash-attn)."""
    _check_tensor("alibi_slopes", slopes)
    if slopes.shape not in ((H,), (lead, H)):
        raise ValueError(f"alibi_slopes must have shape (H,) = ({H},) or ({lead_name}, H) = "
                         f"({lead}, {H}), got {tuple(slopes.shape)}")
    if not slopes.is_floating_point():
        raise TypeError(f"alibi_slopes must be floating (float32 recommended), got "
                        f"{slopes.dtype}")
    if slopes.device != q.device:
        raise ValueError(f"alibi_slopes is on {slopes.device}, q on {q.device}")
    if slopes.requires_grad:
        raise ValueError("alibi_slopes requires grad, but no gradient flows to the slopes "
                         "(they are constants, as in flash-attn): pass alibi_slopes.detach()")
    return slopes.expand(lead, H)


def _validate_dropout(dropout_p: object) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) \
            or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def _positive(name: str, x: float | Tensor, shape_ok: tuple[int, ...], q: Tensor,
              q_name: str = "q") -> float | Tensor:
    """A positive finite float, or a floating tensor of positive finite values that
    broadcasts to ``shape_ok``."""
    if isinstance(x, Tensor):
        if not x.is_floating_point():
            raise TypeError(f"{name} tensor must be floating, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, {q_name} on {q.device}")
        if not broadcasts_to(x.shape, shape_ok):
            raise ValueError(f"{name} of shape {tuple(x.shape)} does not broadcast to {shape_ok}")
        # a data-dependent check (one host sync per call): skipped while torch.compile traces,
        # so that it does not break the graph. Written as "not (finite and > 0)" because NaN
        # fails every comparison and would pass "x <= 0".
        # Under vmap the values of every sample are checked at once (transforms.physical).
        if not torch.compiler.is_compiling():
            xv = transforms.physical(x)
            bad = ~(torch.isfinite(xv) & (xv > 0))
            if bool(bad.any()):
                at = tuple(bad.nonzero()[0].tolist())
                raise ValueError(f"{name} must be positive and finite, got {xv[at].item()} at "
                                 f"index {at} of {name} {tuple(xv.shape)}")
        return x
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a float or a tensor, got {type(x).__name__}")
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be positive and finite, got {x}")
    return float(x)


def _check_mods(score_mod, mask_mod, q: Tensor) -> None:
    """Callables, and a mask_mod that returns bool: one probe on a single (0, 0, 0, 0)
    element so a wrong dtype fails before any backend runs (the codebase's rule: TypeError)."""
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be callable, got {type(score_mod).__name__}")
    if mask_mod is not None:
        if not callable(mask_mod):
            raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
        zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=q.device)
        mods.checked_keep(mask_mod(zero, zero, zero, zero))


def _draw_seed(dropout_p: float) -> int:
    if dropout_p == 0.0:
        return 0
    # from torch's default generator, so torch.manual_seed makes dropout reproducible
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def _check_positive_int_or_none(name: str, b: object) -> None:
    if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
        raise ValueError(f"{name} must be a positive int or None, got {b!r}")


def _check_scale(scale: object, D: int) -> float:
    """The public ``scale``: a finite float, or None for ``D ** -0.5``."""
    if scale is None:
        return D ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float or None, got {scale!r}")
    return float(scale)


def resolve(q: Tensor, k: Tensor, v: Tensor, *, band: Band, attn_mask: Tensor | None = None,
            scale: float | None = None, temperature: float | Tensor = 1.0,
            softcap: float | Tensor | None = None, sinks: Tensor | None = None,
            dropout_p: float = 0.0, dropout_seed: int | None = None, return_lse: bool = False,
            block_m: int | None = None, block_n: int | None = None, score_mod=None,
            mask_mod=None, mask_blocks=None, dropout_rows=None,
            alibi_slopes: Tensor | None = None, alibi_rows=None,
            cu_seqlens: tuple[Tensor, Tensor] | None = None,
            max_seqlen: tuple[int, int] | None = None, terms: ScoreTerms = ScoreTerms(),
            q_name: str = "q") -> tuple[AttentionCall, LaunchSpec, Operands]:
    """Check a call's options and turn them into what a backend runs.

    q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv), already checked by the entry
    point in its own layout; ``band`` in its convention (bottom-right, top-left, global or
    per packed sequence). Where each option lands: the field comments of :class:`LaunchSpec`
    and :class:`Operands`; a bool or float mask that is only a band plus key padding becomes
    a band and a smaller mask (eager only). ``dropout_seed``:
    None draws it from torch's generator (:func:`_draw_seed`), as ``attention`` does.
    ``cu_seqlens`` / ``max_seqlen``: packed sequences laid out as one batch row (1, H, total,
    D); ``alibi_slopes`` are then (sequences, H), checked by the caller. ``score_mod`` /
    ``mask_mod`` / ``mask_blocks``: see :func:`attn.mods.mod_spec` (run() classifies them
    for the tiled backend). ``terms``: the static score variants' constants, checked by the
    entry point that takes their keywords. ``q_name``: the caller's name for q, for messages.

    Long on purpose: every option's check and its folding into the spec sit in one readable
    sequence, the one place a call's options meet (split, each part would take them all)."""
    B, H, Nq, D = q.shape
    Nk, Dv = k.shape[2], v.shape[3]
    _check_positive_int_or_none("block_m", block_m)
    _check_positive_int_or_none("block_n", block_n)
    empty = Nk == 0 or B == 0 or Nq == 0
    _check_mods(score_mod, mask_mod, q)
    if attn_mask is not None:
        _validate_mask(attn_mask, q, (B, H, Nq, Nk), q_name)
    # the mask's values read on the host (data-dependent): eager only, not vmap's batched masks
    read_mask = (attn_mask is not None and not empty and not torch.compiler.is_compiling()
                 and not transforms.in_vmap())
    if read_mask:
        simpler = simplify_mask(attn_mask, band)
        if simpler is not None:  # causal/band + key padding: no N x N reads per tile
            band, attn_mask = simpler
    scale = _check_scale(scale, D)
    temperature = _positive("temperature", temperature, (B, H), q, q_name)
    if softcap is not None:
        softcap = _positive("softcap", softcap, (H,), q, q_name)
    if sinks is not None:
        _validate_sinks(sinks, H, q)
    dropout_p = _validate_dropout(dropout_p)
    if alibi_slopes is not None and alibi_rows is None and cu_seqlens is None:
        alibi_slopes = _validate_alibi(alibi_slopes, B, "B", H, q)

    q_scale = None
    if isinstance(temperature, Tensor):
        q_scale = (scale / temperature.to(acc_dtype(q.dtype))).expand(B, H)[..., None, None]
        qk_scale = 1.0
    else:
        qk_scale = scale / temperature
    cap_t = softcap if isinstance(softcap, Tensor) else None
    n_q, n_k = (Nq, Nk) if max_seqlen is None else max_seqlen
    call = AttentionCall(
        device=q.device.type, dtype=q.dtype, head_dim=D, head_dim_v=Dv, n_q=n_q, n_k=n_k,
        band=band,
        mask=None if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "float"),
        mask_grad=attn_mask is not None and attn_mask.requires_grad,
        mask_padding=(read_mask and attn_mask is not None
                      and fused.key_spans(as_4d(attn_mask), B, Nk) is not None),
        softcap=None if softcap is None else ("learned" if cap_t is not None else "fixed"),
        sinks=sinks is not None, temperature_tensor=q_scale is not None,
        dropout=dropout_p > 0.0, return_lse=bool(return_lse),
        score_mod=score_mod is not None,
        mask_mod=mask_mod is not None or mask_blocks is not None,
        varlen=cu_seqlens is not None, alibi=alibi_slopes is not None, terms=terms.names(),
        grad=torch.is_grad_enabled() and any(
            isinstance(t, Tensor) and t.requires_grad
            for t in (q, k, v, attn_mask, temperature, softcap, sinks)),
        transform=transforms.active(q, k, v, attn_mask, temperature, softcap, sinks,
                                    alibi_slopes))
    if dropout_seed is None:
        dropout_seed = 0 if empty else _draw_seed(dropout_p)
    max_q, max_k = (None, None) if max_seqlen is None else max_seqlen
    spec = LaunchSpec(qk_scale=float(qk_scale), band=band,
                      softcap=None if cap_t is not None else softcap, terms=terms,
                      dropout_p=dropout_p, dropout_seed=int(dropout_seed),
                      block_m=block_m, block_n=block_n, score_mod=score_mod,
                      mask_mod=mask_mod, mask_blocks=mask_blocks, dropout_rows=dropout_rows,
                      alibi_rows=alibi_rows, max_seqlen_q=max_q, max_seqlen_k=max_k)
    cu_q, cu_k = (None, None) if cu_seqlens is None else cu_seqlens
    ops = Operands(attn_mask=attn_mask, sinks=sinks, softcap=cap_t, alibi=alibi_slopes,
                   cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, q_scale=q_scale)
    return call, spec, ops


def _no_keys(q: Tensor, k: Tensor, v: Tensor, *, sinks: Tensor | None, linked: tuple
             ) -> tuple[Tensor, Tensor]:
    """The answer of a call with no key (Nk = 0) or an empty output: zeros, and lse = -inf
    (or the sink) for every row, as for a row that a mask hides from every key.

    Gradients are those of that definition: zeros for q, k, v and every tensor in
    ``linked`` (temperature, softcap, a float mask, a score_mod's captures), the sinks'
    through the lse. The zeros are tied to the inputs through sums over empty slices, which
    are 0 with a zero gradient whatever the values (no 0 * NaN)."""
    B, H, Nq, _ = q.shape
    acc = acc_dtype(q.dtype)
    tie = torch.zeros((), dtype=acc, device=q.device)
    for t in (q, k, v) + linked:
        if isinstance(t, Tensor) and t.requires_grad:
            tie = tie + t.reshape(-1)[:0].sum().to(acc)
    out = torch.zeros(B, H, Nq, v.shape[-1], dtype=acc, device=q.device) + tie
    lse = (torch.full((B, H, Nq), float("-inf"), dtype=acc, device=q.device) if sinks is None
           else sinks.to(acc).view(1, H, 1).expand(B, H, Nq))
    return out.to(v.dtype), lse + tie


def run(backend: str, q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec, ops: Operands
        ) -> tuple[Tensor, Tensor | None]:
    """One backend on a resolved call → ``(out in v's dtype, lse)`` (lse None on sdpa).

    No key (Nk = 0) or an empty output (B or Nq = 0): :func:`_no_keys`, the same on every
    backend. Packed sequences (``ops.cu_seqlens_q``) come laid out as one batch row
    (1, H, total, D); triton and the reference run them as such, the tiled backend takes
    them as a document mask from the entry point (attn.varlen) instead."""
    packed = ops.cu_seqlens_q is not None
    if not packed and (k.shape[2] == 0 or q.shape[0] == 0 or q.shape[2] == 0):
        linked = (ops.q_scale, ops.softcap, ops.attn_mask)
        if spec.score_mod is not None and torch.is_grad_enabled():
            linked += mods.captured_tensors(spec.score_mod)
        return _no_keys(q, k, v, sinks=ops.sinks, linked=linked)
    if backend == "reference":
        # the keywords a packed and a dense reference call share; the scale in plain PyTorch
        # in q's dtype, like the rest of the reference
        shared = dict(band=spec.band, sinks=ops.sinks, alibi_slopes=ops.alibi,
                      scale=spec.qk_scale if ops.q_scale is None else ops.q_scale.to(q.dtype),
                      softcap=ops.softcap if ops.softcap is not None else spec.softcap,
                      dropout_p=spec.dropout_p, dropout_seed=spec.dropout_seed,
                      **dict(spec.terms.items))
        if packed:
            return reference_packed(q, k, v, ops.cu_seqlens_q, ops.cu_seqlens_k, **shared)
        return reference_attention(q, k, v, attn_mask=ops.attn_mask, score_mod=spec.score_mod,
                                   mask_mod=spec.mask_mod, dropout_rows=spec.dropout_rows,
                                   alibi_rows=spec.alibi_rows, **shared)
    if backend == "sdpa":
        return sdpa_attention(q, k, v, band=spec.band, attn_mask=ops.attn_mask,
                              scale=spec.qk_scale if ops.q_scale is None else ops.q_scale)
    if ops.q_scale is not None:
        # a tensor temperature folded into q in the accumulation dtype: the kernels see a
        # plain q, autograd handles τ
        acc = acc_dtype(q.dtype)
        q, ops = q.to(acc) * ops.q_scale.to(acc), ops._replace(q_scale=None)
        if backend == "fused":  # torch's kernel takes q, k, v in one dtype: rounded once
            q = q.to(k.dtype)
    if backend == "fused":  # a sequence with a masked non-finite key runs on tiled (which
        # never reads a masked key's score), its backward through _precise_backward; the
        # others keep fused's bits
        out, lse = fused.fused_attention(q, k, v, spec, ops, precise=_precise_backward,
                                         second=tiled.double_backward, fallback=tiled._fwd)
    elif backend == "tiled":
        if spec.score_mod is not None or spec.mask_mod is not None or spec.mask_blocks is not None:
            spec, captured = mods.mod_spec(spec, q, k, spec.score_mod, spec.mask_mod,
                                           spec.mask_blocks)
            ops = ops._replace(captured=captured)
        out, lse = tiled.tiled_attention(q, k, v, spec, ops)
    else:
        from attn.flash_triton import triton_attention
        if packed:  # (1, H, total, D) -> the packed (total, H, D): views, no copy
            q3, k3, v3 = (t[0].transpose(0, 1) for t in (q, k, v))
            out, lse = triton_attention(q3, k3, v3, spec, ops)  # no double backward
            out, lse = out.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0)
        else:
            out, lse = triton_attention(q, k, v, spec, ops, second=tiled.double_backward)
    return out.to(v.dtype), lse


def _precise_backward(do, dlse, q, k, v, spec, ops):
    """The fused backend's backward where its lse is too large for torch's backward op to
    rebuild the probabilities within budget: tiled's forward again (its row max and
    denominator kept apart) and tiled's backward from them."""
    out, lse, lse2 = tiled._fwd(q, k, v, spec, ops, want_lse2=True)
    return tiled._bwd(do, dlse, q, k, v, out, lse, spec, ops, lse2=lse2)


def attend(q: Tensor, k: Tensor, v: Tensor, *, backend: str, return_lse: bool, **options):
    """:func:`resolve`, :func:`select_backend`, :func:`run`: the whole of a dense entry point
    once its conventions are settled into a Band (``options``: :func:`resolve`'s)."""
    call, spec, ops = resolve(q, k, v, return_lse=return_lse, **options)
    choice = select_backend(call, backend)  # refuses what the backend asked for cannot do
    out, lse = run(choice.name, q, k, v, spec, ops)
    return (out, lse) if return_lse else out
