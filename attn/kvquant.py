"""Quantized KV-cache formats: what a code means, how values become codes and back, and what a
token costs in bytes. Nothing here knows about pages or sequences.

``int8``, ``int4`` (two per byte) and ``fp8_e4m3`` (bytes, :func:`e4m3_to_float`), keys
optionally per channel (KIVI, Liu et al. 2024: :func:`quantize_channels`). The formats, why
``code · s`` is exact, and the bytes per token: docs/kvcache.md, "Quantized caches".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["KINDS", "KVQuant", "bytes_per_token", "check_finite", "decode_codes", "dequantize",
           "e4m3_to_float", "pack_int4", "quantize", "quantize_channels", "quantize_fp8",
           "unpack_int4"]

KINDS = ("int8", "int4", "fp8_e4m3")
_QMAX = {"int8": 127, "int4": 7}
FP8_MAX = 448.0  # the largest finite e4m3fn value
_FP16_MAX = torch.finfo(torch.float16).max


@dataclass(frozen=True)
class KVQuant:
    """How a :class:`attn.kvcache.PagedKVCache` stores its keys and values.

    ``kind``: ``"int8"``, ``"int4"`` or ``"fp8_e4m3"``. ``group``: elements of the head dim
    per scale (``None``: the whole head dim; int4 defaults to 32; fp8 has one scale per kv
    head and takes none). ``k_per_channel``: keys scaled per channel over each page's tokens
    (KIVI), quantized once a page has left the full-precision window, so it needs
    ``recent_pages >= 1``. ``recent_pages``: each sequence's most recent pages (its partial
    last page among them) stay in the cache's storage dtype; older pages are quantized as
    they leave that window.
    """

    kind: str = "int8"
    group: int | None = None
    k_per_channel: bool = False
    recent_pages: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"quant kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "int4" and self.group is None:
            object.__setattr__(self, "group", 32)
        if self.group is not None:
            if not isinstance(self.group, int) or isinstance(self.group, bool) or self.group < 1:
                raise ValueError(f"quant group must be a positive int or None, got "
                                 f"{self.group!r}")
            if self.kind == "fp8_e4m3":
                raise ValueError("fp8_e4m3 has one scale per kv head: pass no group")
            if self.kind == "int4" and self.group % 2:
                raise ValueError(f"int4 packs two codes per byte: its group must be even, got "
                                 f"{self.group}")
        if self.k_per_channel and self.kind == "fp8_e4m3":
            raise ValueError("k_per_channel scales int8 / int4 keys; fp8_e4m3 has per-head "
                             "scales")
        if (not isinstance(self.recent_pages, int) or isinstance(self.recent_pages, bool)
                or self.recent_pages < 0):
            raise ValueError(f"recent_pages must be an int >= 0, got {self.recent_pages!r}")
        if self.k_per_channel and self.recent_pages < 1:
            raise ValueError("k_per_channel quantizes a page once it is full, so the partial "
                             "last page must stay in full precision: pass recent_pages >= 1")

    @property
    def int8_per_token(self) -> bool:
        """int8 keys with one scale per token and kv head (no group, not per channel): the
        format ``attn.decode(quantized_q=True)`` scores by integer products."""
        return self.kind == "int8" and self.group is None and not self.k_per_channel

    def group_of(self, dim: int) -> int:
        """Elements per scale along a head dim of ``dim`` (fp8's per-head scale: all of it)."""
        return dim if self.group is None else self.group

    def check_dims(self, head_dim: int, head_dim_v: int) -> None:
        """ValueError unless the head dims split into this format's groups."""
        for name, d in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
            g = self.group_of(d)
            if d % g or (self.kind == "int4" and d % 2):
                raise ValueError(f"{self.kind} groups of {g} must divide {name} = {d}")

    def code_dim(self, dim: int) -> int:
        """Bytes per token and head of a head dim of ``dim``: two int4 codes share one."""
        return dim // 2 if self.kind == "int4" else dim


def pack_int4(codes: Tensor) -> Tensor:
    """int codes ``(…, D)`` in ``[-7, 7]`` → uint8 ``(…, D / 2)``: ``2i`` low, ``2i + 1`` high,
    each plus 8."""
    nib = (codes.to(torch.int16) + 8).to(torch.uint8)
    return nib[..., 0::2] | (nib[..., 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 ``(…, D / 2)`` → int8 codes ``(…, D)``."""
    lo = (packed & 15).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    # (…, D/2, 2) -> (…, D): element 2i from the low nibble, 2i + 1 from the high one
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def e4m3_to_float(codes: Tensor) -> Tensor:
    """uint8 bytes of e4m3fn numbers → float32, by arithmetic on the bits (sign, 4 exponent
    bits of bias 7, 3 mantissa bits; exponent 0 is subnormal, ``0x7f`` / ``0xff`` NaN): what
    a kernel without an fp8 type does."""
    b = codes.to(torch.int32)
    sign = 1.0 - 2.0 * (b >> 7).float()
    exp, man = (b >> 3) & 15, (b & 7).float()
    normal = (1.0 + man / 8.0) * torch.exp2(exp.float() - 7.0)
    value = torch.where(exp == 0, man * 2.0 ** -9, normal)
    value = torch.where((b & 127) == 127, float("nan"), value)
    return sign * value


def _decode(codes: Tensor, kind: str) -> Tensor:
    """Codes as numbers (before the scale): int8 as they are, int4 unpacked, fp8 as float32."""
    if kind == "int4":
        return unpack_int4(codes)
    if kind == "fp8_e4m3":
        return codes.view(torch.float8_e4m3fn).float()  # torch's cast = e4m3_to_float (tested)
    return codes


@functools.cache
def _e4m3_table(device: torch.device) -> Tensor:
    """The 256 e4m3fn values as float32, indexed by their byte (a lookup reads a byte
    faster than torch's own fp8 cast on CPU: docs/benchmarks.md), made once per device."""
    return e4m3_to_float(torch.arange(256, dtype=torch.uint8, device=device))


def _decode_into(codes: Tensor, kind: str, out: Tensor) -> None:
    """Codes as numbers written straight into float32 ``out`` (same leading shape,
    contiguous): no float32 temporary the size of the range."""
    if kind == "int8":
        out.copy_(codes)
    elif kind == "int4":  # element 2i from the low nibble, 2i + 1 from the high one
        out[..., 0::2].copy_(codes & 15)
        out[..., 1::2].copy_(codes >> 4)
        out.sub_(8)
    else:
        torch.index_select(_e4m3_table(codes.device), 0, codes.flatten().int(),
                           out=out.view(-1))


def decode_codes(codes: Tensor, kind: str, *, out: Tensor) -> float:
    """Codes ``(…, Dc)`` as the numbers they stand for before their scale (int4 unpacked,
    fp8 bytes as their e4m3 values), written into ``out (…, D)`` (any float dtype) divided
    by the returned power of two: exact, as every code is an integer below 2^8 or an e4m3
    value (3 mantissa bits). Multiply the scales by the factor returned.

    fp8 into float32 takes the bytes' bits as float16 bits (sign to the top, exponent and
    mantissa shifted by 7: an e4m3 number read with float16's exponent bias, 8 more than
    e4m3's, is its value times 2^-8, subnormals included) and returns 256: four integer and
    conversion passes, faster on CPU than a 256-entry lookup (docs/benchmarks.md). It reads
    the bytes :func:`quantize_fp8` writes, which are never the NaN bytes 0x7f / 0xff (it
    saturates)."""
    if kind == "fp8_e4m3" and out.dtype == torch.float32:
        t = codes.view(torch.int8).to(torch.int16)  # sign-extended: 0x80 | m -> 0xff80 | m
        torch.bitwise_left_shift(t, 7, out=t)  # m (7 bits) to bits 7..13, the sign to 15 (and 14)
        t.bitwise_and_(-16385)  # 0xbfff: clear bit 14, set by the sign extension
        out.copy_(t.view(torch.float16))
        return 256.0
    if out.dtype == torch.float32 and out.is_contiguous():
        _decode_into(codes, kind, out)
    else:  # int8's codes are their numbers: _decode hands them back as they are
        out.copy_(_decode(codes, kind))
    return 1.0


def dequantize(codes: Tensor, scales: Tensor, kind: str, *, out: Tensor | None = None
               ) -> Tensor:
    """``code · scale`` as float32 (or into ``out``, any float dtype, rounded once).

    ``codes (…, T, Hkv, Dc)``; ``scales`` fp16 ``(…, T or 1, Hkv, G)``: G groups of the head
    dim per token (or one per token and head), G = D channels over the tokens (per channel),
    or ``(1, Hkv, 1)`` per head. Leading dims broadcast."""
    G = scales.shape[-1]
    if (out is not None and out.dtype == torch.float32 and out.is_contiguous()
            and out.shape[:-1] == codes.shape[:-1]):  # the tiled items' case: in place
        _decode_into(codes, kind, out)
        out.unflatten(-1, (G, out.shape[-1] // G)).mul_(scales.float().unsqueeze(-1))
        return out
    x = _decode(codes, kind)
    # (…, D) -> (…, G, D / G): each group times its scale
    x = x.unflatten(-1, (G, x.shape[-1] // G))
    s = scales.float().unsqueeze(-1)
    if out is None:
        return torch.mul(x, s).flatten(-2)
    view = out.unflatten(-1, (G, out.shape[-1] // G))
    if out.dtype == torch.float32:
        torch.mul(x, s, out=view)
    else:  # exact in float32, then rounded once to out's dtype
        view.copy_(torch.mul(x, s))
    return out


def check_finite(name: str, x: Tensor) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} {tuple(x.shape)} holds non-finite values: a quantized cache "
                         f"stores finite values only")


def _symmetric(x: Tensor, amax: Tensor, kind: str, name: str, shape: tuple[int, ...]
               ) -> tuple[Tensor, Tensor]:
    """int codes of ``x`` scaled by ``amax / qmax`` (amax broadcastable to x), and the fp16
    scales; ``name`` and ``shape``: the caller's tensor, for messages."""
    qmax = _QMAX[kind]
    big = float(amax.max()) / qmax if amax.numel() else 0.0
    if big != big or big == float("inf"):  # max(|x|) is NaN or inf exactly when x is
        raise ValueError(f"{name} {shape} holds non-finite values: a quantized cache stores "
                         f"finite values only")
    if big > _FP16_MAX:
        raise ValueError(f"{name}: |values| up to {big * qmax:.3g} need {kind} scales past "
                         f"fp16's {_FP16_MAX:.0f}")
    scales = (amax.float() / qmax).to(torch.float16)
    s = scales.float()
    # a zero scale (a group of zeros, or amax below fp16's range) gives codes 0
    codes = torch.round(x.float() / torch.where(s > 0, s, 1.0)).clamp_(-qmax, qmax)
    codes = codes.to(torch.int8)
    return (pack_int4(codes) if kind == "int4" else codes), scales


def quantize(x: Tensor, kind: str, group: int | None = None, *, name: str = "x"
             ) -> tuple[Tensor, Tensor]:
    """int8 / int4 codes of ``x (…, D)`` with one scale per ``group`` elements of its last dim
    (None: all D) → codes ``(…, Dc)`` (int8, or uint8 two per byte for int4) and fp16 scales
    ``(…, D / group)``. ValueError (naming ``name``) for non-finite values."""
    g = x.shape[-1] if group is None else group
    # (…, D) -> (…, G, group): one amax per group
    xg = x.unflatten(-1, (x.shape[-1] // g, g))
    codes, scales = _symmetric(xg, xg.abs().amax(-1, keepdim=True), kind, name,
                               tuple(x.shape))
    return codes.flatten(-2), scales.squeeze(-1)


def quantize_channels(x: Tensor, kind: str, *, name: str = "x") -> tuple[Tensor, Tensor]:
    """int8 / int4 codes of full pages ``x (pages, page, Hkv, D)`` with one scale per
    (page, head, channel) over the page's tokens (KIVI's keys) → codes ``(pages, page, Hkv,
    Dc)`` and fp16 scales ``(pages, 1, Hkv, D)``."""
    return _symmetric(x, x.abs().amax(1, keepdim=True), kind, name, tuple(x.shape))


def quantize_fp8(x: Tensor, scale: Tensor, *, name: str = "x") -> Tensor:
    """e4m3fn bytes (uint8) of ``x (…, Hkv, D) / scale`` with ``scale (Hkv,)`` fp16, rounded to
    the nearest e4m3 value (ties to even), saturating at ±448."""
    check_finite(name, x)
    s = scale.float().view(-1, 1)
    y = (x.float() / torch.where(s > 0, s, 1.0)).clamp_(-FP8_MAX, FP8_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def bytes_per_token(quant: KVQuant | None, heads_kv: int, head_dim: int,
                    head_dim_v: int | None = None, *, page_size: int,
                    storage_bytes: int = 4, n_tokens: int | None = None) -> float:
    """Bytes a cached token costs (its keys and values, all kv heads, scales included).

    Unquantized: ``Hkv · (D + Dv) · storage_bytes``. Quantized: code bytes plus 2 bytes per
    fp16 scale: per token ``Hkv · D / group`` of them, per channel ``Hkv · D`` per page
    (``/ page_size`` per token), per head none (a fixed ``2 · Hkv`` per cache). With a
    full-precision window and ``n_tokens`` given, the sequence's last ``recent_pages``
    pages cost ``storage_bytes`` per element: the average over ``n_tokens`` tokens."""
    Dv = head_dim if head_dim_v is None else head_dim_v
    full = heads_kv * (head_dim + Dv) * storage_bytes
    if quant is None:
        return float(full)

    def side(dim: int, per_channel: bool) -> float:
        codes = quant.code_dim(dim)
        if quant.kind == "fp8_e4m3":
            return codes
        if per_channel:
            return codes + 2 * dim / page_size
        return codes + 2 * dim // quant.group_of(dim)

    per = heads_kv * (side(head_dim, quant.k_per_channel) + side(Dv, False))
    if n_tokens is None or quant.recent_pages == 0:
        return per
    recent = min(n_tokens, quant.recent_pages * page_size)
    return (per * (n_tokens - recent) + full * recent) / n_tokens
