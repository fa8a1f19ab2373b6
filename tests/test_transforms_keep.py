"""The tiled double backward's kernel for plain CPU tensors (``attn.tiled.double._PlainHvp``)
under every keep budget: pass 1's tiles kept for pass 2 whole, as p·a alone (p recomputed),
or not at all, mixed within one query block; in float64 against the reference backend."""

from __future__ import annotations

import pytest
import torch

import attn
from attn.tiled import double

F64 = torch.float64
TILE = 4 * 128 * 64 * 8  # bytes of one full tile: 4 query heads x 128 rows x 64 keys, fp64


def _randn(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=F64, generator=g)


def _step(backend, q, k, v, dropout_p):
    """A gradient penalty's gradients: create_graph=True gradients, then their gradient."""
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(7)  # the same dropout mask on every call
    out, lse = attn.attention(*xs, causal=True, dropout_p=dropout_p, backend=backend,
                              return_lse=True)
    g = torch.autograd.grad((out ** 2).sum() + lse.sum(), xs, create_graph=True)
    return torch.autograd.grad(sum((x * torch.cos(x)).sum() for x in g), xs)


# 300 rows in query blocks of 128 over key tiles of 64: the blocks have 2, 4 and 5 tiles. In
# full tiles, 3 keep p·a of 3 of the middle block's 4 (the 4th recomputed whole), 7 keep p·a
# of all 4 and p of 3 (the 4th recomputes p); keeping all or none: test_transforms.py's
# test_double_backward_over_many_tiles
@pytest.mark.parametrize("keep_tiles", [3, 7])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_every_keep_budget_matches_the_reference(monkeypatch, keep_tiles, dropout_p):
    calls = []
    block = double._PlainHvp.block

    def spy(self, *args):
        calls.append(args[0])
        return block(self, *args)

    monkeypatch.setattr(double._PlainHvp, "block", spy)
    monkeypatch.setattr(double, "_HVP_BLOCKS", (128, 64))
    monkeypatch.setattr(double, "_KEEP_BYTES", keep_tiles * TILE)
    n = 300
    q, k, v = _randn(1, 4, n, 8, seed=70), _randn(1, 2, n, 8, seed=71), _randn(1, 2, n, 8,
                                                                            seed=72)
    want = _step("reference", q, k, v, dropout_p)
    got = _step("tiled", q, k, v, dropout_p)
    assert calls, "the double backward did not take _PlainHvp"
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
