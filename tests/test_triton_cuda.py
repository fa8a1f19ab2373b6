"""The compiled triton kernels on a GPU: full sizes, half precisions, determinism, tiny N.

Every test carries ``@pytest.mark.cuda`` and skips cleanly without a GPU (tests/conftest.py).
Run: ``python -m pytest tests/test_triton_cuda.py -q`` on a CUDA machine (TRITON_INTERPRET
unset, or the kernels would be interpreted).
"""

from functools import partial

import pytest
import torch

pytest.importorskip("triton")

import attn  # noqa: E402
from attn.testing import assert_close_to_reference, make_inputs  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

tri = partial(attn.attention, backend="triton")
HALF = [torch.float16, torch.bfloat16]


def _ids(d):
    return str(d).removeprefix("torch.")


def _inputs(**kw):
    return make_inputs(device="cuda", **kw)


@pytest.fixture(autouse=True)
def _compiled_kernels():
    from attn import flash_triton

    if flash_triton._INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 in this process: run this file without the "
                    "interpreter tests (python -m pytest tests/test_triton_cuda.py)")


@pytest.mark.parametrize("dtype", HALF + [torch.float32], ids=_ids)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,d", [(1025, 64), (2048, 128), (1000, 80), (512, 256)])
def test_full_sizes(dtype, causal, n, d):
    q, k, v = _inputs(B=2, H=4, N=n, D=d, dtype=dtype, seed=n + d)
    assert_close_to_reference(tri, q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", HALF, ids=_ids)
@pytest.mark.parametrize("nq,nk", [(1, 4096), (4096, 1), (777, 2049), (2049, 777)])
def test_rectangular(dtype, nq, nk):
    q, k, v = _inputs(B=1, H=4, Hkv=1, N=nq, Nk=nk, D=64, dtype=dtype, seed=nq)
    assert_close_to_reference(tri, q, k, v, causal=True)


@pytest.mark.parametrize("dtype", HALF, ids=_ids)
def test_all_variants_together(dtype):
    H, n = 8, 1500
    g = torch.Generator().manual_seed(0)
    q, k, v = _inputs(B=2, H=H, Hkv=2, N=n, D=64, dtype=dtype, seed=1)
    kwargs = {"softcap": torch.tensor(30.0, device="cuda", requires_grad=True),
              "sinks": torch.randn(H, generator=g).cuda().requires_grad_(),
              "window": (300, 20),
              "temperature": (torch.rand(H, generator=g) + 0.5).cuda().requires_grad_(),
              "attn_mask": (torch.rand(n, n, generator=g) > 0.1).cuda(),
              "dropout_p": 0.1}
    assert_close_to_reference(tri, q, k, v, causal=True, **kwargs)


@pytest.mark.parametrize("dtype", HALF, ids=_ids)
def test_forward_bitwise_deterministic(dtype):
    q, k, v = _inputs(B=2, H=8, N=4096, D=128, dtype=dtype, seed=2)
    first = tri(q, k, v, causal=True)
    for _ in range(5):
        assert torch.equal(tri(q, k, v, causal=True), first)


def test_backward_deterministic():
    # no atomics anywhere: dK/dV over query tiles, dQ over key tiles
    q, k, v = (t.requires_grad_() for t in _inputs(B=1, H=8, Hkv=2, N=2048, D=64,
                                                    dtype=torch.bfloat16, seed=3))
    grads = []
    for _ in range(3):
        tri(q, k, v, causal=True).sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(g, grads[0]))


@pytest.mark.parametrize("dtype", HALF, ids=_ids)
@pytest.mark.parametrize("n", [1, 2, 5, 17])
@pytest.mark.parametrize("causal", [False, True])
def test_tiny_lengths_no_nan_gradients(dtype, n, causal):
    q, k, v = (t.requires_grad_() for t in _inputs(B=2, H=4, N=n, D=64, dtype=dtype, seed=n))
    sinks = torch.zeros(4, device="cuda", requires_grad=True)
    out, lse = tri(q, k, v, causal=causal, sinks=sinks, return_lse=True)
    (out.float().sum() + lse.sum()).backward()
    for t in (q, k, v, sinks):
        assert torch.isfinite(t.grad).all()
    assert_close_to_reference(tri, q, k, v, causal=causal)


class _TinyAttention(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        out = attn.attention(q, k, v, causal=True, backend="triton")  # (B, H, N, C/H)
        return out.transpose(1, 2).reshape(B, N, C)


def test_torch_compile_inductor():
    torch.manual_seed(0)
    model = _TinyAttention(64, 4).cuda()
    x = torch.randn(2, 300, 64, device="cuda")
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True)  # inductor around the opaque custom ops
    out = compiled(x)
    torch.testing.assert_close(out, eager)
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
