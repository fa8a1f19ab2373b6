"""attn.testing as a newcomer uses it: a function that returns only the output, wrong
functions, wrong shapes and wrong return values."""

from __future__ import annotations

import pytest
import torch

import attn
from attn.testing import assert_close_to_reference, compare_to_reference, make_inputs


def tiled(q, k, v, **kwargs):
    return attn.attention(q, k, v, backend="tiled", **kwargs)


def bare_kwargs(q, k, v, **kwargs):
    """Takes every keyword but drops return_lse: the output alone comes back."""
    kwargs.pop("return_lse", None)
    return tiled(q, k, v, **kwargs)


def bare_signature(q, k, v, causal=False):
    """No return_lse in its signature, so the helper must not pass it."""
    return tiled(q, k, v, causal=causal)


def inputs(dtype=torch.float32, **kw):
    # B = 2: unpacking a bare (2, ...) output as (out, lse) used to "succeed" wrongly
    return make_inputs(**{"B": 2, "H": 3, "N": 37, "D": 16, "Hkv": 1, **kw}, dtype=dtype)


@pytest.mark.parametrize("fn", [bare_kwargs, bare_signature])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bare_output_is_checked_with_default_arguments(fn, dtype):
    q, k, v = inputs(dtype)
    report = assert_close_to_reference(fn, q, k, v, causal=True)
    assert [c.name for c in report.comparisons] == ["out", "dq", "dk", "dv"]
    assert "lse not checked" in str(report)
    with pytest.raises(KeyError, match="lse not checked"):
        report["lse"]


def test_pair_output_checks_lse_without_a_note():
    q, k, v = inputs()
    report = assert_close_to_reference(tiled, q, k, v, causal=True)
    assert [c.name for c in report.comparisons] == ["out", "lse", "dq", "dk", "dv"]
    assert report.notes == []


def test_check_lse_false_is_noted():
    q, k, v = inputs()
    report = assert_close_to_reference(tiled, q, k, v, causal=True, check_lse=False)
    assert "lse" not in [c.name for c in report.comparisons]
    assert report.notes == ["lse not checked (check_lse=False)"]


def off_by_one_percent_scale(q, k, v, causal=False):
    return tiled(q, k, v, causal=causal, scale=1.01 * q.shape[-1] ** -0.5)


def ignores_causal(q, k, v, **kwargs):
    return tiled(q, k, v)


def no_grad_through_q(q, k, v, causal=False):
    return tiled(q.detach(), k, v, causal=causal)


@pytest.mark.parametrize("fn, wrong", [(off_by_one_percent_scale, "out"),
                                       (ignores_causal, "out"),
                                       (no_grad_through_q, "dq")])
def test_wrong_bare_function_fails(fn, wrong):
    q, k, v = inputs()
    report = compare_to_reference(fn, q, k, v, causal=True)
    assert not report[wrong].ok
    with pytest.raises(AssertionError, match=rf"{wrong} .*over budget"):
        assert_close_to_reference(fn, q, k, v, causal=True)


def test_wrong_lse_fails():
    def lse_off(q, k, v, **kwargs):
        out, lse = tiled(q, k, v, **kwargs)
        return out, lse + 1e-3

    q, k, v = inputs()
    with pytest.raises(AssertionError, match=r"lse .*over budget"):
        assert_close_to_reference(lse_off, q, k, v, causal=True)


def test_flash_attn_layout_output_names_the_shapes():
    def bnhd_out(q, k, v, causal=False):
        return tiled(q, k, v, causal=causal).transpose(1, 2)  # (B, N, H, D)

    q, k, v = inputs()
    expected = r"shape \(2, 37, 3, 16\), expected .*\(2, 3, 37, 16\)"
    with pytest.raises(AssertionError, match=expected):
        assert_close_to_reference(bnhd_out, q, k, v, causal=True)


def test_lse_of_the_wrong_shape_names_the_shapes():
    def flat_lse(q, k, v, **kwargs):
        out, lse = tiled(q, k, v, **kwargs)
        return out, lse.flatten()

    q, k, v = inputs()
    with pytest.raises(AssertionError, match=r"lse of shape \(222,\), expected \(B, H, Nq\)"):
        assert_close_to_reference(flat_lse, q, k, v, causal=True)


def test_check_lse_true_with_a_bare_output_is_a_type_error():
    q, k, v = inputs()
    with pytest.raises(TypeError, match="check_lse=True"):
        assert_close_to_reference(bare_kwargs, q, k, v, causal=True, check_lse=True)


def test_a_return_that_is_neither_tensor_nor_pair_is_a_type_error():
    def triple(q, k, v, **kwargs):
        return tiled(q, k, v), None, None

    q, k, v = inputs()
    with pytest.raises(TypeError, match="tuple of 3"):
        assert_close_to_reference(triple, q, k, v)


def test_bad_inputs_raise_value_errors_naming_them():
    q, k, v = inputs()
    with pytest.raises(ValueError, match=r"q must be a 4-d tensor.*\(3, 37, 16\)"):
        assert_close_to_reference(tiled, q[0], k, v)
    _, k8, v8 = inputs(D=8)
    with pytest.raises(ValueError):  # attn.attention's own message, before fn runs
        assert_close_to_reference(tiled, q, k8, v8)
