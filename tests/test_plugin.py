"""The pytest plugin (`pytest --attn-impl mod:fn`) and conformance_cases in a user's own
suite, run by pytester in a fresh directory."""

import tomllib
from importlib.metadata import distributions
from pathlib import Path

pytest_plugins = ["pytester"]

# Installed (pip install -e .), the pytest11 entry point loads the plugin in every pytest run;
# loading it again with -p would register it twice (pytest refuses). From a checkout whose
# installed metadata predates the entry point, -p loads it.
# (every distribution is looked at, as pytest itself does: a stale attn.egg-info in the
# checkout may shadow the installed metadata in importlib.metadata.entry_points())
LOAD = [] if any(ep.group == "pytest11" and ep.value == "attn.pytest_plugin"
                 for dist in distributions() for ep in dist.entry_points) \
    else ["-p", "attn.pytest_plugin"]

FUNCTIONS = '''
import torch

def gqa(q, k, v):
    g = q.shape[1] // k.shape[1]
    return k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

def correct(q, k, v, causal=False):
    k, v = gqa(q, k, v)
    n, m = q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(m - n), float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v

def top_left(q, k, v, causal=False):
    k, v = gqa(q, k, v)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(~torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(),
                          float("-inf"))
    return torch.softmax(s, -1) @ v
'''


def test_plugin_runs_the_matrix_as_items(pytester):
    pytester.makepyfile(fns=FUNCTIONS)
    pytester.syspathinsert()
    res = pytester.runpytest(*LOAD, "--attn-impl", "fns:top_left",
                             "--attn-quick", "-k", "causal or plain or window")
    res.assert_outcomes(passed=3, failed=2, skipped=2)  # window rows: not expressible
    res.stdout.fnmatch_lines(["*causal Nq<Nk (bottom-right): wrong*diagnosis: causal aligned "
                              "top-left*"])
    ok = pytester.runpytest(*LOAD, "--attn-impl", "fns.py:correct",
                            "--attn-quick")
    assert ok.ret == 0
    assert ok.parseoutcomes()["passed"] >= 10


def test_plugin_is_idle_without_the_option(pytester):
    pytester.makepyfile(test_mine="def test_one():\n    pass\n")
    res = pytester.runpytest(*LOAD)
    res.assert_outcomes(passed=1)


def test_conformance_cases_in_a_users_parametrize(pytester):
    pytester.makepyfile(fns=FUNCTIONS)
    pytester.makepyfile(test_mine='''
import pytest
from attn.testing import conformance_cases
from fns import top_left

@pytest.mark.parametrize("case", conformance_cases(["causal", "causal Nq<Nk (bottom-right)"]),
                         ids=str)
def test_mine(case):
    case.check(top_left)
''')
    pytester.syspathinsert()
    res = pytester.runpytest("-q")
    res.assert_outcomes(passed=1, failed=1)
    res.stdout.fnmatch_lines(["*test_mine?causal Nq<Nk (bottom-right)?*"])


def test_entry_point_declared():
    meta = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["pytest11"] == {"attn": "attn.pytest_plugin"}
