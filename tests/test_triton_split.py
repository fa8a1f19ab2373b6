"""Split-KV decoding in the triton backend: the plan, the kernels against the float64
reference, the override, and when ``auto`` takes it.

Without a GPU the kernels run in the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), where the plan sees a fixed stand-in SM count
(``attn.flash_triton.split.INTERPRETER_SM_COUNT``). Most calls force the split count with
``ATTN_TRITON_SPLIT_KV``, so that a few hundred keys give several chunks, each of several
32-key tiles, with a short last one.
"""

from functools import partial

import pytest
import torch

pytest.importorskip("triton")

import attn  # noqa: E402
from attn import flash_triton  # noqa: E402  (in interpreter mode on CPU: tests/conftest.py)
from attn.api import AttentionCall, select_backend  # noqa: E402
from attn.flash_triton import launch, split  # noqa: E402
from attn.flash_triton.split import (MAX_SPLITS, MIN_CHUNK, PROGRAMS_PER_CHUNK,  # noqa: E402
                                     split_kv_plan)
from attn.testing import assert_close_to_reference, make_inputs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not flash_triton._INTERPRET,
                                reason="the triton kernels need CUDA or the interpreter "
                                       "(TRITON_INTERPRET=1 before attn is imported)")
tri = partial(attn.attention, backend="triton")


@pytest.fixture
def splits_run(monkeypatch):
    """Forces 3 chunks and records the chunk length of every split-KV launch."""
    monkeypatch.setenv("ATTN_TRITON_SPLIT_KV", "3")
    seen = []
    real = launch._fwd_split

    def spy(q, k, v, spec, ops, chunk):
        seen.append(chunk)
        return real(q, k, v, spec, ops, chunk)

    monkeypatch.setattr(launch, "_fwd_split", spy)
    return seen


def _inputs(*, H=4, Hkv=2, Nq=4, Nk=150, dtype=torch.float32, seed=0):
    return make_inputs(B=2, H=H, Hkv=Hkv, N=Nq, Nk=Nk, D=16, dtype=dtype, device=DEVICE,
                       seed=seed)


# -- the plan: a pure function of (Nk, Nq, SMs), never of the batch -------------------------

@pytest.mark.parametrize("sms", [8, 132])
@pytest.mark.parametrize("n_k", [0, 1, 511, 512, 1000, 4097, 131072])
@pytest.mark.parametrize("n_q", [1, 16, 17])
def test_plan_properties(sms, n_k, n_q):
    tile = 64
    p = split_kv_plan(n_k, n_q, sms, tile=tile)
    assert p == split_kv_plan(n_k, n_q, sms, tile=tile)  # pure
    if n_q > 16 or n_k < 2 * MIN_CHUNK:
        assert p.splits == 1
        return
    assert p.chunk % tile == 0 and p.chunk >= MIN_CHUNK  # whole tiles, never too short
    assert (p.splits - 1) * p.chunk < n_k <= p.splits * p.chunk  # covers the keys, no empty chunk
    # one sequence of 8 kv heads fills the SMs twice, within the floor and the cap
    # (rounding chunks to whole tiles may give up to half of them back)
    target = min(-(-2 * sms // PROGRAMS_PER_CHUNK), n_k // MIN_CHUNK, MAX_SPLITS)
    assert target // 2 < p.splits <= target


def test_plan_force_and_bad_input():
    assert split_kv_plan(150, 4, 8, tile=32, force=3).splits == 3
    assert split_kv_plan(150, 4, 8, tile=32, force=0).splits == 1
    assert split_kv_plan(150, 17, 8, tile=32, force=3).splits == 1  # not eligible
    assert split_kv_plan(100, 4, 8, tile=32, force=50).splits == 4  # one tile per chunk
    for bad in (dict(n_k=-1), dict(sm_count=True), dict(force=-1), dict(n_q=1.5)):
        args = {**dict(n_k=150, n_q=4, sm_count=8), **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            split_kv_plan(**args)


@pytest.mark.cuda_if_present
def test_override_is_read_at_the_call(monkeypatch, splits_run):
    q, k, v = _inputs()
    monkeypatch.setenv("ATTN_TRITON_SPLIT_KV", "0")
    tri(q, k, v)
    assert splits_run == []
    monkeypatch.setenv("ATTN_TRITON_SPLIT_KV", "3")
    tri(q, k, v)
    assert splits_run == [64]  # 150 keys in 3 chunks of 2 tiles: 64, 64, 22
    monkeypatch.setenv("ATTN_TRITON_SPLIT_KV", "many")
    with pytest.raises(ValueError, match="ATTN_TRITON_SPLIT_KV"):
        tri(q, k, v)


# -- against the float64 reference --------------------------------------------------------------

def _alibi(H):
    return 2.0 ** (-8.0 * torch.arange(1, H + 1, device=DEVICE) / H)


VARIANTS = {
    "plain": lambda H, Nq, Nk: {},
    "causal": lambda H, Nq, Nk: {"causal": True},
    "window": lambda H, Nq, Nk: {"window": (40, 3)},
    "softcap": lambda H, Nq, Nk: {"softcap": 2.0},
    "sinks": lambda H, Nq, Nk: {"sinks": torch.linspace(-1, 3, H, device=DEVICE)},
    "alibi": lambda H, Nq, Nk: {"alibi_slopes": _alibi(H), "causal": True},
    "bool_mask": lambda H, Nq, Nk: {"attn_mask": torch.rand(
        2, H, Nq, Nk, generator=torch.Generator().manual_seed(1)).to(DEVICE) > 0.3},
    "float_mask": lambda H, Nq, Nk: {"attn_mask": torch.randn(
        1, H, Nq, Nk, generator=torch.Generator().manual_seed(2)).to(DEVICE)},
    "everything": lambda H, Nq, Nk: {
        "causal": True, "window": (90, 0), "softcap": 3.0, "alibi_slopes": _alibi(H),
        "sinks": torch.zeros(H, device=DEVICE), "attn_mask": torch.rand(
            1, 1, Nq, Nk, generator=torch.Generator().manual_seed(3)).to(DEVICE) > 0.2},
}
# (H, Hkv, Nq, dtype): GQA, MQA and plain MHA; one row, four, the most split-KV takes
SHAPES = [(4, 2, 1, torch.bfloat16), (4, 1, 4, torch.float32), (2, 2, 16, torch.float16)]


# every variant on two of the three shapes, rotating, and all of them together on all three:
# each shape (GQA bf16 Nq=1, MQA fp32 Nq=4, MHA fp16 Nq=16) meets most variants
_CASES = [(name, SHAPES[j % 3]) for i, name in enumerate(VARIANTS)
          for j in ((i, i + 1, i + 2) if name == "everything" else (i, i + 1))]


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("variant,shape", _CASES,
                         ids=[f"{n}-H{s[0]}kv{s[1]}q{s[2]}" for n, s in _CASES])
def test_matches_reference(variant, shape, splits_run):
    H, Hkv, Nq, dtype = shape
    q, k, v = _inputs(H=H, Hkv=Hkv, Nq=Nq, dtype=dtype, seed=len(variant))
    kwargs = VARIANTS[variant](H, Nq, k.shape[2])
    assert_close_to_reference(tri, q, k, v, grad=False, check_lse=True, **kwargs)
    assert splits_run == [64]


@pytest.mark.cuda_if_present
def test_rows_that_see_no_key_in_some_chunks_or_all(splits_run):
    # window (10, 0): the last query sees keys 139..149, the first 136..146: the first two
    # chunks are empty for every row. The mask hides every key from query 2 of head 1, so
    # that row sees nothing anywhere (zeros, lse -inf; with sinks: lse = the sink)
    H, Nq, Nk = 4, 4, 150
    q, k, v = _inputs(H=H, Hkv=2, Nq=Nq, Nk=Nk)
    mask = torch.ones(1, H, Nq, Nk, dtype=torch.bool, device=DEVICE)
    mask[0, 1, 2] = False
    for sinks in (None, torch.linspace(-2, 2, H, device=DEVICE)):
        kw = dict(causal=True, window=(10, 0), attn_mask=mask, sinks=sinks)
        assert_close_to_reference(tri, q, k, v, grad=False, check_lse=True, **kw)
        out, lse = tri(q, k, v, return_lse=True, **kw)
        assert torch.equal(out[:, 1, 2], torch.zeros_like(out[:, 1, 2]))
        want = float("-inf") if sinks is None else sinks[1].item()
        assert torch.equal(lse[:, 1, 2], torch.full_like(lse[:, 1, 2], want))
    assert splits_run == [64] * 4


@pytest.mark.cuda_if_present
def test_same_bits_for_the_same_shapes(splits_run):
    q, k, v = _inputs(dtype=torch.bfloat16, seed=5)
    a = tri(q, k, v, causal=True, return_lse=True)
    b = tri(q.clone(), k.clone(), v.clone(), causal=True, return_lse=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert len(splits_run) == 2


@pytest.mark.cuda_if_present
def test_auto_plan_splits_a_long_cache(monkeypatch, splits_run):
    # no override: 600 keys, the stand-in's 8 SMs: the rule wants 2 chunks (16 programs
    # per SM-pair over 8 per chunk), the 256-key floor allows 2
    monkeypatch.delenv("ATTN_TRITON_SPLIT_KV")
    q, k, v = make_inputs(B=1, H=2, Hkv=1, N=1, Nk=600, D=16, device=DEVICE, seed=6)
    assert_close_to_reference(tri, q, k, v, grad=False, check_lse=True)
    assert splits_run == [320]


@pytest.mark.cuda_if_present
def test_a_sequence_bits_do_not_depend_on_its_batch(monkeypatch, splits_run):
    """The auto plan cuts a sequence's keys the same way alone and in a batch of 3 with 2 kv
    heads (a plan from B·Hkv cut 1100 keys into 4 chunks alone and 3 in the batch): its
    output and lse are the same bits."""
    monkeypatch.delenv("ATTN_TRITON_SPLIT_KV")
    q, k, v = make_inputs(B=3, H=4, Hkv=2, N=1, Nk=1100, D=16, device=DEVICE, seed=7)
    alone = tri(q[:1], k[:1], v[:1], return_lse=True)
    batch = tri(q, k, v, return_lse=True)
    assert len(splits_run) == 2 and splits_run[0] == splits_run[1]
    assert torch.equal(alone[0][0], batch[0][0]) and torch.equal(alone[1][0], batch[1][0])


# -- when split-KV runs ---------------------------------------------------------------------------

@pytest.mark.cuda_if_present
def test_gradients_and_dropout_take_the_plain_kernels(splits_run):
    q, k, v = _inputs()
    out = tri(q.requires_grad_(), k, v)
    assert out.grad_fn is not None and splits_run == []
    with torch.no_grad():
        tri(q, k, v, dropout_p=0.2)
    assert splits_run == []
    with torch.no_grad():
        tri(q, k, v)
    assert splits_run == [64]


def _call(**kw):
    base = dict(device="cuda", dtype=torch.bfloat16, head_dim=128, head_dim_v=128, n_q=1,
                n_k=4096)
    return AttentionCall(**{**base, **kw})


def test_select_backend_says_when_split_kv_runs():
    choice = select_backend(_call())
    assert choice.name == "triton" and "split-KV decoding" in choice.reason
    for kw, words in ((dict(grad=True), "gradients"), (dict(dropout=True), "dropout"),
                      (dict(n_q=17), "Nq = 17"), (dict(n_k=511), "too short"),
                      (dict(varlen=True), "packed")):
        choice = select_backend(_call(**kw))
        assert choice.name == "triton" and "plain kernels" in choice.reason, kw
        assert words in choice.reason, (kw, choice.reason)


@pytest.mark.cuda_if_present
def test_resolve_marks_calls_that_need_gradients():
    from attn.call import resolve
    from attn.masks import Band

    q, k, v = _inputs()
    assert not resolve(q, k, v, band=Band())[0].grad
    assert resolve(q.requires_grad_(), k, v, band=Band())[0].grad
    with torch.no_grad():
        assert not resolve(q, k, v, band=Band())[0].grad


@pytest.mark.cuda_if_present
def test_split_op_fake_and_real_agree():
    from attn.masks import Band
    from attn.spec import LaunchSpec

    q, k, v = _inputs()
    spec = LaunchSpec(qk_scale=0.25, band=Band(k.shape[2] - q.shape[2], None, 0))
    args = (q, k, v, None, None, None, *launch._op_args(spec), None, 64)
    torch.library.opcheck(torch.ops.attn.flash_fwd_split.default, args)


def test_plan_function_is_exported():
    assert flash_triton.split_kv_plan is split.split_kv_plan
    assert "split_kv_plan" in flash_triton.__all__
