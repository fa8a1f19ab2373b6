"""The fused backend's CUDA path, planned and run on CPU (no GPU here).

torch's CUDA attention ops are replaced by stand-ins that compute on CPU in float64 and
behave as the CUDA ops do where it matters to the composition: the efficient op pads its lse
to 32 rows (the padding is garbage) and reads a bias only when stored 16-aligned, cuDNN's lse
is (B, H, M, 1), flash takes no mask and needs equal heads, and a row a mask hides comes back
as NaN with lse 0. The backward stand-ins rebuild P from the lse they are handed, as the
kernels do. The CUDA cut (one query block per sequence, items in order) runs on these, through
attn's public functions, against the float64 reference. The real ops' argument lists are
checked on the meta device, where torch registers their shapes.
"""

import json

import pytest
import torch

import attn
from attn import fused, fused_cuda
from attn.call import select_backend

F64 = torch.float64


def _math(q, k, v, bias, causal, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.double()
    if causal:  # torch's top-left: row i sees keys j <= i
        M, N = s.shape[-2:]
        s = s.masked_fill(torch.ones(M, N, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    return s, p, lse


def _grads(do, q, k, v, o, lse, bias, causal, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.double()
    if causal:
        M, N = s.shape[-2:]
        s = s.masked_fill(torch.ones(M, N, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(s - lse.double()[..., None])  # rebuilt from the lse it is handed
    do = do.double()
    dv = p.transpose(-1, -2) @ do
    dp = do @ v.double().transpose(-1, -2)
    delta = (do * o.double()).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    return (ds @ k.double()) * scale, (ds.transpose(-1, -2) @ q.double()) * scale, dv


def _fwd_common(q, k, v, bias, causal, scale):
    assert q.shape[1] == k.shape[1] == v.shape[1], "the CUDA ops get K/V expanded to q's heads"
    assert q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0, "head dims padded to 8"
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    _, p, lse = _math(q, k, v, bias, causal, scale)
    out = (p @ v.double())
    hidden = torch.isinf(lse) & (lse < 0)
    out = out.masked_fill(hidden[..., None], float("nan"))  # as bad as a kernel may be
    lse = lse.masked_fill(hidden, 0.0)  # torch's ops give 0, not -inf
    # float32 as the ops give it; float64 inputs (which the real ops refuse) keep float64, so
    # that the composition is checked to 1e-9 here
    return out.to(q.dtype), lse.to(torch.float64 if q.dtype == F64 else torch.float32)


def _check_bias(bias, q, k):
    if bias is not None:
        assert bias.shape == (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), bias.shape
        assert bias.stride(-2) % 16 == 0, "the bias must be stored 16-aligned"


def flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    out, lse = _fwd_common(q, k, v, None, is_causal, scale)
    return out, lse, None, None, q.shape[2], k.shape[2], None, None, None


def flash_backward(do, q, k, v, out, lse, cq, ck, mq, mk, p, causal, seed, off, *, scale=None):
    assert lse.shape == q.shape[:3] and lse.dtype in (torch.float32, F64)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return tuple(g.to(q.dtype) for g in _grads(do, q, k, v, out, lse, None, causal, scale))


def efficient(q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, *, scale=None):
    _check_bias(bias, q, k)
    out, lse = _fwd_common(q, k, v, bias, is_causal, scale)
    pad = -(-q.shape[2] // 32) * 32 - q.shape[2]
    lse = torch.nn.functional.pad(lse, (0, pad), value=7.0)  # padding rows: garbage
    return out, lse, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)


def efficient_backward(do, q, k, v, bias, out, lse, seed, off, p, mask, causal=False, *,
                       scale=None):
    _check_bias(bias, q, k)
    assert lse.shape[-1] % 32 == 0, "the efficient op reads its lse padded to 32 rows"
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    gq, gk, gv = _grads(do, q, k, v, out, lse[..., :q.shape[2]], bias, causal, scale)
    return gq.to(q.dtype), gk.to(q.dtype), gv.to(q.dtype), None


def cudnn(q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False,
          return_debug_mask=False, *, scale=None):
    _check_bias(bias, q, k)
    out, lse = _fwd_common(q, k, v, bias, is_causal, scale)
    return out, lse.unsqueeze(-1), None, None, q.shape[2], k.shape[2], None, None, None


def cudnn_backward(do, q, k, v, out, lse, seed, off, bias, cq, ck, mq, mk, p, causal, *,
                   scale=None):
    _check_bias(bias, q, k)
    assert lse.dim() == 4 and lse.shape[-1] == 1, "cuDNN reads its lse as (B, H, M, 1)"
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return tuple(g.to(q.dtype) for g in _grads(do, q, k, v, out, lse[..., 0], bias, causal,
                                                scale))


STAND_INS = dict(flash=flash, flash_backward=flash_backward, efficient=efficient,
                 efficient_backward=efficient_backward, cudnn=cudnn,
                 cudnn_backward=cudnn_backward)


@pytest.fixture
def as_cuda(monkeypatch):
    """The fused backend on CPU tensors, cut as on CUDA and running the stand-ins; the op
    for unmasked pieces is the parameter, masked pieces take ``efficient`` when it is
    flash (which has no mask)."""
    def use(op):
        pairs = {m: fused_cuda.pair("efficient" if op == "flash" and m else op, STAND_INS)
                 for m in (False, True)}
        monkeypatch.setattr(fused, "kernels", lambda q: pairs.__getitem__)
        monkeypatch.setattr(fused, "_config", lambda q, c: fused.CUDA)
    return use


def _qkv(B, H, Hkv, Nq, Nk, D, seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, D, generator=g, dtype=dtype).requires_grad_()
            for h, n in ((H, Nq), (Hkv, Nk), (Hkv, Nk))]


def _check(q, k, v, tol=1e-9, **kw):
    """out, lse and every gradient of the fused call against the float64 reference."""
    got = attn.attention(q, k, v, backend="fused", return_lse=True, **kw)
    want = attn.attention(q, k, v, backend="reference", return_lse=True, **kw)
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    torch.testing.assert_close(got[1], want[1], rtol=tol, atol=tol)
    g = torch.Generator().manual_seed(9)
    do = torch.randn(want[0].shape, generator=g, dtype=F64)
    dl = torch.randn(want[1].shape, generator=g, dtype=F64)
    leaves = [t for t in (q, k, v, *kw.values()) if isinstance(t, torch.Tensor)
              and t.requires_grad]
    for a, b in zip(torch.autograd.grad((got[0] * do).sum() + (got[1] * dl).sum(), leaves),
                    torch.autograd.grad((want[0] * do).sum() + (want[1] * dl).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


CASES = {
    "plain_gqa": (dict(B=2, H=4, Hkv=2, Nq=37, Nk=45, D=16), {}),
    "causal_bottom_right": (dict(B=1, H=2, Hkv=1, Nq=20, Nk=53, D=8), dict(causal=True)),
    "causal_more_queries": (dict(B=1, H=2, Hkv=2, Nq=41, Nk=23, D=8), dict(causal=True)),
    "window": (dict(B=2, H=2, Hkv=1, Nq=50, Nk=50, D=12), dict(window=(7, 3))),
    "sinks": (dict(B=1, H=4, Hkv=2, Nq=33, Nk=33, D=16), dict(causal=True, sinks="sinks")),
}


@pytest.mark.parametrize("op", fused_cuda.OPS)
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_cut_on_stand_ins_matches_the_reference(as_cuda, op, case):
    as_cuda(op)
    shape, kw = CASES[case]
    q, k, v = _qkv(**shape, seed=len(case))
    if kw.get("sinks") == "sinks":
        kw = {**kw, "sinks": torch.randn(shape["H"], dtype=F64).requires_grad_()}
    _check(q, k, v, **kw)


@pytest.mark.parametrize("op", fused_cuda.OPS)
def test_masked_pieces_and_hidden_rows(as_cuda, op):
    """A bool mask hiding whole rows (NaN out, lse 0 from the op) and a float mask: rows
    without keys come back as zeros with lse -inf, the rest exact."""
    as_cuda(op)
    q, k, v = _qkv(2, 4, 2, 29, 40, 16, seed=3)
    g = torch.Generator().manual_seed(4)
    keep = torch.rand(2, 4, 29, 40, generator=g) > 0.5
    keep[:, :, 5] = False  # row 5 sees no key
    got, lse = attn.attention(q, k, v, backend="fused", attn_mask=keep, return_lse=True)
    assert not got[:, :, 5].any() and bool((lse[:, :, 5] == float("-inf")).all())
    _check(q, k, v, attn_mask=keep)
    _check(q, k, v, attn_mask=torch.randn(1, 4, 29, 40, generator=g, dtype=F64))


def test_alibi_and_packed_sequences(as_cuda):
    as_cuda("efficient")
    q, k, v = _qkv(1, 4, 2, 40, 40, 8, seed=5)
    _check(q, k, v, causal=True, alibi_slopes=torch.tensor([[0.5, 0.25, 0.125, 0.0625]],
                                                           dtype=F64))
    g = torch.Generator().manual_seed(6)
    cu = torch.tensor([0, 7, 30, 41])
    qp, kp, vp = (torch.randn(41, 4, 8, generator=g, dtype=F64) for _ in range(3))
    got = attn.varlen_attention(qp, kp, vp, cu, cu, 23, 23, causal=True, backend="fused")
    want = attn.varlen_attention(qp, kp, vp, cu, cu, 23, 23, causal=True,
                                 backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_a_wrong_lse_fails_the_comparison(as_cuda, monkeypatch):
    """The stand-ins can fail: an op whose lse is off by 1e-3 breaks the forward check."""
    bad = dict(STAND_INS)
    bad["efficient"] = lambda *a, **k: (lambda r: (r[0], r[1] + 1e-3, *r[2:]))(
        efficient(*a, **k))
    pairs = {m: fused_cuda.pair("efficient", bad) for m in (False, True)}
    monkeypatch.setattr(fused, "kernels", lambda q: pairs.__getitem__)
    monkeypatch.setattr(fused, "_config", lambda q, c: fused.CUDA)
    q, k, v = _qkv(1, 2, 2, 20, 20, 8, seed=7)
    with pytest.raises(AssertionError):
        _check(q, k, v, causal=True)


# -- the real ops' argument lists, on the meta device ------------------------------------------

@pytest.mark.parametrize("op,masked", [(op, m) for op in fused_cuda.OPS for m in (False, True)
                                       if fused_cuda.can_run(op, torch.bfloat16, 72, m)])
def test_pairs_call_torchs_ops_with_their_arguments(op, masked):
    ops = fused_cuda.ops()
    assert isinstance(ops, dict), ops  # every schema as this torch defines it
    p = fused_cuda.pair(op)
    G, rows, keys, D = 4, 37, 50, 72
    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(1, G, rows, D, **meta)
    k, v = torch.empty(1, 1, keys, D, **meta), torch.empty(1, 1, keys, D, **meta)
    mask = torch.empty(1, 1, rows, keys, **meta) if masked else None
    out, lse = p.fwd(q, k, v, not masked, mask, 0.1)
    assert out.shape == (1, G, rows, D) and lse.shape == (1, G, rows)
    assert lse.dtype == torch.float32
    gq, gk, gv = p.bwd(torch.empty_like(out), q, k, v, out, lse, not masked, mask, 0.1)
    assert gq.shape == q.shape and gk.shape == k.shape and gv.shape == v.shape


def test_what_each_op_takes():
    assert fused_cuda.can_run("efficient", torch.float32, 128, True)
    assert not fused_cuda.can_run("flash", torch.float32, 128, False)
    assert not fused_cuda.can_run("flash", torch.bfloat16, 128, True)
    assert fused_cuda.can_run("cudnn", torch.bfloat16, 128, True)
    assert not any(fused_cuda.can_run(op, torch.float64, 64, False) for op in fused_cuda.OPS)
    assert not any(fused_cuda.can_run(op, torch.float16, 512, False) for op in fused_cuda.OPS)
    with pytest.raises(ValueError, match="op must be one of"):
        with fused_cuda.force_op("cutlass"):
            pass


# -- auto on CUDA reads the verification table -------------------------------------------------

def test_auto_on_cuda_takes_fused_only_with_a_verified_entry(monkeypatch):
    import dataclasses

    from attn.call import AttentionCall
    call = AttentionCall(device="cuda", dtype=torch.bfloat16, head_dim=128, head_dim_v=128,
                         n_q=1024, n_k=1024, grad=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fused_cuda, "ops", lambda: dict(STAND_INS))
    monkeypatch.setattr(fused_cuda, "table", lambda: {})
    assert select_backend(call).name != "fused"
    key = fused_cuda._key("efficient", call.dtype, call.head_dim, torch.device("cuda"))
    assert key.startswith("efficient|torch ") and "|sm_90|bfloat16|d128" in key
    monkeypatch.setattr(fused_cuda, "table", lambda: {key: {"key": key, "exact": True}})
    assert select_backend(call).name != "fused"  # exact, but not measured faster
    row = {"key": key, "exact": True, "speedup_vs_triton": 1.3}
    monkeypatch.setattr(fused_cuda, "table", lambda: {key: row})
    choice = select_backend(call)
    assert choice.name == "fused" and "efficient" in choice.reason, choice
    for other in (dict(n_q=1, grad=False), dict(varlen=True)):  # decoding, packed: triton
        assert select_backend(dataclasses.replace(call, **other)).name != "fused"
    monkeypatch.setattr(fused_cuda, "table", lambda: {key: {**row, "speedup_vs_triton": 0.8}})
    assert select_backend(call).name != "fused"
    monkeypatch.setattr(fused_cuda, "table", lambda: {key: {**row, "exact": False}})
    assert select_backend(call).name != "fused"
    # flash alone verified: it cannot take masked pieces, so auto does not take fused
    flash_key = key.replace("efficient|", "flash|")
    monkeypatch.setattr(fused_cuda, "table",
                        lambda: {flash_key: {**row, "key": flash_key}})
    assert select_backend(call).name != "fused"
    for bad in (dict(dtype=F64, head_dim=128), dict(head_dim=512, head_dim_v=512)):
        assert fused.call_reason(dataclasses.replace(call, **bad)) is not None


# -- attn gpu-check's verification, rehearsed on the stand-ins ---------------------------------

def test_verification_marks_a_correct_op_exact_and_a_broken_one_not(monkeypatch, tmp_path):
    from attn.bench import fused_verify

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    bad = dict(STAND_INS)  # dV off by 25 % on the efficient op (bf16: 1 % is in budget)
    bad["efficient_backward"] = lambda *a, **k: (lambda r: (r[0], r[1], r[2] * 1.25, r[3]))(
        efficient_backward(*a, **k))
    monkeypatch.setattr(fused_cuda, "ops", lambda: STAND_INS)
    monkeypatch.setattr(fused_cuda, "table", lambda: {})
    # the CUDA choice of pairs on CPU tensors (forced ops, masked pieces elsewhere for flash)
    monkeypatch.setattr(fused, "kernels", lambda q: fused.cuda_kernels(q.dtype, q.shape[-1],
                                                                       q.device))
    monkeypatch.setattr(fused, "_config", lambda q, c: fused.CUDA)
    monkeypatch.setattr(fused_verify, "CASES", {k: v for k, v in fused_verify.CASES.items()
                                                if k != "plain_gqa"})
    good = fused_verify.verify("cpu", ops=fused_cuda.OPS, dtypes=(torch.bfloat16,),
                               head_dims=(16,), log=lambda line: None, speed=False)
    assert [(r["op"], r["exact"]) for r in good] == [(op, True) for op in fused_cuda.OPS], good
    assert [r["cases"].get("bool_mask_hidden_row") is not None for r in good] == [
        True, False, True]  # flash takes no mask: its row has no masked case
    monkeypatch.setattr(fused_cuda, "ops", lambda: bad)
    broken = fused_verify.verify("cpu", ops=("efficient",), dtypes=(torch.bfloat16,),
                                 head_dims=(16,), log=lambda line: None, speed=False)
    assert not broken[0]["exact"]
    table = fused_verify.write_table(good, tmp_path / "t.json")
    fused_verify.write_table(broken, tmp_path / "t.json")  # the newer row replaces its key
    rows = {r["key"]: r for r in json.loads((tmp_path / "t.json").read_text())["rows"]}
    assert len(table["rows"]) == 3 and len(rows) == 3
    assert not rows[broken[0]["key"]]["exact"] and rows[good[0]["key"]]["op"] == "cudnn"
    assert rows[good[0]["key"]]["exact"]
    # off CUDA no speed figure (auto never takes a row without one)
    assert fused_verify._speedup(torch.float32, 16, "cpu") is None


def test_the_stage_keeps_every_row_it_finished_when_its_box_runs_out(monkeypatch, tmp_path):
    # exactness of every row first, each written at once; then speed, bf16 D = 128 first,
    # until the box runs short: a cut stage leaves its finished rows in both tables
    from attn.bench import fused_verify

    clock = [0.0]

    class Ctx:
        dry_run, out = False, str(tmp_path)

        def __init__(self):
            self.rows, self.drops = [], []

        def left(self):
            return 100.0 - clock[0]

        def log(self, line):
            pass

        def running(self, what):
            pass

        def row(self, **fields):
            self.rows.append(fields)

        def dropped(self, what, why):
            self.drops.append(what)

    def verify_one(op, dtype, d, device, *, speed):
        assert not speed  # the stage times exact rows itself, after every row is verified
        clock[0] += 4
        return {"key": f"{op}/{str(dtype)[6:]}/{d}", "op": op, "dtype": str(dtype)[6:],
                "head_dim": d, "cases": {}, "exact": op != "flash", "error": None}

    timed = []

    def speedup(dtype, d, device):
        assert json.loads((tmp_path / "fused_cuda_table.json").read_text())["rows"]
        timed.append((fused_cuda._FORCED.get(), dtype, d))
        clock[0] += 25
        return 1.5

    monkeypatch.setattr(fused_cuda, "TABLE", tmp_path / "checkout.json")
    monkeypatch.setattr(fused_cuda, "can_run", lambda op, dtype, d, masked: True)
    monkeypatch.setattr(fused_verify, "verify_one", verify_one)
    monkeypatch.setattr(fused_verify, "_speedup", speedup)
    ctx = Ctx()
    fused_verify.stage(ctx)
    # 3 ops x 3 dtypes x 2 dims verified in 72 "s"; then one speed row fits (>= 20 s left)
    assert len([r for r in ctx.rows if "exact" in r]) == 18
    assert timed == [("cudnn", torch.bfloat16, 128)]
    assert len(ctx.drops) == 12 - 1  # 12 exact rows (cudnn, efficient), one timed
    for path in (tmp_path / "fused_cuda_table.json", tmp_path / "checkout.json"):
        rows = {r["key"]: r for r in json.loads(path.read_text())["rows"]}
        assert len(rows) == 18
        assert rows["cudnn/bfloat16/128"]["speedup_vs_triton"] == 1.5
        assert "speedup_vs_triton" not in rows["efficient/bfloat16/128"]
