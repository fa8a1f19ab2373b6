"""Eager triton calls run the launchers as they are; what traces a call goes through the
custom ops (issue 39: host work per call). In plain eager mode an op adds only
its dispatch, so both routes must give the same bits, and the op must still be taken where
something needs it: a dispatch mode, fake tensors (torch.compile, make_fx). (Under
torch.func the forward runs on the unwrapped tensors below the transform: plain again.)"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

import attn  # noqa: E402
from attn.flash_triton import launch  # noqa: E402
from attn.testing import assert_close_to_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.cuda_if_present, pytest.mark.skipif(
    DEVICE == "cpu" and not launch._INTERPRET,
    reason="attn.flash_triton was imported before TRITON_INTERPRET=1 was set")]

OPS = ("_fwd_op", "_bwd_op", "_fwd_split_op")


@pytest.fixture
def op_calls(monkeypatch):
    """The names of the custom ops a call went through, in order."""
    calls = []
    for name in OPS:
        def spy(*args, _real=getattr(launch, name), _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(launch, name, spy)
    return calls


def _qkv(n_q=40, n_k=33, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, n, 16, generator=g).to(DEVICE).requires_grad_()
            for n in (n_q, n_k, n_k)]


def _step(q, k, v, **kw):
    out, lse = attn.attention(q, k, v, backend="triton", return_lse=True, **kw)
    grads = torch.autograd.grad((out * out).sum() + lse.sum(), (q, k, v))
    return (out, lse, *grads)


def test_eager_calls_skip_the_ops_and_match_the_op_route_bit_for_bit(op_calls, monkeypatch):
    q, k, v = _qkv()
    kw = dict(causal=True, sinks=torch.randn(2, device=DEVICE))
    direct = _step(q, k, v, **kw)
    assert op_calls == []
    out = attn.attention(q, k, v, backend="triton", causal=True)
    assert type(out.grad_fn).__name__ == "_FlashAttentionEagerBackward"
    monkeypatch.setattr(launch, "_direct", lambda *tensors: False)
    via_ops = _step(q, k, v, **kw)
    assert op_calls == ["_fwd_op", "_bwd_op"]
    for a, b in zip(direct, via_ops):
        assert torch.equal(a, b)
    assert_close_to_reference(lambda *a, **k_: attn.attention(*a, backend="triton", **k_),
                              *(t.detach() for t in (q, k, v)), causal=True)


def test_a_decode_call_skips_the_split_op(op_calls, monkeypatch):
    monkeypatch.setenv("ATTN_TRITON_SPLIT_KV", "4")
    q, k, v = (t.detach() for t in _qkv(n_q=1, n_k=300, seed=1))
    out = attn.attention(q, k, v, backend="triton")
    assert op_calls == []
    monkeypatch.setattr(launch, "_direct", lambda *tensors: False)
    assert torch.equal(out, attn.attention(q, k, v, backend="triton"))
    assert op_calls == ["_fwd_split_op"]


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_or_a_trace_takes_the_ops(op_calls):
    q, k, v = _qkv(seed=2)
    with _PassThrough():
        _step(q, k, v, causal=True)
    assert op_calls == ["_fwd_op", "_bwd_op"]
    # make_fx on fake tensors: the graph holds the ops (a launch cannot run on fake tensors)
    from torch.fx.experimental.proxy_tensor import make_fx

    def fwd_bwd(a, b, c):
        out = attn.attention(a, b, c, backend="triton", causal=True)
        return torch.autograd.grad(out.sum(), (a, b, c))

    graph = make_fx(fwd_bwd, tracing_mode="fake")(q, k, v)
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert {"attn.flash_fwd.default", "attn.flash_bwd.default"} <= targets, targets


def test_torch_jit_trace_takes_the_op(op_calls):
    # under torch.jit.trace the launch goes through the op (shapes there are traced values,
    # which the op's spec encoding turns into numbers), and the trace replays
    q, k, v = (t.detach() for t in _qkv(seed=3))
    traced = torch.jit.trace(lambda a, b, c: attn.attention(a, b, c, backend="triton"),
                             (q, k, v), check_trace=False)
    assert op_calls == ["_fwd_op"]
    q2, k2, v2 = (t.detach() for t in _qkv(seed=4))  # a trace replays at its own shapes
    assert torch.equal(traced(q2, k2, v2), attn.attention(q2, k2, v2, backend="triton"))
