"""``torch.func.vmap`` rules of the tiled autograd.Functions: the mapped dimension folded into
the batch dimension B where that is exact, else one call per sample.

The tiled launchers run work items on a pool of threads, which would lose functorch's
thread-local state, and they read values on the host (``.item()``), which a batched tensor
does not allow; so the rules hand the launchers plain tensors. Folding (X samples of B rows
become X·B rows) is exact where every operand is per batch row or shared: q, k, v, the
mask and the ALiBi slopes. Per-head tensors that are mapped (sinks, a learnable softcap), a
score_mod / mask_mod (they read the batch index), dropout (its hash reads it too) and
gradients summed over the batch (sinks', softcap's, a mask's) take the loop instead.
"""

from __future__ import annotations

# the helpers are shared with the triton backend's rules: they live in attn.transforms
from attn.transforms import call_per_sample, fold, fold_mask, rows_of, unfold

__all__ = ["call_per_sample", "fold", "fold_mask", "rows_of", "unfold"]
