"""torch's own fused SDPA as a backend, for side-by-side comparison: attn's band and masks
translated into torch's arguments. Forward only through torch (its autograd does the rest);
no lse, no variants beyond a mask and a per-head temperature (``attn.call`` refuses the rest).

``torch_sdpa`` is torch's function as it was when attn was imported. This backend, and the
torch competitors of ``attn bench``, call it rather than looking the name up in
``torch.nn.functional`` at call time: while :func:`attn.patch_sdpa` routes that name to attn,
they must still reach torch's kernels, not recurse into attn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attn.masks import Band

torch_sdpa = F.scaled_dot_product_attention


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, *, band: Band, attn_mask: Tensor | None,
                   scale: float | Tensor) -> tuple[Tensor, None]:
    """q (B, H, Nq, D), k/v (B, Hkv, Nk, D/Dv) → (out, None). ``scale``: a float, or a
    (B, H, 1, 1) tensor (scale / temperature) folded into q."""
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
    out = torch_sdpa(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    return out, None
