"""`attn check`: the adapter, the conformance matrix and its diagnoses, on functions written
here with one planted bug each (and correct ones, in each calling style)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from attn import attention, scaled_dot_product_attention
from attn.adapters import adapt, load_target
from attn.bench.cli import main
from attn.conformance import HYPOTHESES, check
from attn.testing import check_dropout, conformance_cases, make_inputs

HERE = __file__


def _softmax_attention(q, k, v, causal, scale, *, top_left=False, gqa="interleave",
                       max_subtract=True):
    """Plain attention, with switches for the mistakes planted below."""
    g = q.shape[1] // k.shape[1]
    if gqa == "interleave":
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    else:
        k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        n, m = q.shape[2], k.shape[2]
        keep = torch.ones(n, m, dtype=torch.bool).tril(0 if top_left else m - n)
        s = s.masked_fill(~keep, float("-inf"))
    if not max_subtract:
        p = s.exp()
        return (p / p.sum(-1, keepdim=True)) @ v
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def correct(q, k, v, causal=False, scale=None):
    return _softmax_attention(q, k, v, causal, scale)


def planted_top_left(q, k, v, causal=False, scale=None):
    return _softmax_attention(q, k, v, causal, scale, top_left=True)


def planted_gqa_repeat(q, k, v, causal=False, scale=None):
    return _softmax_attention(q, k, v, causal, scale, gqa="repeat")


def planted_no_scale(q, k, v, causal=False):
    return _softmax_attention(q, k, v, causal, 1.0)


def planted_no_max(q, k, v, causal=False):
    return _softmax_attention(q, k, v, causal, None, max_subtract=False)


def planted_lse_log2(q, k, v, causal=False, return_lse=False):
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    return (out, lse / math.log(2)) if return_lse else out


def planted_no_causal(q, k, v, causal=False, scale=None):
    return _softmax_attention(q, k, v, False, scale)  # takes causal, ignores it


def planted_wrong_axis(q, k, v, causal=False):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        n, m = q.shape[2], k.shape[2]
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(m - n), float("-inf"))
    return torch.softmax(s, -2).nan_to_num(0.0) @ v  # over the queries


def _masked(q, k, v, attn_mask, *, true_means_masked=False):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        s = s.masked_fill(attn_mask if true_means_masked else ~attn_mask, float("-inf"))
    elif attn_mask is not None:
        s = s + attn_mask
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def planted_mask_ignored(q, k, v, attn_mask=None):
    return _masked(q, k, v, None)


def planted_mask_inverted(q, k, v, attn_mask=None):
    return _masked(q, k, v, attn_mask, true_means_masked=True)


def planted_dropout_unscaled(q, k, v, dropout_p=0.0):
    p = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1)
    return (p * (torch.rand_like(p) >= dropout_p)) @ v  # kept, but not divided by 1 - p


def _lse_planted(q, k, v, causal, return_lse, *, add_max=True, scale=True):
    out, _ = attention(q, k, v, causal=causal, return_lse=True)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale else 1.0)
    if causal:
        n, m = q.shape[2], k.shape[2]
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(m - n), float("-inf"))
    m_i = s.amax(-1, keepdim=True)
    lse = ((s - m_i).exp().sum(-1).log() + (m_i[..., 0] if add_max else 0.0))
    return (out, lse) if return_lse else out


def planted_lse_no_max(q, k, v, causal=False, return_lse=False):
    return _lse_planted(q, k, v, causal, return_lse, add_max=False)


def planted_lse_unscaled(q, k, v, causal=False, return_lse=False):
    return _lse_planted(q, k, v, causal, return_lse, scale=False)


def torch_style(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                          dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, enable_gqa=enable_gqa)


def hf_style(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' eager_attention_forward, as written there (additive mask, repeat_kv)."""
    g = module.num_key_value_groups
    key, value = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    weights = query @ key.transpose(2, 3) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(weights, dim=-1)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def flash_style(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                softcap=0.0, return_attn_probs=False):
    """flash-attn's convention: (B, N, H, D) and lse +inf on rows with no key."""
    out, lse = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                         causal=causal, window=tuple(window_size), scale=softmax_scale,
                         softcap=softcap or None, dropout_p=dropout_p, return_lse=True)
    out = out.transpose(1, 2)
    return (out, torch.where(torch.isinf(lse), math.inf, lse), None) if return_attn_probs else out


def _check_json(name, *cases, capsys):
    code = main(["check", f"{HERE}:{name}", "--json", "--cases", *cases])
    result = json.loads(capsys.readouterr().out)
    return code, {r["case"]: r for r in result["rows"]}


def _named(diagnosis, start):
    return any(d.startswith(start) for d in diagnosis)


@pytest.mark.parametrize("fn, cases, hypothesis", [
    ("planted_top_left", ["causal Nq<Nk (bottom-right)", "causal Nq>Nk (bottom-right)"],
     "causal aligned top-left"),
    ("planted_gqa_repeat", ["GQA", "gradients causal GQA"], "GQA heads grouped by repeat"),
    ("planted_no_scale", ["plain", "causal"], "scale missing"),
    ("planted_no_causal", ["causal", "causal Nq<Nk (bottom-right)", "gradients causal GQA"],
     "causal mask missing"),
    ("planted_wrong_axis", ["plain", "causal"], "softmax over the wrong axis"),
    ("planted_mask_ignored", ["mask bool", "mask float"], "attn_mask ignored"),
    ("planted_mask_inverted", ["mask bool"], "bool attn_mask inverted"),
    ("planted_dropout_unscaled", ["dropout"], "dropout without rescaling"),
    ("planted_lse_no_max", ["lse"], "lse of the scores scaled down by their row max"),
    ("planted_lse_unscaled", ["lse"], "lse of the unscaled scores"),
])
def test_planted_bug_is_diagnosed_by_name(fn, cases, hypothesis, capsys):
    code, rows = _check_json(fn, "plain", "MQA", *cases, capsys=capsys)
    assert code == 1
    for case in cases:
        assert rows[case]["status"] == "wrong"
        assert _named(rows[case]["diagnosis"], hypothesis), rows[case]
        # only the hypothesis that explains it
        assert len(rows[case]["diagnosis"]) == 1, rows[case]["diagnosis"]
    # the bug shows only where it should: one kv head makes repeat and interleave agree
    untouched = "wrong" if fn in ("planted_no_scale", "planted_wrong_axis") else "correct"
    assert rows["MQA"]["status"] == rows["plain"]["status"] == untouched


def test_correct_function_exits_zero_and_says_what_it_cannot_express(capsys):
    code = main(["check", f"{HERE}:correct", "--quick"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "passed" in out
    # the cases its signature cannot express: one line, naming them and the keywords
    line = next(ln for ln in out.splitlines() if ln.startswith("not supported"))
    assert "window (4, 4)" in line and "(attn style) cannot express window, softcap" in line
    assert line.endswith("its signature has no such parameter")
    assert sum("not supported" in ln for ln in out.splitlines()) == 2  # and the summary
    assert "style attn, from its signature (parameters 'causal')" in out


def test_nan_rows_are_diagnosed():
    rows = {r.case: r for r in check(planted_no_max, cases=conformance_cases(
        ["plain", "huge logits"])).rows}
    assert rows["plain"].status == "correct"
    assert rows["huge logits"].status == "NaN"
    assert _named(rows["huge logits"].diagnosis, "softmax without max-subtraction")


def test_lse_in_base_2_is_diagnosed():
    rows = {r.case: r for r in check(planted_lse_log2, cases=conformance_cases(
        ["plain", "lse"])).rows}
    assert rows["plain"].status == "correct"
    assert rows["lse"].status == "wrong"
    assert rows["lse"].diagnosis == ["lse in base 2 (log2 instead of the natural log)"]


def test_unexplained_error_says_where_it_lives():
    def head_one_off(q, k, v):
        out = attention(q, k, v).clone()
        out[:, 1, 5] += 0.5
        return out

    row = check(head_one_off, cases=conformance_cases(["plain"])).rows[0]
    assert row.status == "wrong" and row.diagnosis == []
    assert row.where == "batch all 2; heads 1 of 3; query rows 5 of 17; output columns all 16"


def test_torch_style_detected_and_correct():
    fn = adapt(torch_style)
    assert fn.style == "torch" and "'is_causal'" in fn.detected
    assert adapt(F.scaled_dot_product_attention).style == "torch"
    result = check(torch_style, cases=conformance_cases(
        ["causal", "GQA", "mask bool", "causal Nq<Nk (bottom-right)", "lse"]))
    status = {r.case: r.status for r in result.rows}
    assert status == {"causal": "correct", "GQA": "correct", "mask bool": "correct",
                      "causal Nq<Nk (bottom-right)": "not supported",
                      "lse": "not supported"}, result.table()


def test_hf_style_detected_and_correct():
    fn = adapt(hf_style)
    assert fn.style == "hf" and "'module'" in fn.detected and "'attention_mask'" in fn.detected
    result = check(hf_style, cases=conformance_cases(
        ["causal Nq<Nk (bottom-right)", "GQA", "window (4, 4)", "mask float",
         "fully masked rows", "lse"]))
    rows = {r.case: r for r in result.rows}
    for case in ("causal Nq<Nk (bottom-right)", "GQA", "window (4, 4)", "mask float"):
        assert rows[case].status == "correct", result.table()
    # HF's attn_weights are not an lse; a -inf mask row gives NaN in an eager softmax
    assert rows["lse"].status == "not supported"
    assert rows["fully masked rows"].status == "NaN"
    assert rows["fully masked rows"].diagnosis == ["fully masked rows give NaN instead of zeros"]


def test_flash_style_layout_and_lse_convention():
    fn = adapt(flash_style)
    assert (fn.style, fn.layout) == ("flash", "bnhd")
    result = check(flash_style, cases=conformance_cases(
        ["causal Nq>Nk (bottom-right)", "window (8, 0) causal", "softcap", "lse",
         "mask bool"]))
    status = {r.case: r.status for r in result.rows}
    assert status == {"causal Nq>Nk (bottom-right)": "correct", "window (8, 0) causal": "correct",
                      "softcap": "correct", "lse": "correct", "mask bool": "not supported"}, \
        result.table()
    q, k, v = make_inputs(B=1, H=2, N=6, Nk=3, D=8)
    _, lse = fn(q, k, v, causal=True, return_lse=True)  # rows 0-2 see no key
    assert torch.isneginf(lse[..., :3]).all() and torch.isfinite(lse[..., 3:]).all()


def test_attn_drop_in_checks_cleanly():
    result = check("attn:scaled_dot_product_attention", cases=conformance_cases(quick=True))
    assert result.ok, result.table()
    assert result.style == "torch"
    assert adapt(scaled_dot_product_attention).style == "torch"


def test_dropout_judged_by_statistics():
    q, k, v, kw = conformance_cases(["dropout"])[0].inputs()
    assert check_dropout(lambda q, k, v, **kw: attention(q, k, v, **kw), q, k, v, **kw) is None
    ignored = check_dropout(lambda q, k, v, dropout_p, **kw: attention(q, k, v, **kw),
                            q, k, v, **kw)
    assert "changed nothing" in ignored
    unscaled = check_dropout(lambda q, k, v, dropout_p, **kw: attention(
        q, k, v, dropout_p=dropout_p, **kw) * (1 - dropout_p), q, k, v, **kw)
    assert unscaled.startswith("dropout without rescaling")


def test_make_inputs_logit_scale():
    q, k, _ = make_inputs(B=1, H=2, N=64, D=32, logit_scale=30.0, dtype=torch.float64)
    scores = q @ k.transpose(-1, -2) / 32 ** 0.5
    assert 25 < scores.std().item() < 35
    assert torch.equal(make_inputs(B=1, H=1, N=4, D=8)[0],
                       make_inputs(B=1, H=1, N=4, D=8, logit_scale=1.0)[0])
    with pytest.raises(ValueError, match="logit_scale"):
        make_inputs(logit_scale=0.0)


def test_conformance_cases_cover_the_issue_and_reject_unknown_names():
    names = [str(c) for c in conformance_cases()]
    assert {"N=1", "N=97", "N=1025", "GQA", "MQA", "softcap", "sinks", "mask bool",
            "mask float", "fully masked rows", "dropout", "huge logits", "lse"} <= set(names)
    assert "N=1025" not in [str(c) for c in conformance_cases(quick=True)]
    with pytest.raises(ValueError, match="no conformance case \\['nope'\\]"):
        conformance_cases(["nope"])
    assert len(HYPOTHESES) >= 7


@pytest.mark.parametrize("spec, match", [
    ("no_colon", "must be 'module:function'"),
    ("attn.nope:f", "importing 'attn.nope'"),
    ("attn:nope", "'attn' has no 'nope'"),
    ("attn:__version__", "names a str"),
    ("missing/file.py:f", "no file"),
])
def test_load_target_errors_name_the_spec(spec, match):
    with pytest.raises(ValueError, match=match) as e:
        load_target(spec)
    assert repr(spec) in str(e.value)


def test_load_target_from_a_file_and_bad_target_exits_2(capsys):
    assert load_target(f"{HERE}:correct").__name__ == "correct"
    assert main(["check", "attn:nope"]) == 2
    assert "'attn' has no 'nope'" in capsys.readouterr().err
