"""bf16 and fp16 on the CPU backends (tiled, fused) meet flash-attn's own test criterion:
the output, the lse and every gradient within 2x the error of plain PyTorch in the same dtype
(both against float64), on shapes of flash-attn's test suite (DESIGN: "Accuracy in
bf16/fp16")."""

import math

import pytest
import torch

import attn
from attn.tiled import gemm

# (B, H, Nq, Nk, D, causal, seed): flash-attn's lengths and head dims; the seeds include
# inputs where tile products rounded to bf16 (ATTN_TILED_BF16_GEMM=1) pass 2x
FLASH_CASES = [(1, 12, 128, 128, 111, False, 0), (4, 6, 113, 203, 59, True, 0),
               (2, 6, 128, 217, 128, False, 5), (2, 6, 256, 128, 64, False, 4),
               (2, 6, 256, 128, 64, False, 6)]


def _plain(q, k, v, causal):
    """Plain PyTorch in the inputs' dtype, as flash-attn's tests' attention_ref(upcast=False):
    scores, softmax and products each rounded to the dtype."""
    s = q @ (k / math.sqrt(q.shape[-1])).transpose(-2, -1)
    if causal:  # bottom-right, attn's and flash-attn's convention
        Nq, Nk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(Nq, Nk, dtype=torch.bool).tril(Nk - Nq), float("-inf"))
    return s.softmax(-1) @ v, s.float().logsumexp(-1).to(s.dtype)


def _out_and_grads(fn, inputs, do, dtype):
    """out, lse, dq, dk, dv of ``fn`` (which returns out and lse) in ``dtype``; the
    gradients through out alone."""
    x = [t.to(dtype).requires_grad_() for t in inputs]
    out, lse = fn(*x)
    return (out, lse, *torch.autograd.grad(out, x, do.to(dtype)))


# fp16 tiles are always upcast: one seed per shape is enough there
DTYPED = [(c, torch.bfloat16) for c in FLASH_CASES] + \
    [(c, torch.float16) for c in FLASH_CASES if c[-1] == 0]


@pytest.mark.parametrize("backend", ["tiled", "fused"])
@pytest.mark.parametrize("case,dtype", DTYPED,
                         ids=["-".join(map(str, c)) + f"-{str(d)[6:]}" for c, d in DTYPED])
def test_low_precision_meets_flash_attn_criterion(monkeypatch, case, dtype, backend):
    monkeypatch.delenv("ATTN_TILED_BF16_GEMM", raising=False)  # the default path
    B, H, Nq, Nk, D, causal, seed = case
    g = torch.Generator().manual_seed(seed)
    # inputs exact in the low dtype, so float64 sees what the kernels see
    q, k, v, do = (torch.randn(B, H, n, D, generator=g).to(dtype).double()
                   for n in (Nq, Nk, Nk, Nq))
    exact = _out_and_grads(lambda *x: _plain(*x, causal), (q, k, v), do, torch.float64)
    plain = _out_and_grads(lambda *x: _plain(*x, causal), (q, k, v), do, dtype)
    ours_all = _out_and_grads(lambda *x: attn.attention(*x, causal=causal, backend=backend,
                                                        return_lse=True),
                              (q, k, v), do, dtype)
    for name, ours, theirs, ref, floor in zip(("out", "lse", "dq", "dk", "dv"), ours_all,
                                              plain, exact, (1e-5, 1e-5, 1e-4, 1e-4, 2e-4)):
        err = (ours.double() - ref).abs().max().item()
        budget = 2 * (theirs.double() - ref).abs().max().item() + floor
        assert err <= budget, f"{name}: {err:.4g} > 2x plain PyTorch's error + floor {budget:.4g}"


def test_bf16_tile_gemms_are_opt_in(monkeypatch):
    """bf16 tile GEMMs round each product to bf16: only ATTN_TILED_BF16_GEMM=1 asks for
    them, and only where oneDNN has bf16 kernels."""
    q = torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)
    monkeypatch.setattr(gemm, "_native_bf16", lambda: True)
    monkeypatch.delenv("ATTN_TILED_BF16_GEMM", raising=False)
    assert not gemm.low_gemms(q)
    monkeypatch.setenv("ATTN_TILED_BF16_GEMM", "1")
    assert gemm.low_gemms(q) and not gemm.low_gemms(q.float())
    monkeypatch.setattr(gemm, "_native_bf16", lambda: False)
    assert not gemm.low_gemms(q)
