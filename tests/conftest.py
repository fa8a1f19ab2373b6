import os

import pytest
import torch

# Without a GPU the Triton kernels run in the interpreter. triton reads this when a kernel is
# decorated, i.e. when attn.flash_triton is first imported: set it before any test module can
# import attn, so the collection order of test files cannot matter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=[(16, 32), None], ids=["blocks16x32", "blocks-default"])
def tiled_blocks(request, monkeypatch):
    """Run tiled with small blocks too, so awkward sizes cross many tile edges."""
    import attn.tiled

    if request.param is not None:
        monkeypatch.setattr(attn.tiled, "BLOCK_M", request.param[0])
        monkeypatch.setattr(attn.tiled, "BLOCK_N", request.param[1])
    return request.param


@pytest.fixture
def small_blocks(monkeypatch):
    """tiled with 16 x 32 tiles: every variant crosses tile edges even at small N."""
    import attn.tiled

    monkeypatch.setattr(attn.tiled, "BLOCK_M", 16)
    monkeypatch.setattr(attn.tiled, "BLOCK_N", 32)
