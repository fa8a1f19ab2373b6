"""The triton backend against the float64 reference, every variant, awkward sizes.

Without a GPU the kernels run in the Triton interpreter on CPU (TRITON_INTERPRET=1, set here
before triton is imported: triton reads it when a kernel is decorated). With a GPU the same
small-size suite runs on CUDA with compiled kernels; full sizes live in test_triton_cuda.py.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from functools import partial  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

import attn  # noqa: E402
from attn import flash_triton  # noqa: E402
from attn.api import AttentionCall, select_backend  # noqa: E402
from attn.testing import assert_close_to_reference, make_inputs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not flash_triton._INTERPRET:
    pytest.skip("attn.flash_triton was imported before TRITON_INTERPRET=1 was set (by an "
                "earlier module); run this file on its own", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
tri = partial(attn.attention, backend="triton")


def _ids(d):
    return str(d).removeprefix("torch.")


def _inputs(**kw):
    return make_inputs(device=DEVICE, **kw)


# -- sizes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(1, 1), (17, 17), (97, 97), (17, 97), (97, 17), (1, 128),
                                   (128, 1), (256, 256)])
def test_lengths(dtype, causal, nq, nk):
    q, k, v = _inputs(B=1, H=2, N=nq, Nk=nk, D=32, dtype=dtype, seed=nq * 1000 + nk)
    assert_close_to_reference(tri, q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("d,dv", [(16, 16), (40, 40), (80, 80), (128, 128), (256, 256),
                                  (64, 40)])
def test_head_dims(dtype, d, dv):
    # 40 and 80 are not powers of two: padded inside the kernel with masked loads
    q, k, v = _inputs(B=1, H=1, N=33, Nk=40, D=d, Dv=dv, dtype=dtype, seed=d)
    assert_close_to_reference(tri, q, k, v, causal=True)


# -- variants --------------------------------------------------------------------------------------

def _variant_kwargs(name: str, H: int, nq: int, nk: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(7)

    def dev(t):
        return t.to(DEVICE)

    if name == "plain":
        return {}
    if name == "softcap":
        return {"softcap": 2.0}
    if name == "softcap_learned":
        return {"softcap": dev(torch.tensor(3.0)).requires_grad_()}
    if name == "softcap_per_head":
        return {"softcap": dev(torch.rand(H, generator=g) * 4 + 1).requires_grad_()}
    if name == "sinks":
        return {"sinks": dev(torch.randn(H, generator=g)).requires_grad_()}
    if name == "window":
        return {"window": (7, 3)}
    if name == "window_left":
        return {"window": (12, -1)}
    if name == "temperature":
        return {"temperature": 0.7}
    if name == "temperature_tensor":
        return {"temperature": dev(torch.rand(H, generator=g) + 0.5).requires_grad_()}
    if name == "scale":
        return {"scale": 0.3}
    if name == "bool_mask":
        return {"attn_mask": dev(torch.rand(2, 1, nq, nk, generator=g) > 0.3)}
    if name == "padding_mask":
        m = torch.ones(2, 1, 1, nk, dtype=torch.bool)
        m[1, ..., nk // 2:] = False
        return {"attn_mask": dev(m)}
    if name == "float_mask":
        return {"attn_mask": dev(torch.randn(nq, nk, generator=g).to(dtype))}
    if name == "dropout":
        return {"dropout_p": 0.25}
    if name == "everything":
        return {"softcap": dev(torch.tensor(4.0)).requires_grad_(),
                "sinks": dev(torch.randn(H, generator=g)).requires_grad_(),
                "window": (20, 5),
                "temperature": dev(torch.rand(H, generator=g) + 0.5).requires_grad_(),
                "attn_mask": dev(torch.rand(nq, nk, generator=g) > 0.2),
                "dropout_p": 0.1}
    raise KeyError(name)


VARIANTS = ["plain", "softcap", "softcap_learned", "softcap_per_head", "sinks", "window",
            "window_left", "temperature", "temperature_tensor", "scale", "bool_mask",
            "padding_mask", "float_mask", "dropout", "everything"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_variants(dtype, causal, variant):
    H, nq, nk = 4, 45, 70
    q, k, v = _inputs(B=2, H=H, Hkv=2, N=nq, Nk=nk, D=32, dtype=dtype, seed=11)  # GQA
    kwargs = _variant_kwargs(variant, H, nq, nk, dtype)
    assert_close_to_reference(tri, q, k, v, causal=causal, **kwargs)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1), (6, 2)], ids=["mha", "gqa", "mqa", "gqa3"])
def test_gqa(heads):
    H, Hkv = heads
    q, k, v = _inputs(B=2, H=H, Hkv=Hkv, N=40, Nk=50, D=16, dtype=torch.float32, seed=H * Hkv)
    sinks = torch.randn(H, device=DEVICE).requires_grad_()
    assert_close_to_reference(tri, q, k, v, causal=True, sinks=sinks, softcap=5.0)


def test_dropout_equals_reference_mask():
    # the kernel regenerates attn.masks.dropout_keep bit for bit: with dropout as the only
    # randomness, triton and the reference agree to float32 rounding for the same seed
    q, k, v = _inputs(B=2, H=3, N=50, Nk=61, D=16, dtype=torch.float32, seed=3)
    outs = []
    for backend in ("triton", "reference"):
        torch.manual_seed(1234)
        outs.append(attn.attention(q, k, v, dropout_p=0.4, causal=True, backend=backend))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.manual_seed(1235)
    other = tri(q, k, v, dropout_p=0.4, causal=True)
    assert not torch.allclose(other, outs[0], atol=1e-3)


def test_non_contiguous_inputs():
    # (B, N, H, D) storage seen as (B, H, N, D), and a v whose head dim is strided
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 37, 4, 32, generator=g).to(DEVICE).transpose(1, 2)
    k = torch.randn(2, 45, 2, 32, generator=g).to(DEVICE).transpose(1, 2)
    v = torch.randn(2, 2, 45, 64, generator=g).to(DEVICE)[..., ::2]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    mask = torch.rand(37, 1, generator=g).to(DEVICE).expand(37, 45) > 0.1  # stride-0 columns
    assert_close_to_reference(tri, q, k, v, causal=True, attn_mask=mask)


# -- edge cases --------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_sinks", [False, True])
def test_fully_masked_rows(with_sinks):
    q, k, v = (t.requires_grad_() for t in _inputs(B=1, H=2, N=40, Nk=24, D=16, seed=2))
    mask = torch.ones(40, 24, dtype=torch.bool, device=DEVICE)
    mask[30] = False  # row 30 sees nothing through the mask
    sinks = (torch.tensor([0.5, -1.0], device=DEVICE).requires_grad_() if with_sinks else None)
    # causal bottom-right with Nq > Nk: rows 0..15 see no key either
    out, lse = tri(q, k, v, causal=True, attn_mask=mask, sinks=sinks, return_lse=True)
    dead = torch.zeros(40, dtype=torch.bool, device=DEVICE)
    dead[:16] = True
    dead[30] = True
    assert torch.isfinite(out).all()
    assert (out[:, :, dead] == 0).all()
    n_dead = int(dead.sum())
    expect = (sinks.detach().view(2, 1).expand(2, n_dead) if with_sinks
              else torch.full((2, n_dead), float("-inf"), device=DEVICE))
    assert torch.equal(lse[0][:, dead], expect)
    assert torch.isfinite(lse[:, :, ~dead]).all()
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    for t in (q, k, v) + ((sinks,) if with_sinks else ()):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, dead] == 0).all()
    assert_close_to_reference(tri, q, k, v, causal=True, attn_mask=mask, sinks=sinks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
def test_huge_logits(dtype):
    # scores of about 1e4: exp overflows anything that does not subtract the running max
    q, k, v = _inputs(B=1, H=2, N=65, D=16, dtype=dtype, seed=9)
    out = tri(q, k, v, scale=1e4 / 16)
    assert torch.isfinite(out).all()
    assert_close_to_reference(tri, q, k, v, scale=1e4 / 16, causal=True)


def test_single_query_single_key():
    q, k, v = _inputs(B=2, H=3, N=1, D=16, seed=1)
    out, lse = tri(q, k, v, return_lse=True)
    torch.testing.assert_close(out, v)  # softmax over one key is 1
    torch.testing.assert_close(lse, (q * k).sum(-1) * 16 ** -0.5)


@pytest.mark.parametrize("temperature", [1e-3, 1e3])
def test_temperature_limits(temperature):
    q, k, v = _inputs(B=1, H=2, N=17, Nk=23, D=16, dtype=torch.float32, seed=6)
    assert_close_to_reference(tri, q, k, v, temperature=temperature)


def test_forward_deterministic():
    q, k, v = _inputs(B=1, H=2, N=70, D=32, dtype=torch.bfloat16, seed=4)
    a = tri(q, k, v, causal=True)
    b = tri(q, k, v, causal=True)
    assert torch.equal(a, b)


# -- backend choice and its explanations -------------------------------------------------------------

def _call(**kw):
    base = dict(device="cuda", dtype=torch.bfloat16, head_dim=64, head_dim_v=64, n_q=128,
                n_k=128)
    return AttentionCall(**{**base, **kw})


def test_auto_picks_triton_on_cuda():
    assert flash_triton.unsupported_reason(_call()) is None
    assert select_backend(_call(), "auto").name == "triton"
    assert select_backend(_call(sinks=True, softcap="learned", dropout=True)).name == "triton"


@pytest.mark.parametrize("kw,words", [
    (dict(dtype=torch.float64), "float64"),
    (dict(head_dim=320, head_dim_v=320), "head dim"),
    (dict(mask="float", mask_grad=True), "attn_mask"),
    (dict(device="mps"), "mps"),
])
def test_unsupported_says_why(kw, words):
    why = flash_triton.unsupported_reason(_call(**kw))
    assert why is not None and words in why
    choice = select_backend(_call(**kw), "auto")
    assert choice.name == "tiled"
    with pytest.raises(NotImplementedError, match="triton"):
        select_backend(_call(**kw), "triton")


def test_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(flash_triton, "_INTERPRET", False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "CUDA" in flash_triton.unsupported_reason(_call(device="cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "before" in flash_triton.unsupported_reason(_call(device="cpu"))


# -- torch.library registration: fake tensors and torch.compile ------------------------------------

def _op_args(q, k, v):
    return (q, k, v, None, None, None, k.shape[2] - q.shape[2], None, 0, 0.25, 0.0, 0, [0, 0, 0, -1])


def test_opcheck_forward_and_backward():
    q, k, v = _inputs(B=1, H=4, Hkv=2, N=20, Nk=30, D=16, Dv=24, seed=0)
    torch.library.opcheck(torch.ops.attn.flash_fwd.default, _op_args(q, k, v))
    out, lse = torch.ops.attn.flash_fwd(*_op_args(q, k, v))
    do = torch.randn_like(out)
    torch.library.opcheck(torch.ops.attn.flash_bwd.default,
                          (do, None, q, k, v, out, lse, None, None, None,
                           k.shape[2] - q.shape[2], None, 0, 0.25, 0.0, 0, [0, 0, 0, -1], False))
    sinks = torch.randn(q.shape[1], device=DEVICE)
    torch.library.opcheck(torch.ops.attn.flash_bwd.default,
                          (do, None, q, k, v, out, lse, None, sinks, None,
                           k.shape[2] - q.shape[2], None, 0, 0.25, 0.0, 0, [0, 0, 0, -1], False))


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 100, 64, dtype=torch.bfloat16, device=DEVICE)
        k = torch.empty(2, 2, 300, 64, dtype=torch.bfloat16, device=DEVICE)
        v = torch.empty(2, 2, 300, 48, dtype=torch.bfloat16, device=DEVICE)
        out, lse = torch.ops.attn.flash_fwd(*_op_args(q, k, v))
        assert out.shape == (2, 8, 100, 48) and out.dtype == torch.bfloat16
        assert lse.shape == (2, 8, 100) and lse.dtype == torch.float32


class _TinyAttention(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.sinks = torch.nn.Parameter(torch.zeros(heads))

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        out = attn.attention(q, k, v, causal=True, sinks=self.sinks, softcap=20.0,
                             backend="triton")  # (B, H, N, C/H)
        return out.transpose(1, 2).reshape(B, N, C)


def test_torch_compile_matches_eager():
    torch.manual_seed(0)
    model = _TinyAttention(32, 2).to(DEVICE)
    x = torch.randn(2, 40, 32, device=DEVICE)
    eager = model(x)
    eager.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # aot_eager traces through the fake implementations and AOT autograd; inductor would
    # only add codegen around the opaque custom ops
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, eager)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g)
