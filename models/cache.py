"""A KV cache: one per attention layer, preallocated buffers and a fill length."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attn.kvcache import PagedKVCache


class KVCache(nn.Module):
    """Keys and values of one layer, filled left to right, stored ``(B, max_len, Hkv, D)``:
    flash-attn's paged layout with one page of ``max_len`` positions per sequence, so
    :meth:`paged` hands the same buffers to :func:`attn.decode` as an
    :class:`attn.kvcache.PagedKVCache` (no copy).

    ``append`` writes the new positions and returns views ``(B, Hkv, length, D)`` of
    everything cached so far, for a caller that attends with :func:`attn.attention`
    (bottom-right causal alignment).
    """

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        sizes = dict(batch=batch, kv_heads=kv_heads, max_len=max_len, head_dim=head_dim)
        for name, n in sizes.items():
            if isinstance(n, bool) or not isinstance(n, int):
                raise TypeError(f"{name} must be an int, got {type(n).__name__}")
            if n < (0 if name == "max_len" else 1):
                raise ValueError(f"{name} must be {'>= 0' if name == 'max_len' else '>= 1'}, "
                                 f"got {n}")
        shape = (batch, max_len, kv_heads, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.max_len = max_len
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        self._length = 0

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v (B, Hkv, n, D) → all cached keys and values (B, Hkv, length + n, D)."""
        # Named for whoever holds the cache: the new keys come from their layer's input.
        B, max_len, Hkv, D = self.k.shape
        if k.dim() != 4 or (k.shape[0], k.shape[1], k.shape[3]) != (B, Hkv, D) \
                or v.shape != k.shape:
            raise ValueError(f"KVCache (B, Hkv, max_len, D) = {(B, Hkv, max_len, D)} cannot "
                             f"take new keys {tuple(k.shape)} and values {tuple(v.shape)}: "
                             f"batch, kv heads and head dim must match")
        if k.dtype != self.k.dtype or v.dtype != self.k.dtype:
            raise TypeError(f"KVCache holds {self.k.dtype}, got new keys {k.dtype} and values "
                            f"{v.dtype}: make the cache in the model's dtype")
        n = k.shape[2]
        end = self._length + n
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {self._length} cached + {n} new > "
                             f"max_len {self.max_len}")
        # (B, Hkv, n, D) -> (B, n, Hkv, D): the storage's layout
        self.k[:, self._length:end] = k.transpose(1, 2)
        self.v[:, self._length:end] = v.transpose(1, 2)
        self._length = end
        return self.k[:, :end].transpose(1, 2), self.v[:, :end].transpose(1, 2)

    def paged(self) -> PagedKVCache:
        """The cached keys as an :class:`attn.kvcache.PagedKVCache` over these buffers
        (sequence b in page b, ``length`` keys each): what :func:`attn.decode`
        reads."""
        B = self.k.shape[0]
        table = torch.arange(B, dtype=torch.int32, device=self.k.device)[:, None]
        return PagedKVCache(self.k, self.v, table, torch.full((B,), self._length))
