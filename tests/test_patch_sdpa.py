"""attn.patch_sdpa: third-party code's F.scaled_dot_product_attention routed to attn, and back.

The model test uses x-transformers, code nobody here wrote, which calls
``F.scaled_dot_product_attention`` with ``attn_flash=True``. The oracle is the same model in
float64 with its attention routed (by hand) to attn's float64 reference; the patched float32 model must
be within DESIGN.md's budget of plain torch's float32 error (2x on outputs, 3x on gradients).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attn
import attn.patch
from attn.sdpa import torch_sdpa
from attn.testing import make_inputs

TORCH_SDPA = F.scaled_dot_product_attention  # as this module was imported: torch's


@pytest.fixture(autouse=True)
def _torch_sdpa_restored():
    """Every test starts with torch's function and must leave it there."""
    assert F.scaled_dot_product_attention is TORCH_SDPA
    yield
    leaked = F.scaled_dot_product_attention is not TORCH_SDPA
    F.scaled_dot_product_attention = TORCH_SDPA
    assert not leaked, "a test left F.scaled_dot_product_attention patched"


@pytest.fixture
def dropin_calls(monkeypatch):
    """Counts calls of attn's drop-in made through the patch, independently of the patch's own
    ``calls`` counter."""
    calls = []
    dropin = attn.patch.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("backend"))
        return dropin(*args, **kwargs)
    monkeypatch.setattr(attn.patch, "scaled_dot_product_attention", spy)
    return calls


def _max_err(a: torch.Tensor, exact: torch.Tensor) -> float:
    return (a.double() - exact).abs().max().item()


def test_x_transformers_model_patched_matches_the_reference_within_budget(dropin_calls,
                                                                         monkeypatch):
    xt = pytest.importorskip("x_transformers")
    depth = 2
    torch.manual_seed(0)
    model = xt.TransformerWrapper(
        num_tokens=64, max_seq_len=64,
        attn_layers=xt.Decoder(dim=32, depth=depth, heads=4, attn_flash=True)).eval()
    tokens = torch.randint(0, 64, (2, 37))
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, 29:] = False  # right padding: a boolean attn_mask beside the causal one

    def run(m: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        m.zero_grad(set_to_none=True)
        # without a mask x-transformers passes is_causal=True; with one, its own bool mask
        logits = torch.cat([m(tokens), m(tokens, mask=mask)])
        (logits * torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)).sum().backward()
        return logits.detach(), [p.grad.detach().clone() for p in m.parameters()]

    plain_out, plain_grads = run(model)
    assert dropin_calls == []  # unpatched: torch's own
    with attn.patch_sdpa() as patch:
        assert F.scaled_dot_product_attention is not TORCH_SDPA
        ours_out, ours_grads = run(model)
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert dropin_calls == ["auto"] * 2 * depth and patch.calls == 2 * depth
    assert not patch.active

    # the oracle routes torch's name by hand, so a fault in patch_sdpa cannot reach it
    def reference_sdpa(*args, **kwargs):
        return attn.scaled_dot_product_attention(*args, backend="reference", **kwargs)
    with monkeypatch.context() as by_hand:
        by_hand.setattr(F, "scaled_dot_product_attention", reference_sdpa)
        exact_out, exact_grads = run(model.double())
    floor = 1e-6
    assert _max_err(ours_out, exact_out) <= 2 * _max_err(plain_out, exact_out) + floor
    for ours, plain, exact in zip(ours_grads, plain_grads, exact_grads):
        assert _max_err(ours, exact) <= 3 * _max_err(plain, exact) + floor


def test_a_plain_call_stays_on_until_restored(dropin_calls):
    q, k, v = make_inputs(1, 2, 17, 16, seed=1)
    patch = attn.patch_sdpa("tiled")
    try:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert dropin_calls == ["tiled"] and patch.active
    finally:
        patch.restore()
    patch.restore()  # a second restore does nothing
    assert F.scaled_dot_product_attention is TORCH_SDPA and not patch.active
    exact = torch_sdpa(q.double(), k.double(), v.double(), is_causal=True)
    assert _max_err(out, exact) < 1e-5


def test_restored_when_the_block_raises():
    with pytest.raises(KeyError):
        with attn.patch_sdpa():
            raise KeyError("inside")
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_nested_patches_restore_in_reverse_order_only():
    outer = attn.patch_sdpa()
    inner = attn.patch_sdpa("reference")
    with pytest.raises(RuntimeError, match="reverse order"):
        outer.restore()
    assert outer.active
    inner.restore()
    assert F.scaled_dot_product_attention is not TORCH_SDPA  # the outer one is still on
    outer.restore()
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_bad_backend_is_refused_before_patching():
    with pytest.raises(ValueError, match="backend must be one of"):
        attn.patch_sdpa("flash")
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_attns_sdpa_backend_and_bench_competitors_keep_calling_torch(dropin_calls):
    """Under the patch, attn's sdpa backend and the sweep's torch kernels still run torch's
    function: had they looked the name up, they would have recursed into attn (and a report
    would compare attn with itself)."""
    from attn.bench import competitors
    from attn.bench.sweep import SweepConfig, run_sweep

    q, k, v = make_inputs(1, 2, 33, 16, seed=2)
    exact = torch_sdpa(q.double(), k.double(), v.double(), is_causal=True)
    with attn.patch_sdpa() as patch:
        ours = attn.attention(q, k, v, causal=True, backend="sdpa")
        flash = competitors.make_forward("sdpa-flash", True, 33, "cpu")(q, k, v)
        rows = list(run_sweep(SweepConfig(n=(32,), backends=("sdpa",), heads=2, d=(16,),
                                          modes=("fwd",), measure_memory=False, warmup=0,
                                          repeats=1, min_repeats=1, budget_s=0.01,
                                          max_bytes=2**30)))
    assert dropin_calls == [] and patch.calls == 0
    assert [r.status for r in rows] == ["ok"]
    assert _max_err(ours, exact) < 1e-5 and _max_err(flash, exact) < 1e-5
