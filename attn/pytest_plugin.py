"""pytest plugin: ``pytest --attn-impl mypkg.mod:fn`` runs attn's conformance matrix as tests,
one item per case (:func:`attn.conformance.run_case`); idle without ``--attn-impl``. Items,
verdicts and loading it without the entry point: docs/conformance.md, "As pytest items".
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attn", "attn's conformance matrix (attn check) as tests")
    group.addoption("--attn-impl", action="append", default=[], metavar="TARGET",
                    help="module:function or path/to/file.py:function to check (repeatable)")
    group.addoption("--attn-style", default="auto", choices=("auto", "attn", "torch", "flash",
                                                              "hf"),
                    help="calling style of the targets (default: from the signature)")
    group.addoption("--attn-layout", default=None, choices=("bhnd", "bnhd"),
                    help="layout of the targets' q, k, v and out (default: the style's)")
    group.addoption("--attn-dtype", default="float32",
                    choices=("float32", "float16", "bfloat16", "float64"))
    group.addoption("--attn-device", default="cpu")
    group.addoption("--attn-quick", action="store_true", help="leave out the N = 1025 cases")


class ConformanceFailure(Exception):
    """A wrong, NaN or error row; its text is the row's verdict and diagnosis."""


class ConformanceItem(pytest.Item):
    def __init__(self, *, fn, case, **kwargs):
        super().__init__(**kwargs)
        self.fn, self.case = fn, case

    def runtest(self) -> None:
        import torch

        from attn.conformance import run_case

        opt = self.config.getoption
        row = run_case(self.fn, self.case, getattr(torch, opt("attn_dtype")), opt("attn_device"))
        if row.status == "not supported":
            pytest.skip(row.text())
        if row.failed:
            raise ConformanceFailure(f"{self.case.name}: {row.text()}")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ConformanceFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, None, f"attn check {self.fn.name}: {self.case.name}"


class ConformanceTarget(pytest.Collector):
    """The matrix for one target: one item per case."""

    def __init__(self, *, fn, cases, **kwargs):
        super().__init__(**kwargs)
        self.fn, self.cases = fn, cases

    def collect(self):
        return [ConformanceItem.from_parent(self, name=c.name, fn=self.fn, case=c)
                for c in self.cases]


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect, so they apply to these items too
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    targets = config.getoption("attn_impl")
    if not targets:
        return
    from attn.adapters import adapt, load_target
    from attn.testing import conformance_cases

    cases = conformance_cases(quick=config.getoption("attn_quick"))
    for spec in targets:
        try:
            fn = adapt(load_target(spec), style=config.getoption("attn_style"),
                       layout=config.getoption("attn_layout"), name=spec)
        except ValueError as e:
            raise pytest.UsageError(f"--attn-impl: {e}") from e
        target = ConformanceTarget.from_parent(session, name=f"attn-check[{spec}]", fn=fn,
                                               cases=cases)
        items.extend(target.collect())
