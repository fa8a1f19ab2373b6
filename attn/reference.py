"""The oracle: ``softmax(q kᵀ · scale) v`` with every variant, scores materialized (O(N²)).

Readable before fast. Every other backend is tested against this function run in float64;
run in a low precision it also measures plain PyTorch's own error in that precision. It
computes in the dtype it is given and lets autograd provide every gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attn.masks import Band, dropout_keep, dropout_keep_rows
from attn.spec import acc_dtype


class _QK(torch.autograd.Function):
    """``q kᵀ`` whose backward reads non-finite entries of q and k as 0: a masked score's
    gradient is 0, and 0·NaN in ``dS k`` would otherwise carry a key that no row sees
    into every dq (a row that sees it has a NaN dS anyway). Plain torch ops throughout, so
    torch.func's vmap rule is generated, forward-mode is the product rule, and the backward
    is differentiable again (double backward)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q: Tensor, k: Tensor) -> Tensor:
        return q @ k.transpose(-2, -1)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, ds: Tensor) -> tuple[Tensor, Tensor]:
        q, k = (torch.where(torch.isfinite(x), x, 0.0) for x in ctx.saved_tensors)
        return ds @ k, ds.transpose(-2, -1) @ q

    @staticmethod
    def jvp(ctx, dq: Tensor | None, dk: Tensor | None) -> Tensor:
        q, k = ctx.saved_tensors
        ds = torch.zeros(q.shape[:-1] + k.shape[-2:-1], dtype=q.dtype, device=q.device)
        if dq is not None:
            ds = ds + dq @ k.transpose(-2, -1)
        if dk is not None:
            ds = ds + q @ dk.transpose(-2, -1)
        return ds


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    band: Band = Band(),
    attn_mask: Tensor | None = None,
    scale: float | Tensor = 1.0,
    softcap: float | Tensor | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    score_mod=None,
    mask_mod=None,
    dropout_rows=None,
    alibi_slopes: Tensor | None = None,
    alibi_rows=None,
) -> tuple[Tensor, Tensor]:
    """Attention with materialized scores. Inputs already validated by ``attn.api``.

    q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv); ``scale`` is the full multiplier
    of q·k (``scale / temperature``), a float or a tensor broadcastable to (B, H, 1, 1);
    ``softcap`` a float or a tensor broadcastable to (H,); ``sinks`` (H,).
    Returns out (B, H, Nq, Dv) in q's dtype and lse (B, H, Nq) in float32 (float64 for
    float64 inputs). ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx,
    kv_idx)`` (FlexAttention's signatures) run once on the whole (B, H, Nq, Nk) grid of
    broadcast index tensors. Order: scale → score_mod → softcap → ALiBi → masks → sinks.
    ``alibi_slopes`` (B, H): the bias ``−slope_h · |j − (i + band.offset)|``, distances from
    the band's diagonal (bottom-right in attn.attention). ``dropout_rows`` / ``alibi_rows``:
    see :class:`attn.spec.LaunchSpec` (packed sequences, B == 1; alibi_slopes (sequences, H)).
    """
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    group = H // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (B, H, Nk, D)
    v = v.repeat_interleave(group, dim=1)

    s = _QK.apply(q, k) * scale  # (B, H, Nq, Nk)
    idx = (torch.arange(B, device=q.device).view(B, 1, 1, 1),
           torch.arange(H, device=q.device).view(1, H, 1, 1),
           torch.arange(Nq, device=q.device).view(1, 1, Nq, 1),
           torch.arange(Nk, device=q.device).view(1, 1, 1, Nk))
    if score_mod is not None:
        s = torch.broadcast_to(score_mod(s, *idx), s.shape).to(s.dtype)
    if softcap is not None:
        c = softcap if isinstance(softcap, float) else softcap.to(s.dtype).reshape(-1, 1, 1)
        s = c * torch.tanh(s / c)
    offs_m, offs_n = torch.arange(Nq, device=q.device), torch.arange(Nk, device=q.device)
    if alibi_slopes is not None:
        s = s - _alibi_bias(alibi_slopes, alibi_rows, band, offs_m, offs_n, s)
    s = _masked(s, band.mask(offs_m, offs_n), mask_mod, idx, attn_mask)
    p, lse = _softmax(s, sinks)
    if dropout_p > 0.0:
        keep = _dropout_keep(dropout_p, dropout_seed, dropout_rows, B, H, offs_m, offs_n)
        p = p * keep / (1.0 - dropout_p)
    out = p @ v
    return out.to(q.dtype), lse.to(acc_dtype(q.dtype))


def _alibi_bias(slopes: Tensor, alibi_rows, band: Band, offs_m: Tensor, offs_n: Tensor,
                s: Tensor) -> Tensor:
    """ALiBi (Press et al. 2022), the bias built whole: ``slope_h · |j − (i + offset)|``
    broadcast against the scores ``s`` (B, H, Nq, Nk), in their dtype."""
    B, H, Nq, _ = s.shape
    if alibi_rows is None:
        dist = (offs_n[None, :] - (offs_m[:, None] + band.offset)).abs()  # (Nq, Nk)
        slope = slopes.reshape(B, H, 1, 1)
    else:  # packed: positions inside each sequence, each row its sequence's slopes
        seq, pos_m, pos_n = alibi_rows(offs_m, offs_n)
        dist = (pos_n[None, :] - pos_m[:, None]).abs()
        slope = slopes[seq].t().reshape(1, H, Nq, 1)
    return slope.to(s.dtype) * dist.to(s.dtype)


def _masked(s: Tensor, allowed: Tensor | None, mask_mod, idx, attn_mask: Tensor | None
            ) -> Tensor:
    """The scores with every mask applied: the band's ``allowed`` (None: all), the
    mask_mod's and a bool ``attn_mask`` keep; a float ``attn_mask`` is added first."""
    if mask_mod is not None:
        keep = torch.broadcast_to(mask_mod(*idx), s.shape)
        allowed = keep if allowed is None else allowed & keep
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = attn_mask if allowed is None else allowed & attn_mask
        else:  # added; its -inf entries mask (replace), so a NaN key stays out there too
            s = s + attn_mask.to(s.dtype)
            blocked = attn_mask == float("-inf")
            allowed = ~blocked if allowed is None else allowed & ~blocked
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _softmax(s: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """The rows' softmax over the keys and the sinks (H,) → p (B, H, Nq, Nk) and lse
    (B, H, Nq), -inf (and p 0) on rows that see nothing."""
    m = s.amax(dim=-1, keepdim=True)  # (B, H, Nq, 1)
    if sinks is not None:
        sink = sinks.to(s.dtype).reshape(1, -1, 1, 1)
        m = torch.maximum(m, sink)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m).detach()  # rows that see nothing
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        l = l + torch.exp(sink - m)
    l_safe = torch.where(l > 0, l, torch.ones_like(l))
    # -inf where the row sees nothing; log of l_safe keeps that row's gradient finite
    lse = torch.where(l > 0, m + torch.log(l_safe), float("-inf")).squeeze(-1)
    return p / l_safe, lse


def _dropout_keep(dropout_p: float, seed: int, dropout_rows, B: int, H: int, offs_m: Tensor,
                  offs_n: Tensor) -> Tensor:
    """Dropout's keep-mask: per (batch row, head) of the call, or of ``dropout_rows``'s
    packed rows (B == 1)."""
    if dropout_rows is not None:
        b_rows, rows_m, rows_n = dropout_rows(offs_m, offs_n)
        bh = b_rows.view(1, 1, -1) * H + torch.arange(H, device=offs_m.device).view(1, H, 1)
        return dropout_keep_rows(seed, bh, rows_m, rows_n, dropout_p)
    bh = torch.arange(B * H, device=offs_m.device).reshape(B, H)
    return dropout_keep(seed, bh, offs_m, offs_n, dropout_p)


def reference_packed(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, *, band: Band, scale: float | Tensor = 1.0,
                     softcap: float | Tensor | None = None, sinks: Tensor | None = None,
                     dropout_p: float = 0.0, dropout_seed: int = 0,
                     alibi_slopes: Tensor | None = None, **terms: float
                     ) -> tuple[Tensor, Tensor]:
    """Packed sequences, each alone through :func:`reference_attention` (so none can touch
    another's rows). q (1, H, total_q, D), k / v (1, Hkv, total_k, D / Dv): one batch row
    holding the tokens; cu_seqlens checked offsets; ``band`` per sequence in end-relative
    positions (offset 0 is bottom-right alignment); one dropout seed for the call, sequence
    b as dropout's batch row b; ``alibi_slopes`` (sequences, H), distances from each
    sequence's own diagonal; ``terms``: static score variants' keywords of
    :func:`reference_attention` (``LaunchSpec.terms``). Returns out (1, H, total_q, Dv), lse
    (1, H, total_q)."""
    H = q.shape[1]
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    lse_dtype = acc_dtype(q.dtype)
    outs, lses = [], []
    for b, (q0, q1, k0, k1) in enumerate(zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])):
        if q1 == q0:
            continue
        if k1 == k0:  # no key: zeros, and lse the sink (or -inf)
            outs.append(q.new_zeros(1, H, q1 - q0, v.shape[3]))
            lses.append(q.new_full((1, H, q1 - q0), float("-inf"), dtype=lse_dtype)
                        if sinks is None
                        else sinks.to(lse_dtype).view(1, H, 1).expand(1, H, q1 - q0))
            continue
        seq_band = Band(band.offset + (k1 - k0) - (q1 - q0), band.left, band.right)
        out, lse = reference_attention(
            q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], band=seq_band, scale=scale,
            softcap=softcap, sinks=sinks, dropout_p=dropout_p, dropout_seed=dropout_seed,
            # dropout_rows of sequence b run alone: batch row b, positions as they are
            dropout_rows=lambda offs_m, offs_n, b=b: (torch.full_like(offs_m, b), offs_m, offs_n),
            alibi_slopes=None if alibi_slopes is None else alibi_slopes[b:b + 1], **terms)
        outs.append(out)
        lses.append(lse)
    if not outs:
        return (q.new_zeros(1, H, 0, v.shape[3]),
                q.new_zeros((1, H, 0), dtype=lse_dtype))
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)
