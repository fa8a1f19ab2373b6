"""Shared by the benchmark suites: CUDA cases skip cleanly without a GPU.

Save a run, change something, compare (groups put every backend of one shape side by side):

    pytest benchmarks/ --benchmark-autosave
    pytest benchmarks/ --benchmark-compare          # against the latest saved run
"""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
