"""The autotune config choice of the triton kernels (pure Python: no compile, no GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from attn.flash_triton import tune  # noqa: E402


def _args(d: int, dtype=torch.bfloat16, n: int = 4096, mask_kind: int = 0) -> dict:
    return dict(TUNE_N=n, BLOCK_D=d, BLOCK_DV=d, Q=torch.empty(1, dtype=dtype),
                MASK_KIND=mask_kind)


@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_autotune_off_launches_one_kept_config_near_64x64(kind, d, monkeypatch):
    configs = tune.gpu_configs(kind)
    monkeypatch.setenv("ATTN_TRITON_AUTOTUNE", "1")
    kept = tune._prune(configs, _args(d), kind=kind, arch=90)
    assert len(kept) > 1  # autotuning: every kept config is timed
    monkeypatch.setenv("ATTN_TRITON_AUTOTUNE", "0")
    (one,) = tune._prune(configs, _args(d), kind=kind, arch=90)
    assert one in kept
    size = one.kwargs["BLOCK_M"] * one.kwargs["BLOCK_N"]
    assert size <= 64 * 64 and one.num_stages == 2  # never the largest, deepest config
    if d <= 64:
        assert (one.kwargs["BLOCK_M"], one.kwargs["BLOCK_N"], one.num_warps) == (64, 64, 4)


@pytest.mark.parametrize("value,off", [("0", True), ("off", True), ("False", True),
                                       ("1", False), ("", False), ("on", False)])
def test_autotune_switch_reads_the_environment(value, off, monkeypatch):
    monkeypatch.setenv("ATTN_TRITON_AUTOTUNE", value)
    assert tune.autotune_off() is off


@pytest.mark.parametrize("heavy", [dict(HAS_DROPOUT=True), dict(MASK_KIND=1),
                                   dict(SCORE=(True, False, False))])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_dkdv_with_heavy_scores_keeps_smaller_tiles(heavy, d):
    """dK/dV with dropout, a softcap or a mask keeps tiles up to _HEAVY_DKDV_MAX_TILE (the
    larger ones spilled past 1 KiB on sm_90: tests/test_triton_compile.py builds the largest
    kept); the same launch without them keeps the larger tiles at D = 64."""
    configs = tune.gpu_configs("dkdv")
    kept = tune.prune_for(configs, {**_args(d), **heavy}, kind="dkdv", arch=90)
    assert kept and all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * d
                        <= tune._HEAVY_DKDV_MAX_TILE for c in kept)
    plain = tune.prune_for(configs, _args(d), kind="dkdv", arch=90)
    if d == 64:
        assert any(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] == 64 * 128 for c in plain)


@pytest.mark.parametrize("triton_36", [True, False])
def test_dkdv_keeps_wide_tiles_at_d128_only_where_they_build_without_spilling(triton_36,
                                                                                monkeypatch):
    """dK/dV's 64 x 128, 8-warp tiles (wgmma n64) at D = 128: kept on sm_90 with triton 3.6
    for dense plain launches, where ptxas spills 480-924 bytes; not with triton 3.9 (1.1-1.6
    KB), packed sequences (6.9-7.7 KB), sm_80 or heavy scores. The second CI environment
    (triton 3.6) builds the largest kept config and fails past 1 KiB
    (tests/test_triton_compile.py)."""
    monkeypatch.setattr(tune, "_TRITON_36", triton_36)
    configs = tune.gpu_configs("dkdv")

    def wide(args, arch=90):
        return sorted(c.num_stages for c in tune.prune_for(configs, args, kind="dkdv",
                                                           arch=arch)
                      if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) == (64, 128))

    assert wide(_args(128)) == ([2, 3] if triton_36 else [])
    assert wide({**_args(128), "BANDED": True}) == ([2, 3] if triton_36 else [])
    for other in ({**_args(128), "VARLEN": True}, {**_args(128), "HAS_DROPOUT": True},
                  _args(128, dtype=torch.float32)):
        assert wide(other) == []
    assert wide(_args(128), arch=80) == []


class _Recording(dict):
    """Launch arguments that remember which of them were read."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)

    def get(self, name, default=None):
        self.read.add(name)
        return super().get(name, default)

    def __contains__(self, name) -> bool:  # asking whether an argument is there reads it
        found = super().__contains__(name)
        if found:
            self.read.add(name)
        return found


@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq", "jvp"])
def test_the_autotune_key_holds_every_argument_pruning_reads(kind):
    """triton's autotuner keeps one pick per key: an argument the pruning rules read that the
    key lacks would hand a launch the pick pruned for another (a plain launch's config to a
    float-masked one, whose mask tile may not fit shared memory)."""
    from attn.flash_triton import outer

    kernel = {"fwd": outer._attn_fwd, "dkdv": outer._attn_bwd_dkdv, "dq": outer._attn_bwd_dq,
              "jvp": outer._attn_jvp}[kind]
    own = {"dq": {"DELTA_PASS": False}, "jvp": {"TAN": (True,) * 5}}.get(kind, {})
    args = _Recording({**_args(128, mask_kind=2), "HAS_DROPOUT": True, "BANDED": True,
                       "VARLEN": False, "SCORE": (True, False, False), **own})
    tune.prune_for(tune.gpu_configs(kind), args, kind=kind, arch=90)
    tune.tuned_key(kind, args, 90)
    assert args.read - {"Q"} <= set(kernel.keys), args.read - set(kernel.keys)  # Q: its dtype


def test_a_masked_launch_never_takes_a_config_pruned_for_a_plain_one():
    """The case the key guards: at D = 256 a float mask's tile leaves fewer configs in shared
    memory than a plain launch of the same shape keeps."""
    configs = tune.gpu_configs("fwd")
    plain = tune.prune_for(configs, _args(256), kind="fwd", arch=80)
    masked = tune.prune_for(configs, _args(256, mask_kind=2), kind="fwd", arch=80)
    assert set(map(str, plain)) - set(map(str, masked))
