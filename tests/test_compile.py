"""torch.compile(fullgraph=True) traces attention with learnable tensor variants, no graph break."""

import pytest
import torch

import attn


class _Learned(torch.nn.Module):
    """Per-head temperature, a learned softcap and sinks: every tensor-valued variant."""

    def __init__(self, heads: int, backend: str) -> None:
        super().__init__()
        self.backend = backend
        self.temperature = torch.nn.Parameter(torch.linspace(0.6, 1.4, heads))
        self.softcap = torch.nn.Parameter(torch.tensor(4.0))
        self.sinks = torch.nn.Parameter(torch.linspace(-1.0, 1.0, heads))

    def forward(self, q, k, v):
        return attn.attention(q, k, v, causal=True, temperature=self.temperature,
                              softcap=self.softcap, sinks=self.sinks, backend=self.backend)


@pytest.mark.parametrize("backend", ["tiled", "triton"])
def test_fullgraph_compile_matches_eager(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 37, 16, generator=g)
    k = torch.randn(2, 2, 37, 16, generator=g)
    v = torch.randn(2, 2, 37, 16, generator=g)
    eager = _Learned(4, backend)
    compiled = torch.compile(_Learned(4, backend), fullgraph=True, backend="aot_eager")

    outs, grads = [], []
    for m in (eager, compiled):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out = m(*x)
        out.backward(torch.ones_like(out))
        outs.append(out)
        grads.append([t.grad for t in x] + [p.grad for p in m.parameters()])
    torch.testing.assert_close(outs[1], outs[0])
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("grad", [False, True])
def test_fullgraph_compile_of_several_blocks_with_and_without_grad(grad):
    """Past one block of rows (the epilogue writes into slices of the outputs) and with
    nothing to differentiate (dynamo then calls the Function's forward itself): the tiled
    call traces whole, as `auto` runs it under torch.compile on CPU."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 2, 300, 16, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    x = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    compiled = torch.compile(lambda q, k, v: attn.attention(q, k, v, causal=True),
                             fullgraph=True, backend="aot_eager")
    out = compiled(*x)
    want = attn.attention(q, k, v, causal=True, backend="tiled")
    torch.testing.assert_close(out, want)
    if grad:
        out.sum().backward()
        y = [t.clone().requires_grad_() for t in (q, k, v)]
        attn.attention(*y, causal=True, backend="tiled").sum().backward()
        for a, b in zip(x, y):
            torch.testing.assert_close(a.grad, b.grad)
