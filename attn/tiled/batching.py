"""``torch.func.vmap`` rules' helpers of the tiled autograd.Functions: shared with the triton
backend's, they live in :mod:`attn.batching` (see there for when a rule folds or loops)."""

from __future__ import annotations

from attn.batching import call_per_sample, fold, fold_mask, rows_of, unfold

__all__ = ["call_per_sample", "fold", "fold_mask", "rows_of", "unfold"]
