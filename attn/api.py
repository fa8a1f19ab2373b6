"""Public entry points: validation, then one backend.

``attention`` is attn's own signature (bottom-right causal, every variant);
``scaled_dot_product_attention`` mirrors ``torch.nn.functional.scaled_dot_product_attention``
argument for argument so existing code switches by changing one import.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from attn import mods
# the checks and the backend choice live in attn.call; their names stay importable from here
from attn.call import (BACKENDS, _FLOAT_DTYPES, AttentionCall, BackendChoice, _check_mods,
                       _check_tensor, _draw_seed, _positive, _validate_alibi, _validate_dropout,
                       _validate_mask, _validate_qkv, _validate_sinks, acc_dtype, select_backend,
                       unsupported_reason)
from attn.masks import Band, make_band, simplify_mask, window_pair
from attn.reference import reference_attention
from attn.spec import LaunchSpec
from attn.tiled import tiled_attention

# -- torch's SDPA as a backend, for side-by-side comparison ------------------------------------

def _sdpa_forward(q, k, v, *, band, attn_mask, scale, **_unused):
    Nq, Nk = q.shape[2], k.shape[2]
    is_causal = False
    if not band.is_full:
        # torch's own causal path, top-left == ours when offset is 0. It gives NaN unless the
        # scale is positive in q's dtype (it masks with -inf before scaling, and -inf * 0 or
        # a flipped sign breaks the softmax): other scales take the bool mask below.
        fast_scale = isinstance(scale, Tensor) or scale >= torch.finfo(q.dtype).tiny
        if (attn_mask is None and band.left is None and band.right == 0 and band.offset == 0
                and fast_scale):
            is_causal = True
        else:
            allowed = band.mask(torch.arange(Nq, device=q.device),
                                torch.arange(Nk, device=q.device))
            if attn_mask is None:
                attn_mask = allowed
            elif attn_mask.dtype == torch.bool:
                attn_mask = attn_mask & allowed
            else:
                attn_mask = attn_mask.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None and attn_mask.is_floating_point() and attn_mask.dtype != q.dtype:
        attn_mask = attn_mask.to(q.dtype)
    if isinstance(scale, Tensor):  # per-head temperature: fold into q, autograd does the rest
        q, scale = q * scale.to(q.dtype), 1.0
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    return out, None


def _run(backend: str, q, k, v, *, band, attn_mask, scale, softcap, sinks, dropout_p,
         dropout_seed, block_m=None, block_n=None, score_mod=None, mask_mod=None,
         mask_blocks=None, dropout_rows=None, alibi=None, alibi_rows=None
         ) -> tuple[Tensor, Tensor | None]:
    if backend == "reference":
        if isinstance(scale, Tensor):
            scale = scale.to(q.dtype)  # plain PyTorch in q's dtype, like the rest of the reference
        return reference_attention(q, k, v, scale=scale, band=band, attn_mask=attn_mask,
                                   softcap=softcap, sinks=sinks, dropout_p=dropout_p,
                                   dropout_seed=dropout_seed, score_mod=score_mod,
                                   mask_mod=mask_mod, dropout_rows=dropout_rows,
                                   alibi_slopes=alibi, alibi_rows=alibi_rows)
    if backend == "sdpa":
        return _sdpa_forward(q, k, v, scale=scale, band=band, attn_mask=attn_mask)
    if isinstance(scale, Tensor):
        # temperature folded into q in float32: the kernels see a plain q, autograd handles τ
        acc = acc_dtype(q.dtype)
        q, scale = q.to(acc) * scale.to(acc), 1.0
    cap_t = softcap if isinstance(softcap, Tensor) else None
    spec = LaunchSpec(qk_scale=float(scale), band=band,
                      softcap=None if cap_t is not None else softcap,
                      dropout_p=float(dropout_p), dropout_seed=int(dropout_seed),
                      block_m=block_m, block_n=block_n, dropout_rows=dropout_rows,
                      alibi_rows=alibi_rows)
    if backend == "tiled":
        captured = ()
        if score_mod is not None or mask_mod is not None:
            spec, captured = mods.mod_spec(spec, q, k, score_mod, mask_mod, mask_blocks)
        out, lse = tiled_attention(q, k, v, spec, attn_mask=attn_mask, softcap=cap_t,
                                   sinks=sinks, captured=captured, alibi=alibi)
    else:
        from attn.flash_triton import triton_attention
        out, lse = triton_attention(q, k, v, spec, attn_mask=attn_mask, softcap=cap_t,
                                    sinks=sinks, alibi=alibi)
    return out.to(v.dtype), lse


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
    if sinks is None:
        lse = torch.full((B, H, Nq), float("-inf"), dtype=acc, device=q.device)
    else:
        lse = sinks.to(acc).view(1, H, 1).expand(B, H, Nq)
    return out.to(v.dtype), lse + tie


def _attention(q, k, v, *, band: Band, attn_mask, scale, temperature, softcap, sinks,
               dropout_p, return_lse, backend, block_m=None, block_n=None, score_mod=None,
               mask_mod=None, mask_blocks=None, dropout_rows=None, alibi_slopes=None,
               alibi_rows=None, q_name: str = "q"):
    """Shared by both public functions once their conventions are resolved into a Band.
    ``score_mod`` / ``mask_mod`` / ``mask_blocks``: see :func:`attn.mods.mod_spec`.
    ``alibi_rows`` (packed sequences): ``alibi_slopes`` already validated as (sequences, H).
    ``q_name``: the caller's name for q, for messages. No key (Nk = 0) or an empty output
    (B or Nq = 0): see :func:`_no_keys`, the same on every backend."""
    B, H, Nq, D = q.shape
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"{name} must be a positive int or None, got {b!r}")
    Nk, Dv = k.shape[2], v.shape[3]
    empty = Nk == 0 or B == 0 or Nq == 0
    _check_mods(score_mod, mask_mod, q)
    if attn_mask is not None:
        _validate_mask(attn_mask, q, (B, H, Nq, Nk), q_name)
        if not empty and not torch.compiler.is_compiling():  # data-dependent: eager only
            simpler = simplify_mask(attn_mask, band)
            if simpler is not None:  # causal/band + key padding: no N x N reads per tile
                band, attn_mask = simpler
    if scale is None:
        scale = D ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float or None, got {scale!r}")
    temperature = _positive("temperature", temperature, (B, H), q, q_name)
    if softcap is not None:
        softcap = _positive("softcap", softcap, (H,), q, q_name)
    if sinks is not None:
        _validate_sinks(sinks, H, q)
    dropout_p = _validate_dropout(dropout_p)
    if alibi_slopes is not None and alibi_rows is None:
        alibi_slopes = _validate_alibi(alibi_slopes, B, "B", H, q)

    if isinstance(temperature, Tensor):
        eff_scale = (scale / temperature.to(acc_dtype(q.dtype))).expand(B, H)[..., None, None]
    else:
        eff_scale = scale / temperature

    call = AttentionCall(
        device=q.device.type, dtype=q.dtype, head_dim=D, head_dim_v=Dv, n_q=Nq, n_k=Nk,
        band=band,
        mask=None if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "float"),
        mask_grad=attn_mask is not None and attn_mask.requires_grad,
        softcap=None if softcap is None else ("learned" if isinstance(softcap, Tensor) else "fixed"),
        sinks=sinks is not None, temperature_tensor=isinstance(temperature, Tensor),
        dropout=dropout_p > 0.0, return_lse=bool(return_lse),
        score_mod=score_mod is not None,
        mask_mod=mask_mod is not None or mask_blocks is not None,
        alibi=alibi_slopes is not None)
    choice = select_backend(call, backend)  # refuses what the backend asked for cannot do
    if empty:
        linked = (temperature, softcap, attn_mask)
        if score_mod is not None and torch.is_grad_enabled():
            linked += mods.captured_tensors(score_mod)
        out, lse = _no_keys(q, k, v, sinks=sinks, linked=linked)
        return (out, lse) if return_lse else out
    out, lse = _run(choice.name, q, k, v, band=band, attn_mask=attn_mask, scale=eff_scale,
                    softcap=softcap, sinks=sinks, dropout_p=dropout_p,
                    dropout_seed=_draw_seed(dropout_p), block_m=block_m, block_n=block_n,
                    score_mod=score_mod, mask_mod=mask_mod, mask_blocks=mask_blocks,
                    dropout_rows=dropout_rows, alibi=alibi_slopes, alibi_rows=alibi_rows)
    return (out, lse) if return_lse else out


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    temperature: float | Tensor = 1.0,
    softcap: float | Tensor | None = None,
    window: tuple[int, int] | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
    alibi_slopes: Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    score_mod=None,
    mask_mod=None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact scaled-dot-product attention with the variants people train with.

    Shapes: q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) → out (B, H, Nq, Dv) in
    q's dtype; with ``return_lse`` also lse (B, H, Nq), float32 (float64 for float64 input).
    ``H % Hkv == 0``: query head h reads kv head ``h // (H // Hkv)`` (GQA, MQA).

    Score ``s = (q·k) · scale / temperature``, ``scale`` defaulting to ``D ** -0.5``, then:

    * ``softcap=c``: ``s = c·tanh(s / c)`` (Gemma 2); a float, or a tensor broadcastable to
      (H,) that receives a gradient.
    * masks, combined with AND: ``attn_mask`` bool (True = attend) or float (added to s),
      broadcastable to (B, H, Nq, Nk); ``causal`` aligned bottom-right; ``window=(left,
      right)`` bounds the same diagonal offset (-1 = unbounded)::

          causal, Nq=3, Nk=5       window=(1, 0), Nq=Nk=4
          q0  x x x . .            x . . .
          q1  x x x x .            x x . .
          q2  x x x x x            . x x .
                                   . . x x

    * ``sinks`` (H,): per-head logits that join only the softmax denominator (attention
      sinks, Xiao et al. 2023; gpt-oss); learnable.
    * ``temperature``: a positive float or a tensor broadcastable to (B, H) (learnable).
    * ``alibi_slopes`` (H,) or (B, H), float32 (ALiBi, Press et al. 2022): the bias
      ``−slope_h · |i + Nk − Nq − j|`` (distance from the bottom-right diagonal) is added to
      the scores after softcap, tile by tile (never an (Nq, Nk) tensor). Constants, as in
      flash-attn: slopes that require grad raise ValueError. Not on ``sdpa``.
    * ``dropout_p``: dropout on the probabilities; its mask is a hash of a seed drawn from
      torch's generator, so ``torch.manual_seed`` reproduces it on every backend.
    * ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx) -> bool``:
      FlexAttention's programmable score and mask (see :mod:`attn.flex`); tensors a
      score_mod captures receive gradients. Order of operations: scale/temperature →
      score_mod → softcap → ALiBi → masks (causal, window, attn_mask AND mask_mod) → sinks.
      Run by the tiled (or reference) backend.

    A row that sees no key returns zeros and lse = -inf (or its sink), never NaN; so does
    every row when Nk = 0, and B = 0 or Nq = 0 give an empty result, on every backend, with
    gradients (zeros) to every input. Heads and head dims must be at least 1 (ValueError).
    ``backend``: "auto" (triton on CUDA when it can, else tiled), "reference", "tiled",
    "triton" or "sdpa"; see :func:`select_backend`. ``block_m`` / ``block_n``: the tiled
    backend's tile sizes (queries x keys; default ``attn.tiled.BLOCK_M`` / ``BLOCK_N``,
    chosen by measurement); the other backends ignore them (triton autotunes its own).
    """
    _validate_qkv(q, k, v, allow_empty=True)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    band = make_band(q.shape[2], k.shape[2], causal=causal, window=window_pair(window))
    return _attention(q, k, v, band=band, attn_mask=attn_mask, scale=scale,
                      temperature=temperature, softcap=softcap, sinks=sinks,
                      dropout_p=dropout_p, return_lse=return_lse, backend=backend,
                      block_m=block_m, block_n=block_n, score_mod=score_mod,
                      mask_mod=mask_mod, alibi_slopes=alibi_slopes)


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    backend: str = "auto",
) -> Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on attn's backends.

    Same arguments and semantics as torch's: inputs (..., H, L, E) / (..., Hkv, S, E)
    (3 or more dims), ``is_causal`` aligned top-left (query i sees keys j <= i), bool mask
    True = attend, float mask added, ``enable_gqa`` required when H != Hkv. Rows that see
    no key give zeros. Dropout draws its mask from attn's hash RNG, not torch's. Empty
    inputs as in torch: L = 0 (or an empty batch) gives an empty output, S = 0 zeros, with
    torch's (zero) gradients; H = 0 or E = 0 raise ValueError (torch answers those too, but
    no model has them, and the default scale 1/sqrt(E) does not exist at E = 0).
    """
    names = ("query", "key", "value")
    for name, t in zip(names, (query, key, value)):
        _check_tensor(name, t)
        if t.dim() < 3:
            raise ValueError(f"{name} must have at least 3 dims (..., L, E), got shape "
                             f"{tuple(t.shape)}")
    shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(f"query, key, value must have the same number of dims, got {shapes}")
    n_lead = query.dim() - (3 if query.dim() >= 4 else 2)  # dims before (H, L, E) / (L, E)
    lead = query.shape[:n_lead]
    if not (lead == key.shape[:n_lead] == value.shape[:n_lead]):
        # flattened, different batch dims of equal product would silently pair wrong rows
        raise ValueError(f"query, key, value must share their batch dims {tuple(lead)}, got "
                         f"{shapes}")
    if query.dim() >= 4 and query.shape[-3] != key.shape[-3] and not enable_gqa:
        raise ValueError(f"query has {query.shape[-3]} heads and key {key.shape[-3]}: pass "
                         f"enable_gqa=True for grouped-query attention")
    L, S = query.shape[-2], key.shape[-2]
    B = math.prod(lead)  # explicit: reshape(-1, ...) cannot infer it when a size is 0

    def to4d(t: Tensor) -> Tensor:
        if t.dim() == 3:
            return t.unsqueeze(1)  # (N, L, E) -> (N, 1, L, E)
        return t.reshape(B, *t.shape[-3:])  # (..., H, L, E) -> (B, H, L, E)

    q4, k4, v4 = to4d(query), to4d(key), to4d(value)
    _validate_qkv(q4, k4, v4, names, "(..., H, L, E)", allow_empty=True,
                  shown=(query, key, value))
    mask4 = None
    if attn_mask is not None:
        _check_tensor("attn_mask", attn_mask)
        scores = (*lead, *query.shape[-3:-2], L, S) if query.dim() >= 4 else (*lead, L, S)
        try:  # broadcasts *to* the scores: the mask may not grow them
            full = torch.broadcast_shapes(attn_mask.shape, scores)
        except RuntimeError:
            full = None
        if full != torch.Size(scores) or attn_mask.dim() > query.dim():
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast "
                             f"to the scores' shape {(*query.shape[:-1], S)}")
        if query.dim() == 3:
            mask4 = attn_mask.unsqueeze(-3) if attn_mask.dim() == 3 else attn_mask
        elif query.dim() == 4:
            mask4 = attn_mask
        else:  # flatten leading batch dims: (..., H, L, S) -> (B, H, L, S)
            mask4 = attn_mask.expand(*query.shape[:-1], S).reshape(B, *query.shape[-3:-1], S)
    band = make_band(L, S, causal=bool(is_causal), window=None, top_left=True)
    out = _attention(q4, k4, v4, band=band, attn_mask=mask4, scale=scale, temperature=1.0,
                     softcap=None, sinks=None, dropout_p=dropout_p, return_lse=False,
                     backend=backend, q_name="query")
    return out.reshape(*query.shape[:-1], value.shape[-1])
