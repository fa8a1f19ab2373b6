"""The fused CPU path of the tiled backend (``ATTN_TILED_COMPILE=1``): the per-tile steps
compiled with torch.compile. Exact to the same budget as the eager steps, no recompiles when
N varies, one warning and the eager path when compiling fails, and a switch that says which
path ran. The wide variant matrix runs on the eager path elsewhere; here a few shapes share
the compiled graphs (each compiles once per process)."""

from __future__ import annotations

import warnings

import pytest
import torch

import attn
from attn import AttentionCall, select_backend, tiled
from attn.testing import assert_close_to_reference

# The first torch.compile of a process imports torch.utils.mkldnn (through inductor), whose
# ScriptModules use torch's own deprecated torch.jit.script_method: 14 DeprecationWarnings
# that no code here can act on, and that would bury one that it can.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning:torch\.jit")

BM, BN = 16, 32  # small tiles: full tiles and ragged edges in one call


def _inputs(B=2, H=4, Hkv=2, Nq=45, Nk=70, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, D, generator=g)
    k = torch.randn(B, Hkv, Nk, D, generator=g)
    v = torch.randn(B, Hkv, Nk, D, generator=g)
    return q, k, v


def _tiled(**fixed):
    def fn(q, k, v, **kw):
        return attn.attention(q, k, v, backend="tiled", block_m=BM, block_n=BN, **fixed, **kw)
    return fn


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setenv("ATTN_TILED_COMPILE", "1")
    monkeypatch.setattr(tiled.steps, "_COMPILED_FAILED", None)
    calls = []
    real = tiled.attention._run_compiled

    def counting(fn, *args):
        out = real(fn, *args)
        calls.append(out is not None)
        return out
    monkeypatch.setattr(tiled.attention, "_run_compiled", counting)
    return calls


CASES = {
    "plain-causal": dict(causal=True),
    "gqa-window-sinks": dict(window=(9, 4), sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])),
    "softcap-mask": dict(softcap=5.0, attn_mask=torch.rand(45, 70) > 0.3),
    "learned-softcap": dict(softcap=torch.full((4,), 3.0, requires_grad=True), causal=True),
    "alibi": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]), causal=True),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fused_matches_reference(fused, case):
    q, k, v = _inputs(seed=hash(case) % 1000)
    assert_close_to_reference(_tiled(), q, k, v, **CASES[case])
    assert fused and all(fused), "the fused steps did not run"


def test_fused_dropout_equals_eager(fused, monkeypatch):
    # the same seed draws the same mask on both paths; eager is tested against the reference
    q, k, v = (t.requires_grad_() for t in _inputs(seed=4))
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("ATTN_TILED_COMPILE", flag)
        torch.manual_seed(7)
        out = _tiled()(q, k, v, dropout_p=0.3, causal=True)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        outs.append((out, *grads))
    assert fused and all(fused)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


def test_fused_bfloat16_and_float64(fused):
    for dtype in (torch.bfloat16, torch.float64):
        q, k, v = (t.to(dtype) for t in _inputs(seed=5))
        assert_close_to_reference(_tiled(), q, k, v, causal=True)


def test_no_recompile_when_n_varies(fused):
    from torch._dynamo.utils import counters

    def run(n, b=1):
        q, k, v = (t.requires_grad_() for t in _inputs(B=b, H=4, Hkv=4, Nq=n, Nk=n, seed=n))
        attn.attention(q, k, v, backend="tiled", block_m=BN, block_n=BN,
                       causal=False).sum().backward()

    # square full tiles first (rows == cols == 32 on every tile, as with the default
    # 256 x 256 blocks at N = 4096): ragged edges and batch sizes must not recompile
    run(64)
    graphs, compiled = counters["stats"]["unique_graphs"], len(tiled.steps._COMPILED)
    for n, b in ((77, 1), (50, 2), (129, 3), (300, 1), (97, 2)):  # 129, 97: 1-wide edges
        run(n, b)
    assert counters["stats"]["unique_graphs"] == graphs, "a new sequence length recompiled"
    assert len(tiled.steps._COMPILED) == compiled


def test_compile_failure_warns_once_and_falls_back(fused, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no working C++ compiler (simulated)")
    monkeypatch.setattr(tiled.steps, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", broken)
    q, k, v = _inputs(seed=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_close_to_reference(_tiled(), q, k, v, causal=True)
        attn.attention(q, k, v, backend="tiled")
    ours = [w for w in caught if "compiled tiled steps could not run" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)
    assert "simulated" in str(ours[0].message)
    call = AttentionCall(device="cpu", dtype=torch.float32, head_dim=16, head_dim_v=16, n_q=8, n_k=8)
    assert "failed earlier" in select_backend(call, "tiled").reason


def test_switch_and_reason(monkeypatch):
    call = AttentionCall(device="cpu", dtype=torch.float32, head_dim=16, head_dim_v=16, n_q=8, n_k=8)
    monkeypatch.setattr(tiled.steps, "_COMPILED_FAILED", None)
    monkeypatch.setenv("ATTN_TILED_COMPILE", "0")
    assert "eager" in select_backend(call, "tiled").reason
    monkeypatch.setenv("ATTN_TILED_COMPILE", "1")
    assert "compiled tiled steps" in select_backend(call, "tiled").reason
    cuda = AttentionCall(device="cuda", dtype=torch.float32, head_dim=16, head_dim_v=16,
                         n_q=8, n_k=8)
    assert "CPU only" in select_backend(cuda, "tiled").reason
    monkeypatch.setenv("ATTN_TILED_COMPILE", "yes")
    with pytest.raises(ValueError, match="ATTN_TILED_COMPILE"):
        select_backend(call, "tiled")
    monkeypatch.delenv("ATTN_TILED_COMPILE")
    assert ("compiled tiled steps" in select_backend(call, "tiled").reason) \
        == tiled.COMPILED_DEFAULT


def test_eager_path_runs_no_compiled_step(monkeypatch):
    monkeypatch.setenv("ATTN_TILED_COMPILE", "0")
    monkeypatch.setattr(tiled.attention, "_run_compiled", lambda *a: pytest.fail("fused step ran"))
    q, k, v = _inputs(seed=8)
    assert_close_to_reference(_tiled(), q, k, v, causal=True)


# -- batch chunks: a call whose score tile passes tile_bytes runs batch row by batch row ----

CHUNK_CASES = {
    "dropout-gqa": dict(dropout_p=0.25, causal=True),
    "float-mask-per-batch": dict(attn_mask=torch.randn(3, 1, 45, 70), window=(20, 5)),
    "bool-mask-broadcast": dict(attn_mask=torch.rand(45, 70) > 0.4),
    "alibi-bh-sinks-softcap": dict(alibi_slopes=torch.rand(3, 4), causal=True,
                                   sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]),
                                   softcap=torch.full((4,), 4.0, requires_grad=True)),
}


@pytest.mark.parametrize("case", list(CHUNK_CASES), ids=list(CHUNK_CASES))
def test_batch_chunks_match_one_call(monkeypatch, case):
    kw = dict(CHUNK_CASES[case])
    q, k, v = _inputs(B=3, seed=11)
    mask = kw.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kw["attn_mask"] = mask.requires_grad_()
    leaves = [t for t in (q, k, v, kw.get("attn_mask"), kw.get("sinks"), kw.get("softcap"))
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    for t in leaves:
        t.requires_grad_()
    results = []
    real = tiled._plan
    for tile_bytes in (1 << 40, 1):  # one call; then one batch row per chunk
        config = tiled.TileConfig(tile_bytes=tile_bytes)
        assert len(real(q, k, tiled.LaunchSpec(qk_scale=1.0), config=config).chunks) == \
            (1 if tile_bytes > 1 else 3)
        # the launchers plan the call below with this config
        monkeypatch.setattr(tiled.attention, "_plan",
                            lambda q, k, spec, v=None, _config=None, config=config, **kw:
                            real(q, k, spec, v, config, **kw))
        torch.manual_seed(3)
        out, lse = _tiled()(q, k, v, return_lse=True, **kw)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, 16)).sum() + lse.sum(), leaves)
        results.append((out, lse, *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    if "dropout_p" not in kw:  # and the chunked call against the float64 reference
        assert_close_to_reference(_tiled(), q.detach(), k.detach(), v.detach(),
                                  **{n: (t.detach() if isinstance(t, torch.Tensor) else t)
                                     for n, t in kw.items()})
