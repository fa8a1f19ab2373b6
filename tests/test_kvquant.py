"""attn.kvquant's formats against their formulas, written out here in float64: int8 / int4
codes and fp16 scales, int4's nibble packing, e4m3 bytes (decoded bit by bit, and rounded to
the nearest e4m3 value), KIVI's per-channel scales, and the bytes a token costs."""

from __future__ import annotations

import pytest
import torch

from attn import kvquant
from attn.kvquant import KVQuant

# the formats the cache and decode tests (test_kvcache.py, test_decode.py) run: each kind,
# groups along D, KIVI's per-channel keys with two full-precision pages, and a window of one
FORMATS = {
    "int8": KVQuant("int8"),
    "int8 g32": KVQuant("int8", group=32),
    "int4": KVQuant("int4"),
    "fp8": KVQuant("fp8_e4m3"),
    "int4 kivi": KVQuant("int4", k_per_channel=True, recent_pages=2),
    "int8 recent": KVQuant("int8", group=32, recent_pages=1),
    "int8 t recent": KVQuant("int8", recent_pages=1),  # per token: scales fold into the GEMMs
}


def sample(*shape, seed=0):
    """Values with a spread of magnitudes per row (so groups differ), a zero group included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(2 * torch.randn(*shape[:-1], 1, generator=g))
    x[0, ..., :32] = 0.0  # an all-zero group: scale 0, codes 0, no NaN
    return x


def int_oracle(x: torch.Tensor, qmax: int, group: int):
    """code = round(x / s) clamped to ±qmax, s = fp16(amax / qmax) per group, in float64."""
    xg = x.double().unflatten(-1, (x.shape[-1] // group, group))
    s = (xg.abs().amax(-1, keepdim=True) / qmax).half().double()
    codes = torch.round(xg / torch.where(s > 0, s, 1.0)).clamp(-qmax, qmax)
    return codes.flatten(-2).long(), s.squeeze(-1).half()


@pytest.mark.parametrize("kind,group", [("int8", None), ("int8", 32), ("int4", 32),
                                        ("int4", 16)])
def test_int_codes_and_scales_follow_the_formula(kind, group):
    x = sample(5, 3, 64)
    codes, scales = kvquant.quantize(x, kind, group)
    qmax = 127 if kind == "int8" else 7
    want, want_s = int_oracle(x, qmax, group or 64)
    assert scales.dtype == torch.float16 and torch.equal(scales, want_s)
    if kind == "int4":
        assert codes.dtype == torch.uint8 and codes.shape == (5, 3, 32)
        # byte i holds element 2i in its low nibble and 2i + 1 in its high one, each + 8
        assert torch.equal(codes.long(), (want[..., 0::2] + 8) + 16 * (want[..., 1::2] + 8))
        assert torch.equal(kvquant.unpack_int4(codes).long(), want)
    else:
        assert codes.dtype == torch.int8 and torch.equal(codes.long(), want)
    # dequantized = code · s exactly, within half a step of x (a zero group stays zero)
    deq = kvquant.dequantize(codes, scales, kind)
    s = want_s.double().repeat_interleave(group or 64, -1)
    assert torch.equal(deq.double(), want.double() * s)
    assert bool(((deq.double() - x.double()).abs() <= 0.5 * s + 1e-3 * s).all())
    assert bool((deq[0, ..., :32] == 0).all())


def test_dequantize_into_a_low_precision_buffer_rounds_once():
    x = sample(4, 2, 64)
    codes, scales = kvquant.quantize(x, "int8", 32)
    exact = kvquant.dequantize(codes, scales, "int8")
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        out = torch.empty(4, 2, 64, dtype=dtype)
        kvquant.dequantize(codes, scales, "int8", out=out)
        assert torch.equal(out, exact.to(dtype))


def test_per_channel_scales_span_a_pages_tokens():
    x = sample(3, 16, 2, 64)  # (pages, page, Hkv, D)
    codes, scales = kvquant.quantize_channels(x, "int4")
    assert scales.shape == (3, 1, 2, 64)
    # the oracle with the token axis last: one group of 16 tokens per (page, head, channel)
    want, want_s = int_oracle(x.permute(0, 2, 3, 1), 7, 16)
    assert torch.equal(scales, want_s.permute(0, 3, 1, 2))
    assert torch.equal(kvquant.unpack_int4(codes).long(), want.permute(0, 3, 1, 2))
    deq = kvquant.dequantize(codes, scales, "int4")
    assert torch.equal(deq.double(), want.permute(0, 3, 1, 2).double()
                       * want_s.permute(0, 3, 1, 2).double())


def test_e4m3_bytes_decode_by_arithmetic():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = kvquant.e4m3_to_float(b)
    nan = (b & 127) == 127
    assert nan.sum() == 2 and got[nan].isnan().all()
    # by hand: 0x38 = 0 0111 000 = 1.0; 0x01 = 2^-9 (the smallest subnormal); 0x7e = 448
    assert got[0x38] == 1.0 and got[0x01] == 2.0 ** -9 and got[0x7E] == 448.0
    assert got[0xB8] == -1.0 and got[0x08] == 2.0 ** -6 and got[0x3C] == 1.5
    # and torch's own e4m3fn decode agrees on every other byte
    assert torch.equal(got[~nan], b.view(torch.float8_e4m3fn).float()[~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_codes_gives_each_codes_number_up_to_the_factor_it_returns(dtype):
    """What the tiled read keeps in its buffer when the scales fold into the GEMMs: every
    code's number (e4m3's by arithmetic, int8 as is, int4 unpacked), divided by the returned
    power of two. fp8: every byte but the two NaNs, which the quantizer never writes."""
    fp8 = torch.arange(256, dtype=torch.uint8)
    fp8 = fp8[(fp8 & 127) != 127].view(2, 127)
    int8 = torch.arange(-127, 128, dtype=torch.int8).view(5, 51)
    int4 = kvquant.pack_int4(torch.arange(-7, 8).repeat(4).view(2, 30))
    cases = ((fp8, "fp8_e4m3", kvquant.e4m3_to_float(fp8)), (int8, "int8", int8.float()),
             (int4, "int4", kvquant.unpack_int4(int4).float()))
    for codes, kind, want in cases:
        out = torch.empty(want.shape, dtype=dtype)
        unit = kvquant.decode_codes(codes, kind, out=out)
        assert torch.equal(out.double() * unit, want.double()), kind


def test_fp8_rounds_to_the_nearest_e4m3_value_and_saturates():
    x = sample(6, 2, 64, seed=1) * 10
    x[1, 0, :3] = torch.tensor([1e4, -1e4, 5000.0])  # past 448 · scale: saturate
    scale = torch.tensor([1.0, 4.0], dtype=torch.float16)  # one per kv head
    codes = kvquant.quantize_fp8(x, scale)
    assert codes.dtype == torch.uint8
    deq = kvquant.dequantize(codes, scale.view(1, -1, 1), "fp8_e4m3")
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    grid = kvquant.e4m3_to_float(b)
    grid = grid[~grid.isnan()].double()
    y = (x.double() / scale.double().view(-1, 1)).clamp(-448, 448)
    nearest = (y.unsqueeze(-1) - grid).abs().amin(-1)  # distance to the nearest grid value
    got = deq.double() / scale.double().view(-1, 1)
    assert torch.equal((got - y).abs(), nearest)
    assert got[1, 0, :3].tolist() == [448.0, -448.0, 448.0]


def test_bad_values_and_formats_are_refused():
    x = torch.randn(2, 64)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"k \(2, 64\) holds non-finite values"):
        kvquant.quantize(x, "int8", name="k")
    with pytest.raises(ValueError, match=r"past fp16's 65504"):
        kvquant.quantize(torch.full((1, 32), 1e7), "int8", name="k")
    with pytest.raises(ValueError, match=r"quant kind must be one of"):
        KVQuant("int3")
    with pytest.raises(ValueError, match=r"int4 packs two codes per byte: its group must be "
                                         r"even, got 7"):
        KVQuant("int4", group=7)
    with pytest.raises(ValueError, match=r"fp8_e4m3 has one scale per kv head"):
        KVQuant("fp8_e4m3", group=32)
    with pytest.raises(ValueError, match=r"pass recent_pages >= 1"):
        KVQuant("int8", k_per_channel=True)
    with pytest.raises(ValueError, match=r"int4 groups of 32 must divide head_dim = 40"):
        KVQuant("int4").check_dims(40, 64)
    assert KVQuant("int4").group == 32


def test_bytes_per_token_at_the_issue_shapes():
    """The issue's targets at Hkv = 8, D = 128, Nk = 16k, fp16 scales, no full-precision
    window: int8 <= 0.27x fp32, int4 <= 0.15x; the formula, term by term."""
    Hkv, D, page = 8, 128, 16
    fp32 = kvquant.bytes_per_token(None, Hkv, D, page_size=page)
    assert fp32 == Hkv * 2 * D * 4
    int8 = kvquant.bytes_per_token(KVQuant("int8"), Hkv, D, page_size=page)
    assert int8 == Hkv * 2 * (D + 2)  # a byte per element, one fp16 scale per token and head
    int8_g = kvquant.bytes_per_token(KVQuant("int8", group=32), Hkv, D, page_size=page)
    assert int8_g == Hkv * 2 * (D + 2 * D // 32)
    int4 = kvquant.bytes_per_token(KVQuant("int4"), Hkv, D, page_size=page)
    assert int4 == Hkv * 2 * (D // 2 + 2 * D // 32)
    fp8 = kvquant.bytes_per_token(KVQuant("fp8_e4m3"), Hkv, D, page_size=page)
    assert fp8 == Hkv * 2 * D
    kivi = kvquant.bytes_per_token(KVQuant("int4", k_per_channel=True, recent_pages=2), Hkv, D,
                                   page_size=page)
    assert kivi == Hkv * (D // 2 + 2 * D / page) + Hkv * (D // 2 + 2 * D // 32)
    assert int8 / fp32 <= 0.27 and int8_g / fp32 <= 0.27 and int4 / fp32 <= 0.15
    # a full-precision window of 2 pages, averaged over 16k tokens
    n = 16384
    windowed = kvquant.bytes_per_token(KVQuant("int8", recent_pages=2), Hkv, D, page_size=page,
                                       n_tokens=n)
    assert windowed == (int8 * (n - 32) + fp32 * 32) / n
