"""models/: the GPT's cached decoding, generation, checkpoints, configs and data."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from attn.models import GPT, AttentionConfig, GPTConfig, load_checkpoint, save_checkpoint
from attn.models.data import (CHARS, IGNORE, UNK, VOCAB_SIZE, RecallTask, TextCorpus, decode,
                         encode, recall_accuracy, unigram_entropy)
from attn.models.gpt import model_from_checkpoint, sample_next

ATTENTION_VARIANTS = {
    "plain": AttentionConfig(),
    "gqa-l2": AttentionConfig(kv_heads=1, qk_norm="l2"),
    "rms-after-learned-tau": AttentionConfig(qk_norm="rms", qk_norm_position="after",
                                             learn_temperature=True),
    "layer-softcap-sinks": AttentionConfig(qk_norm="layer", softcap=4.0, sinks=True),
    "window-no-rope": AttentionConfig(window=5, rope=False, temperature=0.8),
}


def _gpt(att: AttentionConfig, backend: str = "tiled", seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    att.backend = backend
    cfg = GPTConfig(vocab_size=23, block_size=32, n_layer=2, dim=32, attention=att)
    model = GPT(cfg).double().eval()
    with torch.no_grad():  # move the variant parameters off their neutral initial values
        for name, p in model.named_parameters():
            if name.endswith(("log_tau", "sinks", "qk_norm.g")):
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("backend", ["reference", "tiled"])
@pytest.mark.parametrize("variant", list(ATTENTION_VARIANTS))
def test_gpt_cached_logits_match_full_forward(variant: str, backend: str) -> None:
    model = _gpt(ATTENTION_VARIANTS[variant], backend)
    idx = torch.randint(0, 23, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, _ = model(idx)  # (B, T, V)
        caches = model.new_caches(2, 13)
        steps = [model(idx[:, :6], caches=caches)[0]]
        steps += [model(idx[:, t:t + 1], caches=caches)[0] for t in range(6, 13)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-11, atol=1e-11)


def test_generate_greedy_equals_uncached_argmax_loop() -> None:
    """generate() through the cache picks the same tokens as recomputing the whole prefix."""
    model = _gpt(AttentionConfig(kv_heads=2, qk_norm="rms", sinks=True))
    prompt = torch.randint(0, 23, (2, 4), generator=torch.Generator().manual_seed(1))
    out = model.generate(prompt, 10, temperature=0.0)
    seq = prompt
    with torch.no_grad():
        for _ in range(10):
            logits, _ = model(seq)
            seq = torch.cat((seq, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out, seq)


def test_sampling_top_k_and_temperature() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]]).repeat(500, 1)
    g = torch.Generator().manual_seed(0)
    top2 = sample_next(logits, 1.0, 2, g).flatten()
    assert set(top2.tolist()) == {1, 3}  # only the two largest logits survive top-k
    assert torch.equal(sample_next(logits, 0.0, None, g).flatten(), torch.ones(500).long())
    cold = sample_next(logits, 0.05, None, g).flatten()
    assert (cold == 1).float().mean() > 0.99  # low temperature ~ greedy
    hot = sample_next(logits, 100.0, None, g).flatten()
    assert len(set(hot.tolist())) == 4


def test_tied_embeddings() -> None:
    model = _gpt(AttentionConfig())
    assert model.lm_head.weight is model.tok_emb.weight


def test_checkpoint_roundtrip_weights_only(tmp_path: Path) -> None:
    model = _gpt(AttentionConfig(qk_norm="l2", learn_temperature=True, sinks=True)).float()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"model": model.state_dict(), "model_config": model.cfg.to_dict(),
                           "step": 7})
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # the temporary file was renamed away
    loaded, state = model_from_checkpoint(path)
    assert state["step"] == 7 and loaded.cfg == model.cfg
    idx = torch.randint(0, 23, (1, 9))
    torch.testing.assert_close(loaded.eval()(idx)[0], model.eval()(idx)[0], rtol=0, atol=0)


def test_checkpoint_save_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that dies half-way leaves the previous checkpoint readable and no debris."""
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"step": 1})

    def dying_save(obj, f, *a, **kw):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"step": 2})
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1
    assert os.listdir(tmp_path) == ["ckpt.pt"]


@pytest.mark.parametrize("build,match", [
    (lambda: GPTConfig(vocab_size=10, dim=30), "heads must divide dim"),
    (lambda: GPTConfig(vocab_size=10, attention=AttentionConfig(heads=4, kv_heads=3)),
     "kv_heads must divide heads"),
    (lambda: GPTConfig(vocab_size=10, attention=AttentionConfig(causal=False)),
     "causal must be True"),
], ids=["heads", "kv_heads", "causal"])
def test_gpt_config_rejects_bad_shapes(build, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


def test_attention_config_rejects_unknown_qk_norm() -> None:
    with pytest.raises(ValueError, match="qk_norm kind must be one of"):
        AttentionConfig(qk_norm="cosine")


def test_learned_positions_refuse_beyond_block_size() -> None:
    model = _gpt(AttentionConfig(rope=False))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 33, dtype=torch.long))


# -- data --------------------------------------------------------------------------------------

def test_recall_targets_are_the_values_paired_with_the_queried_keys() -> None:
    task = RecallTask(num_keys=20, num_values=10, pairs=6, queries=4)
    x, y = task.batch(16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (16, task.seq_len)
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        ctx = row_x[:2 * task.pairs]
        keys, values = ctx[0::2], ctx[1::2]
        assert len(set(keys)) == task.pairs and all(k < 20 for k in keys)
        assert all(20 <= v < 30 for v in values)
        pairs = dict(zip(keys, values))
        targets = [(t, row_x[t], row_y[t]) for t in range(len(row_y)) if row_y[t] != IGNORE]
        assert [t for t, _, _ in targets] == list(range(2 * task.pairs, task.seq_len))
        assert len({q for _, q, _ in targets}) == task.queries  # distinct queried keys
        for _, query, answer in targets:
            assert answer == pairs[query]
            assert answer not in row_x[2 * task.pairs:]  # answers are targets, never inputs


def test_recall_accuracy_counts_only_query_positions() -> None:
    y = torch.tensor([[IGNORE, 3, IGNORE, 5]])
    logits = torch.zeros(1, 4, 8)
    logits[0, 1, 3] = 1.0  # right
    logits[0, 3, 4] = 1.0  # wrong
    logits[0, 0, 7] = 1.0  # ignored position
    assert recall_accuracy(logits, y) == 0.5


def test_text_encoding_roundtrip_and_unknown() -> None:
    s = "def f(x):\n\treturn x ** 2  # ok ~ 'yes'"
    assert decode(encode(s)) == s
    assert encode("é").tolist() == [UNK]
    assert VOCAB_SIZE == len(CHARS) + 1 == 98


def test_text_corpus_split_is_deterministic_and_disjoint() -> None:
    a, b = TextCorpus.load(), TextCorpus.load()
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert len(a.train) > 1_000_000 and len(a.val) > 50_000  # a real corpus
    assert 0.05 < len(a.val) / (len(a.train) + len(a.val)) < 0.2
    x, y = a.batch("train", 4, 16, torch.Generator().manual_seed(0))
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one


def test_unigram_entropy() -> None:
    assert unigram_entropy(torch.tensor([0, 1, 2, 3]), 4) == pytest.approx(math.log(4))
    assert unigram_entropy(torch.tensor([5, 5, 5]), 8) == pytest.approx(0.0)


def test_window_layers_make_only_those_layers_local() -> None:
    model = _gpt(AttentionConfig(window=1, window_layers=[0]))
    assert model.blocks[0].attn.window == (1, 0)
    assert model.blocks[1].attn.window is None


def test_config_reaches_every_block_and_survives_a_checkpoint_dict() -> None:
    """Each attention field of the GPT's config is the option its modules are built with,
    the window only on the listed layers; a config dict round-trips to an equal config."""
    att = AttentionConfig(heads=4, kv_heads=2, qk_norm="l2", qk_norm_g_init=2.5,
                          temperature=0.7, learn_temperature=True, softcap=3.0,
                          learn_softcap=True, window=(2, 0), window_layers=[1], sinks=True,
                          rope=False, dropout=0.2, backend="reference", bias=True)
    cfg = GPTConfig(vocab_size=11, block_size=16, n_layer=2, dim=32, attention=att)
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    model = GPT(cfg)
    for i, block in enumerate(model.blocks):
        o = block.attn.options
        for name in ("heads", "kv_heads", "qk_norm", "qk_norm_g_init", "temperature",
                     "learn_temperature", "softcap", "learn_softcap", "sinks", "rope",
                     "dropout", "backend", "bias"):
            assert getattr(o, name) == getattr(att, name), name
        assert block.attn.window == ((2, 0) if i == 1 else None)
        assert block.attn.dropout == 0.2 and block.attn.qk_norm.g.item() == 2.5
        assert block.attn.log_softcap is not None and block.attn.qkv.bias is not None


def test_l2_default_g_uses_block_size() -> None:
    model = GPT(GPTConfig(vocab_size=11, block_size=16, n_layer=1, dim=32,
                          attention=AttentionConfig(qk_norm="l2")))
    assert model.blocks[0].attn.qk_norm.g.item() == pytest.approx(math.log2(16 * 16 - 16))


def test_checkpoint_config_from_before_attention_options_loads() -> None:
    """A model_config saved before attention had its own bias, causal, eps, train_len and
    learned-softcap fields: the GPT's bias still reaches the attention projections."""
    old = {"vocab_size": 11, "block_size": 16, "n_layer": 1, "dim": 32, "mlp_ratio": 4,
           "dropout": 0.0, "bias": True,
           "attention": {"heads": 4, "kv_heads": None, "qk_norm": "rms",
                         "qk_norm_position": "before", "qk_norm_g_init": None,
                         "temperature": 1.0, "learn_temperature": False, "softcap": None,
                         "window": None, "window_layers": None, "sinks": False, "rope": True,
                         "dropout": 0.0, "backend": "auto"}}
    cfg = GPTConfig.from_dict(old)
    assert cfg.attention.bias is True and cfg.attention.causal is True
    assert GPT(cfg).blocks[0].attn.qkv.bias is not None


# -- packed documents and bad input ------------------------------------------------------------

@pytest.mark.parametrize("rope", [True, False])
def test_packed_document_running_into_the_next_row_equals_it_alone(rope: bool) -> None:
    """doc_ids lay the rows end to end, so a document may run on from one row into the next:
    its tokens attend across the row boundary (one packed stream), and their positions, RoPE's
    or the learned ones, count from the document's start, as when it runs alone. Oracle: each
    document alone through the same weights on the float64 reference backend."""
    att = dict(kv_heads=2, window=9, sinks=True, rope=rope)
    packed_model = _gpt(AttentionConfig(**att), "tiled")
    alone_model = _gpt(AttentionConfig(**att), "reference")
    lengths = [5, 27, 18]  # rows of T = 25: [5 | 20 of 27], [7 of 27 | 18]
    x = torch.randint(0, 23, (2, 25), generator=torch.Generator().manual_seed(3))
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths)).view(2, 25)
    with torch.no_grad():
        packed = packed_model(x, doc_ids=doc)[0].flatten(0, 1)  # (B·T, V)
        starts = [0, 5, 32, 50]
        flat = x.flatten()
        for a, b in zip(starts[:-1], starts[1:]):
            alone = alone_model(flat[None, a:b])[0][0]
            torch.testing.assert_close(packed[a:b], alone)


def test_packed_document_longer_than_learned_positions_is_refused() -> None:
    model = _gpt(AttentionConfig(rope=False))  # block_size 32
    doc = torch.tensor([[0] * 20, [0] * 14 + [1] * 6])  # document 0: 34 tokens
    with pytest.raises(ValueError, match="doc_ids.*34.*block_size 32"):
        model(torch.zeros(2, 20, dtype=torch.long), doc_ids=doc)


def test_bad_gpt_input_names_the_argument() -> None:
    model = _gpt(AttentionConfig())
    idx = torch.randint(0, 23, (2, 5))
    for bad in (idx.clone().fill_(23), idx.clone().fill_(-1)):
        with pytest.raises(ValueError, match=r"idx .*\[0, 23\)"):
            model(bad)
        with pytest.raises(ValueError, match=r"idx .*\[0, 23\)"):
            model.generate(bad, 2)
    with pytest.raises(TypeError, match="idx .*float32"):
        model(idx.float())
    with pytest.raises(ValueError, match=r"idx .*\(10,\)"):
        model(idx.flatten())
    with pytest.raises(ValueError, match=r"doc_ids .*\(2, 4\).*\(2, 5\)"):
        model(idx, doc_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="doc_ids .*non-decreasing"):
        model(idx, doc_ids=torch.tensor([[0, 0, 1, 1, 1], [0, 2, 2, 2, 2]]))
    with pytest.raises(TypeError, match="doc_ids .*float32"):
        model(idx, doc_ids=torch.zeros(2, 5))
    for temperature in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="temperature"):
            model.generate(idx, 2, temperature=temperature)
    for top_k in (0, -3):
        with pytest.raises(ValueError, match="top_k"):
            model.generate(idx, 2, top_k=top_k)
    with pytest.raises(TypeError, match="top_k"):
        model.generate(idx, 2, top_k=2.5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(idx, -1)


def test_kv_cache_sizes_and_checkpoint_type_are_checked(tmp_path: Path) -> None:
    from attn.models import KVCache
    with pytest.raises(ValueError, match="max_len must be >= 0, got -1"):
        KVCache(1, 2, -1, 8)
    with pytest.raises(ValueError, match="batch"):
        KVCache(0, 2, 4, 8)
    path = tmp_path / "ckpt.pt"
    torch.save([1, 2, 3], path)
    with pytest.raises(TypeError, match="checkpoint .*dict.*list"):
        load_checkpoint(path)
    with pytest.raises(TypeError, match="checkpoint .*dict.*list"):
        model_from_checkpoint(path)
    with pytest.raises(TypeError, match="state .*dict"):
        save_checkpoint(path, [1, 2, 3])
    save_checkpoint(path, {"step": 1})
    with pytest.raises(ValueError, match="model_config"):
        model_from_checkpoint(path)
