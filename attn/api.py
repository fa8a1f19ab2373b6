"""Public entry points: their conventions, then :mod:`attn.call` resolves and runs the call.

``attention`` is attn's own signature (bottom-right causal, every variant);
``scaled_dot_product_attention`` mirrors ``torch.nn.functional.scaled_dot_product_attention``
argument for argument so existing code switches by changing one import.
"""

from __future__ import annotations

import functools
import math

from torch import Tensor
from torch.nn.attention.bias import CausalBias as _CausalBias
from torch.nn.attention.bias import CausalVariant as _CausalVariant

# the checks and the backend choice live in attn.call; its public names stay importable here
from attn.call import (BACKENDS, AttentionCall, BackendChoice, acc_dtype,  # noqa: F401
                       resolve, run, select_backend, unsupported_reason)
from attn.call import _check_tensor, _validate_qkv, attend, broadcasts_to, sdpa_errors
from attn.masks import Band, make_band, window_pair

# keywords of torch's and flash-attn's signatures that attention() spells its own way
_FOREIGN = {"is_causal": "attention() takes causal=True (aligned bottom-right); for torch's "
                         "signature and its top-left is_causal, use "
                         "attn.scaled_dot_product_attention",
            "window_size": "attention() takes window=(left, right), -1 for unbounded"}


def _foreign_keywords(fn):
    """Python's bare 'unexpected keyword argument' for another library's names, with how
    attn spells them."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for name in _FOREIGN:  # plain loop and `in`: torch.compile traces it without a break
            if name in kwargs:
                raise TypeError(f"{fn.__name__}() got an unexpected keyword argument "
                                f"{name!r}: {_FOREIGN[name]}")
        return fn(*args, **kwargs)
    return wrapper


@_foreign_keywords
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

    Score ``s = (q·k) · scale / temperature``, then ``softcap=c`` (Gemma 2), ``alibi_slopes``
    (Press et al. 2022) and the masks, combined with AND: ``attn_mask``, ``causal`` aligned
    bottom-right, ``window=(left, right)`` bounding the same diagonal offset (-1 =
    unbounded)::

          causal, Nq=3, Nk=5       window=(1, 0), Nq=Nk=4
          q0  x x x . .            x . . .
          q1  x x x x .            x x . .
          q2  x x x x x            . x x .
                                   . . x x

    ``sinks`` (H,): attention sinks (Xiao et al. 2023); ``score_mod`` / ``mask_mod``:
    FlexAttention's (:mod:`attn.flex`). A row that sees no key returns zeros and lse = -inf
    (or its sink), never NaN. ``backend``: see :func:`select_backend`. Each keyword's exact
    meaning, the order of the score steps and the empty cases: docs/variants.md, "The
    keywords".
    """
    _validate_qkv(q, k, v, allow_empty=True)
    if isinstance(attn_mask, _CausalBias):  # its tensor data is not a mask: never read it
        raise TypeError(f"attn_mask is a torch CausalBias ({attn_mask.variant.name}), which "
                        f"attn.attention does not take: pass causal=True (bottom-right, "
                        f"causal_lower_right's alignment), or give the bias to "
                        f"attn.scaled_dot_product_attention, torch's drop-in")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    band = make_band(q.shape[2], k.shape[2], causal=causal, window=window_pair(window))
    return attend(q, k, v, band=band, attn_mask=attn_mask, scale=scale, temperature=temperature,
                  softcap=softcap, sinks=sinks, dropout_p=dropout_p, return_lse=return_lse,
                  backend=backend, block_m=block_m, block_n=block_n, score_mod=score_mod,
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

    Same arguments and semantics as torch's: inputs (..., H, L, E) / (..., Hkv, S, E), 2 or
    more dims ((L, E) is one sequence of one head, (N, L, E) one head per batch row);
    ``is_causal`` aligned top-left; ``enable_gqa`` required when H != Hkv; ``attn_mask``
    also one of torch's causal biases, which becomes a band, never a dense mask. Input errors
    are :class:`attn.call.SdpaInputError` (a ValueError and torch's RuntimeError). Where
    torch's contract is stricter than :func:`attention`'s, and the known differences (rows
    with no key give zeros, attn's dropout mask): docs/variants.md, "The drop-in".
    """
    with sdpa_errors():
        q4, k4, v4, mask4, band = _sdpa_operands(query, key, value, attn_mask, is_causal,
                                                 enable_gqa)
        out = attend(q4, k4, v4, band=band, attn_mask=mask4, scale=scale, dropout_p=dropout_p,
                     return_lse=False, backend=backend, q_name="query")
    return out.reshape(*query.shape[:-1], value.shape[-1])


def _sdpa_operands(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None,
                   is_causal: bool, enable_gqa: bool
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Band]:
    """The drop-in's arguments in attn's terms: (B, H, L, E) views of query, key, value
    (leading batch dims flattened), the mask as (B, H, L, S) or broadcastable, and the band
    (top-left ``is_causal``, or a causal bias's alignment)."""
    names = ("query", "key", "value")
    for name, t in zip(names, (query, key, value)):
        _check_tensor(name, t)
        if t.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., L, E), got shape "
                             f"{tuple(t.shape)}")
    shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(f"query, key, value must have the same number of dims, got {shapes}")
    # dims before (H, L, E), or before (L, E) for 3-d and 2-d inputs
    n_lead = query.dim() - (3 if query.dim() >= 4 else 2)
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
        if t.dim() <= 3:  # (N, L, E) -> (N, 1, L, E); (L, E) -> (1, 1, L, E)
            return t.unsqueeze(-3) if t.dim() == 3 else t[None, None]
        return t.reshape(B, *t.shape[-3:])  # (..., H, L, E) -> (B, H, L, E)

    q4, k4, v4 = to4d(query), to4d(key), to4d(value)
    _validate_qkv(q4, k4, v4, names, "(..., H, L, E)", allow_empty=True,
                  shown=(query, key, value))
    if isinstance(attn_mask, _CausalBias):
        return q4, k4, v4, None, _bias_band(attn_mask, L, S, is_causal)
    mask4 = None
    if attn_mask is not None:
        _check_tensor("attn_mask", attn_mask)
        if type(attn_mask).__module__.startswith("torch.nn.attention"):
            raise TypeError(f"attn_mask of type {type(attn_mask).__name__} is a torch "
                            f"attention bias attn does not know: pass a bool or float tensor")
        if is_causal:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} given with "
                             f"is_causal=True: Explicit attn_mask should not be set when "
                             f"is_causal=True (AND the causal mask into attn_mask instead)")
        scores = (*lead, *query.shape[-3:-2], L, S) if query.dim() >= 4 else (*lead, L, S)
        if not broadcasts_to(attn_mask.shape, scores):  # the mask may not grow the scores
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast "
                             f"to the scores' shape {(*query.shape[:-1], S)}")
        if query.dim() == 3:
            mask4 = attn_mask.unsqueeze(-3) if attn_mask.dim() == 3 else attn_mask
        elif query.dim() <= 4:  # a 2-d query's mask is (L, S) or broadcasts to it
            mask4 = attn_mask
        else:  # flatten leading batch dims: (..., H, L, S) -> (B, H, L, S)
            mask4 = attn_mask.expand(*query.shape[:-1], S).reshape(B, *query.shape[-3:-1], S)
    band = make_band(L, S, causal=bool(is_causal), window=None, top_left=True)
    return q4, k4, v4, mask4, band


def _bias_band(bias: _CausalBias, L: int, S: int, is_causal: bool) -> Band:
    """A torch causal bias as attn's band, the way torch reads it: upper-left (or a square
    bias) is ``is_causal``'s top-left causal over the call's own lengths; lower-right is
    causal aligned to the bottom-right corner (query i sees keys j <= i + S - L), so it
    must be the call's (L, S)."""
    if is_causal:
        raise ValueError(f"attn_mask is a CausalBias ({bias.variant.name}, "
                         f"{bias.seq_len_q} x {bias.seq_len_kv}) and is_causal=True: pass "
                         f"only one of them")
    if bias.variant == _CausalVariant.UPPER_LEFT or bias.seq_len_q == bias.seq_len_kv:
        return make_band(L, S, causal=True, window=None, top_left=True)
    if bias.variant != _CausalVariant.LOWER_RIGHT:
        raise ValueError(f"attn_mask is a CausalBias of unknown variant {bias.variant!r}")
    if (bias.seq_len_q, bias.seq_len_kv) != (L, S):
        raise ValueError(f"attn_mask is a lower-right CausalBias of {bias.seq_len_q} x "
                         f"{bias.seq_len_kv}, but query and key have lengths L = {L}, "
                         f"S = {S}")
    return make_band(L, S, causal=True, window=None, top_left=False)
