"""The quantized side of a paged cache: its format, fp16 scales and ring of full-precision
recent pages, the writer that turns appended tokens into codes, and the dequantizing read.

The code pages themselves are the cache's ``k_pages`` / ``v_pages``; this object holds what
goes with them: scales indexed by page like the codes, and with ``recent_pages = W`` each
sequence's ring of W full-precision pages (slot ``b · W + j % W`` for its page j, named by
the block table like any page). The layout: docs/kvcache.md, "Quantized caches".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attn import kvquant
from attn.kvquant import KVQuant

__all__ = ["QuantizedPages"]

# codes and scales of some tokens or pages: k codes, v codes, k scales, v scales (None: fp8's
# scales are fixed per kv head)
Codes = tuple[Tensor, Tensor, "Tensor | None", "Tensor | None"]


@dataclass
class QuantizedPages:
    """A quantized cache's format and the tensors beside its code pages (module docstring);
    ``dims``: the head dims ``(D, Dv)`` of the values (int4's codes are half as wide);
    ``dtype``: the storage dtype of the values (the recent pages, and what tokens are
    rounded to before they are quantized)."""

    quant: KVQuant
    k_scales: Tensor
    v_scales: Tensor
    recent_k: Tensor | None
    recent_v: Tensor | None
    dims: tuple[int, int]
    dtype: torch.dtype

    @classmethod
    def empty(cls, quant: KVQuant, k_codes: Tensor, batch: int, dims: tuple[int, int],
              dtype: torch.dtype, fp8_scales) -> "QuantizedPages":
        """Zero scales and ring for code pages ``k_codes (num_blocks, page, Hkv, ·)`` of
        ``batch`` sequences (fp8: its fixed scales ``fp8_scales = (k, v)``, checked)."""
        num_blocks, page, Hkv, _ = k_codes.shape
        dev = k_codes.device
        D, Dv = dims
        if quant.kind == "fp8_e4m3":
            k_scales, v_scales = (_head_scales(name, x, Hkv, dev) for name, x in
                                  zip(("fp8_scales[0]", "fp8_scales[1]"), fp8_scales))
        else:
            k_shape = ((num_blocks, 1, Hkv, D) if quant.k_per_channel
                       else (num_blocks, page, Hkv, D // quant.group_of(D)))
            k_scales = torch.zeros(k_shape, dtype=torch.float16, device=dev)
            v_scales = torch.zeros(num_blocks, page, Hkv, Dv // quant.group_of(Dv),
                                   dtype=torch.float16, device=dev)
        W = quant.recent_pages
        ring = (batch * W, page, Hkv)
        recent_k, recent_v = (tuple(torch.zeros(*ring, d, dtype=dtype, device=dev) for d in dims)
                              if W else (None, None))
        return cls(quant, k_scales, v_scales, recent_k, recent_v, dims, dtype)

    # -- writes --

    def quantize(self, k: Tensor, v: Tensor, *, k_pages: bool = False) -> Codes:
        """Codes and scales of tokens ``k (…, Hkv, D)``, ``v (…, Hkv, Dv)`` (``k_pages``:
        k is whole pages ``(pages, page, Hkv, D)``, scaled per channel when the format
        says so). The values are first rounded to the storage dtype, so a token gets the
        same codes whether or not it passed through the full-precision window."""
        quant, kind = self.quant, self.quant.kind
        k, v = k.to(self.dtype), v.to(self.dtype)
        kn, vn = ("k (pages)", "v (pages)") if k_pages else ("k (tokens)", "v (tokens)")
        if kind == "fp8_e4m3":
            return (kvquant.quantize_fp8(k, self.k_scales, name=kn),
                    kvquant.quantize_fp8(v, self.v_scales, name=vn), None, None)
        if quant.k_per_channel:
            assert k_pages, "keys scaled per channel are quantized a whole page at a time"
            kc, ks = kvquant.quantize_channels(k, kind, name=kn)
        else:
            kc, ks = kvquant.quantize(k, kind, quant.group, name=kn)
        vc, vs = kvquant.quantize(v, kind, quant.group, name=vn)
        return kc, vc, ks, vs

    def write(self, pages: tuple[Tensor, Tensor], blk: Tensor, off: Tensor | None,
              codes: Codes) -> None:
        """Codes and scales (:meth:`quantize`) into code ``pages`` ``blk`` at slots ``off``
        (None: whole pages)."""
        kc, vc, ks, vs = codes
        at = blk if off is None else (blk, off)
        with torch.no_grad():
            pages[0][at], pages[1][at] = kc, vc
            if ks is not None:
                self.k_scales[at] = ks
                self.v_scales[at] = vs

    def append_windowed(self, pages: tuple[Tensor, Tensor], rows: Tensor, old: Tensor,
                        k: Tensor, v: Tensor, take: Callable[[int], list[int]]
                        ) -> list[tuple[int, int, list[int]]]:
        """Append tokens ``k``, ``v`` ``(B'·Nnew, Hkv, ·)`` (token-major) of sequences
        ``rows`` at lengths ``old`` with a full-precision window: tokens land in each
        sequence's ring, and the pages that leave the window are quantized whole (ring
        content plus new tokens) into pages from ``take(n)``. Everything is quantized before
        a page is taken or written (quantizing may refuse the values). Returns the block
        table's edits ``(row, j0, ids)``: quantized pages first, then each row's ring slots."""
        page, W, dev = pages[0].shape[1], self.quant.recent_pages, pages[0].device
        Hkv = pages[0].shape[2]
        n = k.shape[0] // len(rows)
        pos = (old.view(-1, 1) + torch.arange(n).view(1, n)).flatten()
        seq = rows.repeat_interleave(n)
        j = pos // page
        new = old + n
        f_old, f_new = self.recent_from(old, page), self.recent_from(new, page)
        leaving = j < f_new[torch.arange(len(rows)).repeat_interleave(n)]
        coded = []
        for i, r in enumerate(rows.tolist()):
            a, z = int(f_old[i]), int(f_new[i])
            if z == a:
                continue
            stage = [torch.empty(z - a, page, Hkv, d, dtype=self.dtype, device=dev)
                     for d in self.dims]
            in_ring = torch.arange(a, min(z, -(-int(old[i]) // page)))
            ring = (r * W + in_ring % W).to(dev)
            mine = leaving & (seq == r)
            for st, t, rec in zip(stage, (k, v), (self.recent_k, self.recent_v)):
                st[:len(in_ring)] = rec[ring]
                st[(j[mine] - a).to(dev), (pos[mine] % page).to(dev)] = t[mine.to(dev)].to(
                    st.dtype)
            coded.append((r, a, self.quantize(*stage, k_pages=True)))
        taken = take(int((f_new - f_old).sum()))
        edits: list[tuple[int, int, list[int]]] = []
        for r, a, codes in coded:
            ids, taken = taken[:len(codes[0])], taken[len(codes[0]):]
            self.write(pages, torch.tensor(ids, device=dev), None, codes)
            edits.append((r, a, ids))
        # the tokens still in the window go to the ring, slot r·W + j % W for page j
        stay = ~leaving
        slot = (seq[stay] * W + j[stay] % W).to(dev)
        with torch.no_grad():
            for rec, t in ((self.recent_k, k), (self.recent_v, v)):
                rec[slot, (pos[stay] % page).to(dev)] = t[stay.to(dev)].to(rec.dtype)
        return edits + [(r, int(a), [r * W + x % W for x in range(int(a), -(-int(e) // page))])
                        for r, a, e in zip(rows.tolist(), f_new, new)]

    def recent_from(self, lengths: Tensor, page_size: int) -> Tensor:
        """Each sequence's first full-precision page (the pages before it hold codes)."""
        return (-(-lengths // page_size) - self.quant.recent_pages).clamp(min=0)

    # -- reads --

    def values_at(self, pages: tuple[Tensor, Tensor], blk: Tensor, off: Tensor,
                  recent: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values at slots ``off`` of pages ``blk`` (host int64 ``(n,)``; ``recent``:
        which of them are ring pages), dequantized: float32 ``(n, Hkv, D)``, ``(n, Hkv, Dv)``
        (exactly ``code · scale``, the values attention reads)."""
        dev, Hkv = pages[0].device, pages[0].shape[2]
        coded = (~recent).nonzero().squeeze(1)
        kept = recent.nonzero().squeeze(1)
        out = []
        for codes, scales, ring, dim in zip(pages, (self.k_scales, self.v_scales),
                                            (self.recent_k, self.recent_v), self.dims):
            x = torch.empty(len(blk), Hkv, dim, dtype=torch.float32, device=dev)
            b, o = blk[coded].to(dev), off[coded].to(dev)
            if scales.dim() == 1:  # one per kv head: (Hkv,) -> (1, Hkv, 1)
                s = scales.view(1, -1, 1)
            else:  # per token (slot o) or per channel (the page's one row)
                s = scales[b, o if scales.shape[1] > 1 else 0]
            x[coded.to(dev)] = kvquant.dequantize(codes[b, o], s, self.quant.kind)
            if len(kept):
                x[kept.to(dev)] = ring[blk[kept].to(dev), off[kept].to(dev)].float()
            out.append(x)
        return out[0], out[1]


def _head_scales(name: str, x: object, Hkv: int, device: torch.device) -> Tensor:
    """fp8's scale ``x`` (a float, or an ``(Hkv,)`` tensor: one per kv head) as fp16, checked
    positive and finite."""
    t = torch.as_tensor(x, dtype=torch.float32).reshape(-1).expand(Hkv) if (
        isinstance(x, (int, float)) or (isinstance(x, Tensor) and x.numel() == 1)) else x
    if not isinstance(t, Tensor) or tuple(t.shape) != (Hkv,):
        shown = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a float or an (Hkv,) = ({Hkv},) tensor, got {shown}")
    h = t.detach().to(torch.float16)
    if not bool((torch.isfinite(h) & (h > 0)).all()):
        raise ValueError(f"{name} {t.tolist()[:16]} must be positive and finite in fp16")
    return h.to(device)
