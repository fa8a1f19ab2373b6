"""attn.nn: QK-norm, RoPE, temperature, sinks and the MultiHeadAttention KV-cache path."""

from __future__ import annotations

import math

import pytest
import torch

import attn.nn as nn_module
from attn.decoding import decode
from attn.nn import (QK_NORM_KINDS, AttentionOptions, MultiHeadAttention, QKNorm, QKNormConfig,
                     RotaryEmbedding, default_l2_scale)
from attn.models.cache import KVCache
from attn.models.config import AttentionConfig

# Every attention variant the module offers, each alone, plus everything at once.
VARIANTS = {
    "plain": dict(),
    "gqa": dict(kv_heads=2),
    "mqa": dict(kv_heads=1),
    "l2-before": dict(qk_norm="l2"),
    "l2-after": dict(qk_norm=QKNormConfig("l2", position="after", g_init=3.0)),
    "rms-before": dict(qk_norm="rms"),
    "rms-after": dict(qk_norm=QKNormConfig("rms", position="after")),
    "layer-before": dict(qk_norm="layer"),
    "layer-after": dict(qk_norm=QKNormConfig("layer", position="after")),
    "temperature": dict(temperature=0.7),
    "learned-temperature": dict(temperature=1.3, learn_temperature=True),
    "softcap": dict(softcap=2.0),
    "learned-softcap": dict(softcap=2.0, learn_softcap=True),
    "window": dict(window=3),
    "sinks": dict(sinks=True),
    "no-rope": dict(rope=False),
    "everything": dict(kv_heads=2, qk_norm="rms", temperature=0.8, learn_temperature=True,
                       softcap=3.0, window=4, sinks=True),
}


def _mha(seed: int = 0, dim: int = 32, heads: int = 4, **kw) -> MultiHeadAttention:
    """A float64 module whose every parameter is random, so gains, g, τ and sinks matter;
    causal unless told (the decoder these tests mostly check)."""
    kw.setdefault("causal", True)
    torch.manual_seed(seed)
    m = MultiHeadAttention(dim, heads, **kw).double()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("weight") and p.dim() == 1:  # norm gains around 1
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name in ("qk_norm.g", "log_tau", "log_softcap", "sinks"):
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    return m.eval()


@pytest.mark.parametrize("backend", ["reference", "tiled", "auto"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_decoding_matches_full_forward(variant: str, backend: str, monkeypatch) -> None:
    """With backend "auto" the cached steps read the cache's pages through attn.decode
    (counted), except where a learned temperature or softcap needs attn.attention."""
    calls = []
    monkeypatch.setattr(nn_module, "decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    m = _mha(backend=backend, **VARIANTS[variant])
    B, N = 2, 11
    x = torch.randn(B, N, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(x)  # (B, N, C)
        cache = KVCache(B, m.kv_heads, N, m.head_dim, torch.float64)
        # prefill 5 tokens, one chunk of 3, then one token at a time
        pieces = [m(x[:, :5], cache), m(x[:, 5:8], cache)]
        pieces += [m(x[:, i:i + 1], cache) for i in range(8, N)]
    cached = torch.cat(pieces, dim=1)
    assert cache.length == N
    torch.testing.assert_close(cached, full, rtol=1e-12, atol=1e-12)
    learned = (m.log_tau is not None or m.log_softcap is not None
               or isinstance(m.scale, torch.Tensor))
    assert len(calls) == (0 if backend != "auto" or learned else 2 + N - 8)


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_decoding_window_and_causal_actually_restrict(backend: str) -> None:
    """The cache test above would pass with a mask that ignores the past; check that the
    last query's output changes when a key it may see changes, and not otherwise."""
    m = _mha(backend=backend, window=3)
    x = torch.randn(1, 10, 32, dtype=torch.float64)
    with torch.no_grad():
        base = m(x)[:, -1]
        for j, visible in ((9, True), (6, True), (5, False), (0, False)):
            y = x.clone()
            y[:, j] += 1.0
            changed = not torch.allclose(m(y)[:, -1], base, rtol=0, atol=1e-12)
            assert changed == visible, f"key {j}"


def _finite_difference(f, p: torch.nn.Parameter, i: int, h: float = 1e-6) -> float:
    with torch.no_grad():
        flat = p.view(-1)
        old = flat[i].item()
        flat[i] = old + h
        up = f().item()
        flat[i] = old - h
        down = f().item()
        flat[i] = old
    return (up - down) / (2 * h)


@pytest.mark.parametrize("backend", ["reference", "tiled"])
@pytest.mark.parametrize("variant,param", [
    ("l2-before", "qk_norm.g"), ("l2-after", "qk_norm.g"),
    ("rms-before", "qk_norm.q_weight"), ("rms-after", "qk_norm.k_weight"),
    ("layer-before", "qk_norm.q_weight"), ("layer-after", "qk_norm.k_weight"),
    ("learned-temperature", "log_tau"), ("learned-softcap", "log_softcap"), ("sinks", "sinks"),
    ("everything", "log_tau"), ("everything", "sinks"), ("everything", "qk_norm.q_weight"),
])
def test_gradient_reaches_variant_parameter(variant: str, param: str, backend: str) -> None:
    """Autograd's gradient of every learnable variant parameter equals a central finite
    difference of the loss (float64), through attn.attention's backward."""
    m = _mha(backend=backend, **VARIANTS[variant])
    x = torch.randn(2, 9, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    w = torch.randn(2, 9, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def loss() -> torch.Tensor:
        return (m(x) * w).sum()

    p = dict(m.named_parameters())[param]
    loss().backward()
    assert p.grad is not None and torch.isfinite(p.grad).all()
    assert p.grad.abs().max() > 1e-6, "gradient is zero: the parameter does not reach the loss"
    for i in range(min(p.numel(), 4)):
        fd = _finite_difference(loss, p, i)
        assert p.grad.view(-1)[i].item() == pytest.approx(fd, rel=1e-5, abs=1e-7), i


def test_learned_temperature_is_positive_and_matches_fixed() -> None:
    """τ = exp(log τ) stays positive for any log τ, and a learned τ equal on all heads gives
    the same output as the same fixed temperature."""
    learned = _mha(temperature=0.5, learn_temperature=True)
    fixed = _mha(temperature=0.5)
    fixed.load_state_dict({k: v for k, v in learned.state_dict().items() if k != "log_tau"})
    with torch.no_grad():
        learned.log_tau.fill_(math.log(0.5))
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    torch.testing.assert_close(learned(x), fixed(x), rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        learned.log_tau.fill_(-50.0)  # a huge negative step must not make τ <= 0
    assert torch.isfinite(learned(x)).all()


def test_qk_norm_l2_gives_norm_g_and_default_scale() -> None:
    norm = QKNorm(QKNormConfig("l2", train_len=128), head_dim=16)
    assert norm.g.item() == pytest.approx(math.log2(128 * 128 - 128))
    assert default_l2_scale(128) == pytest.approx(math.log2(16256))
    q, k = torch.randn(2, 4, 5, 16) * 7, torch.randn(2, 2, 5, 16) * 0.1
    qn, kn = norm(q, k)
    torch.testing.assert_close(qn.norm(dim=-1), torch.full((2, 4, 5), norm.g.item()))
    torch.testing.assert_close(kn.norm(dim=-1), torch.ones(2, 2, 5))
    assert norm.attention_scale == 1.0


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_qk_norm_rms_and_layer_statistics(kind: str) -> None:
    torch.manual_seed(0)
    norm = QKNorm(kind, head_dim=16)
    with torch.no_grad():
        norm.q_weight.copy_(torch.rand(16) + 0.5)
        norm.k_weight.copy_(torch.rand(16) + 0.5)
    q, k = torch.randn(2, 4, 5, 16) * 3 + 1, torch.randn(2, 2, 5, 16) * 0.2 - 2
    qn, kn = norm(q, k)
    for x, w in ((qn, norm.q_weight), (kn, norm.k_weight)):
        u = x / w  # undo the per-dim gain, shared across heads
        if kind == "rms":
            torch.testing.assert_close(u.pow(2).mean(-1), torch.ones(u.shape[:-1]), rtol=1e-4,
                                       atol=1e-4)
        else:
            torch.testing.assert_close(u.mean(-1), torch.zeros(u.shape[:-1]), atol=1e-5,
                                       rtol=0)
            torch.testing.assert_close(u.var(-1, unbiased=False), torch.ones(u.shape[:-1]),
                                       rtol=1e-4, atol=1e-4)
    assert norm.attention_scale is None


def test_qk_norm_computes_in_float32() -> None:
    """bf16 in, bf16 out, but normalised in float32: closer to the float64 result than
    normalising in bf16 would be."""
    torch.manual_seed(0)
    norm = QKNorm("rms", head_dim=64)
    q = torch.randn(1, 2, 8, 64) * 100
    exact, _ = norm(q.double(), q.double())
    low, _ = norm(q.bfloat16(), q.bfloat16())
    assert low.dtype == torch.bfloat16
    qb = q.bfloat16()
    naive = qb * torch.rsqrt(qb.pow(2).mean(-1, keepdim=True) + 1e-6)  # all in bf16
    err_ours = (low.double() - exact).abs().max()
    err_naive = (naive.double() - exact).abs().max()
    assert err_ours <= err_naive


def test_rope_scores_depend_only_on_relative_position() -> None:
    rope = RotaryEmbedding(16).double()
    q = torch.randn(1, 1, 1, 16, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 16, dtype=torch.float64)
    s = [(rope(q, offset=a + 3) * rope(k, offset=a)).sum().item() for a in (0, 5, 100)]
    assert s[0] == pytest.approx(s[1], rel=1e-12) and s[0] == pytest.approx(s[2], rel=1e-12)
    assert s[0] != pytest.approx((q * k).sum().item(), rel=1e-3)  # it does rotate


def test_dropout_only_in_training() -> None:
    m = _mha(dropout=0.5)
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    m.eval()
    torch.testing.assert_close(m(x), m(x), rtol=0, atol=0)
    m.train()
    torch.manual_seed(0)
    a = m(x)
    torch.manual_seed(1)
    assert not torch.allclose(a, m(x))


@pytest.mark.parametrize("build,match", [
    (lambda: MultiHeadAttention(30, 4), "heads must divide dim"),
    (lambda: MultiHeadAttention(32, 4, kv_heads=3), "kv_heads must divide heads"),
    (lambda: MultiHeadAttention(32, 4, qk_norm="cosine"), "qk_norm kind must be one of"),
    (lambda: MultiHeadAttention(32, 4, qk_norm=QKNormConfig("rms", position="middle")),
     "position must be one of"),
    (lambda: MultiHeadAttention(32, 4, temperature=0.0), "temperature must be a positive"),
    (lambda: MultiHeadAttention(32, 4, backend="flash"), "backend must be one of"),
    (lambda: MultiHeadAttention(32, 4, learn_softcap=True), "learn_softcap needs softcap"),
    (lambda: MultiHeadAttention(32, 4, window=(2, -3)), "window must be an int or a pair"),
    (lambda: MultiHeadAttention(32, 4, dropout=1.0), "dropout must be in"),
], ids=["heads", "kv_heads", "qk_norm", "position", "temperature", "backend", "softcap",
        "window", "dropout"])
def test_bad_config_fails_at_construction(build, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


def test_cache_rejects_overflow_and_non_causal() -> None:
    m = _mha()
    cache = KVCache(1, m.kv_heads, 4, m.head_dim, torch.float64)
    m(torch.randn(1, 4, 32, dtype=torch.float64), cache)
    with pytest.raises(ValueError, match="overflow"):
        m(torch.randn(1, 1, 32, dtype=torch.float64), cache)
    bidirectional = _mha(causal=False)
    with pytest.raises(ValueError, match="needs causal"):
        bidirectional(torch.randn(1, 2, 32, dtype=torch.float64),
                      KVCache(1, 4, 4, 8, torch.float64))


def test_learned_softcap_starts_at_softcap_and_matches_fixed() -> None:
    fresh = MultiHeadAttention(32, 4, softcap=2.0, learn_softcap=True)
    torch.testing.assert_close(fresh.log_softcap.exp(), torch.full((4,), 2.0))
    learned = _mha(softcap=2.0, learn_softcap=True)
    fixed = _mha(softcap=2.0)
    fixed.load_state_dict({k: v for k, v in learned.state_dict().items() if k != "log_softcap"})
    with torch.no_grad():
        learned.log_softcap.fill_(math.log(2.0))
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    torch.testing.assert_close(learned(x), fixed(x), rtol=1e-12, atol=1e-12)


def test_options_object_and_keywords_build_the_same_module() -> None:
    """``options=`` and keywords are two spellings of one thing; keywords override options;
    a QKNormConfig is unpacked into the qk_norm_* fields."""
    opts = AttentionOptions(heads=4, kv_heads=2, qk_norm="l2", qk_norm_g_init=3.0,
                            learn_temperature=True, temperature=0.5, softcap=4.0,
                            learn_softcap=True, window=3, sinks=True, dropout=0.1,
                            causal=True, backend="tiled", bias=True)
    a = MultiHeadAttention(32, options=opts)
    b = MultiHeadAttention(32, **{f: getattr(opts, f) for f in opts.__dataclass_fields__})
    assert a.options == b.options == opts
    assert {k: v.shape for k, v in a.state_dict().items()} == \
        {k: v.shape for k, v in b.state_dict().items()}
    assert a.qk_norm.g.item() == 3.0 and a.window == (3, 0) and a.qkv.bias is not None
    c = MultiHeadAttention(32, options=opts, causal=False, heads=8)
    assert c.window == (3, 3) and c.heads == 8 and opts.heads == 4
    d = MultiHeadAttention(32, 4, qk_norm=QKNormConfig("rms", position="after", eps=1e-5))
    assert (d.options.qk_norm, d.options.qk_norm_position, d.options.qk_norm_eps) == \
        ("rms", "after", 1e-5)
    assert d.qk_norm.config == QKNormConfig("rms", position="after", eps=1e-5)
    with pytest.raises(TypeError, match="qk_norm_position"):
        MultiHeadAttention(32, 4, qk_norm=QKNormConfig("rms"), qk_norm_position="after")
    with pytest.raises(TypeError, match="unexpected keyword"):
        MultiHeadAttention(32, 4, window_size=3)


def test_rope_fp32_stays_accurate_at_large_positions() -> None:
    """fp32 RoPE against the rotation written out in float64, at positions up to ~1M. Rounding
    the angle pos·θ to fp32 before cos/sin costs pos·eps radians (3e-2 at 1M); cos and sin
    taken in float64 leave only fp32's own rounding of a 2-term product sum."""
    D = 64
    rope = RotaryEmbedding(D)
    x = torch.randn(1, 2, 5, D, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 8191, 131071, 999_983, 1 << 20])
    got = rope(x, offset=pos)
    theta = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos.double()[:, None] * theta  # (N, D/2)
    x1, x2 = x.double().chunk(2, dim=-1)
    want = torch.cat((x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()), -1)
    # cos and sin rounded (eps/2 each), two products and one sum rounded: under 2 eps·(|x1|+|x2|)
    bound = 2 * torch.finfo(torch.float32).eps * (x1.abs() + x2.abs()).repeat(1, 1, 1, 2)
    assert bool(((got.double() - want).abs() <= bound).all())
    # per-row positions (B, N), as packed documents that straddle rows have
    pos2 = torch.stack([pos, pos.flip(0)])
    got2 = rope(x.expand(2, -1, -1, -1), offset=pos2)
    torch.testing.assert_close(got2[0], got[0], rtol=0, atol=0)
    torch.testing.assert_close(got2[1], rope(x, offset=pos.flip(0))[0], rtol=0, atol=0)


def test_unbatched_and_empty_inputs_like_torch() -> None:
    """(N, C) is one sequence, returned as (N, C), like torch.nn.MultiheadAttention; N = 0 or
    B = 0 gives an empty result of the right shape."""
    m = _mha()
    x = torch.randn(7, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(m(x), m(x[None])[0], rtol=0, atol=0)
    cache = KVCache(1, m.kv_heads, 7, m.head_dim, torch.float64)
    torch.testing.assert_close(m(x[:4], cache), m(x[:4]), rtol=0, atol=0)
    for shape in ((0, 32), (2, 0, 32), (0, 5, 32)):
        x0 = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
        y = m(x0)
        assert y.shape == shape and y.dtype == torch.float64
        y.sum().backward()
        assert x0.grad.shape == shape


def test_bad_input_names_the_argument_and_shapes() -> None:
    m = _mha()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"32, got x of shape \(2, 5, 31\)"):
        m(x[..., :31])
    with pytest.raises(ValueError, match=r"x .*\(1, 2, 5, 32\)"):
        m(x[None])
    with pytest.raises(TypeError, match=r"x .*float32.*float64"):
        m(x.float())
    with pytest.raises(TypeError, match=r"x .*int64"):
        m(x.long())
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        m(x.tolist())
    # the packed offsets are named as the caller passed them, not as varlen's cu_seqlens_q
    for cu, err in ((torch.tensor([0, 5, 9]), ValueError),
                    (torch.tensor([0, 3, 10.0]), TypeError),
                    (torch.tensor([0, 6, 5, 10]), ValueError),
                    (torch.tensor([[0, 10]]), ValueError)):
        with pytest.raises(err, match=r"cu_seqlens (?!_)") as info:
            m(x, cu_seqlens=cu)
        assert "cu_seqlens_q" not in str(info.value)
    with pytest.raises(ValueError, match=r"KVCache .*\(1, 4, 10, 8\).*\(2, 4, 5, 8\)"):
        m(x, KVCache(1, 4, 10, 8, torch.float64))
    with pytest.raises(TypeError, match=r"KVCache .*float32.*float64"):
        m(x, KVCache(2, 4, 10, 8, torch.float32))
    with pytest.raises(ValueError, match=r"RotaryEmbedding.*head_dim 16.*x .*\(1, 1, 3, 8\)"):
        RotaryEmbedding(16)(torch.randn(1, 1, 3, 8))
    with pytest.raises(ValueError, match=r"offset .*\(4,\)"):
        RotaryEmbedding(8)(torch.randn(1, 1, 3, 8), offset=torch.arange(4))
    for kind in QK_NORM_KINDS:
        norm = QKNorm(kind, 16)
        with pytest.raises(ValueError, match=r"QKNorm.*head_dim 16.*q .*\(1, 1, 3, 8\)"):
            norm(torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 16))
        with pytest.raises(ValueError, match=r"k .*\(1, 1, 3, 8\)"):
            norm(torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 8))


@pytest.mark.parametrize("eps", [0.0, -1e-6, float("nan"), float("inf")])
def test_qk_norm_eps_must_be_positive_and_finite(eps: float) -> None:
    with pytest.raises(ValueError, match="eps"):
        QKNormConfig("rms", eps=eps)
    with pytest.raises(ValueError, match="eps"):
        MultiHeadAttention(32, 4, qk_norm="layer", qk_norm_eps=eps)


def test_heads_defaults_to_the_documented_value() -> None:
    assert MultiHeadAttention(32).heads == AttentionOptions().heads == 4
    assert "4" in MultiHeadAttention.__doc__


def test_defaults_are_torchs_non_causal_and_the_repr_shows_them() -> None:
    """Built from its defaults, MultiHeadAttention is an encoder's, as torch's
    nn.MultiheadAttention is: the first position sees the last (the output at 0 moves with
    x at N - 1). The toy GPT's AttentionConfig stays causal. The repr names causal and rope."""
    m = MultiHeadAttention(32).double().eval()
    x = torch.randn(1, 6, 32, dtype=torch.float64)
    x2 = x.clone()
    x2[:, -1] += 1.0
    with torch.no_grad():
        moved = (m(x2) - m(x))[0, 0].abs().max().item()
    assert moved > 1e-3, "position 0 ignored the last one: the default is causal"
    text = repr(m)
    assert "causal=False" in text and "rope=True" in text and "heads=4" in text, text
    assert "causal=True" in repr(MultiHeadAttention(32, causal=True))
    assert AttentionConfig().causal and not AttentionOptions().causal
    with pytest.raises(ValueError, match="causal=True"):
        m(x, KVCache(1, m.kv_heads, 8, m.head_dim, torch.float64))
