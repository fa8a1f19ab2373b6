"""The Triton kernels, compiled for real GPUs (sm_90, sm_80) on this CPU-only machine.

The interpreter tests check what the kernels compute; these check what the compiler makes of
them: that every kernel the backend launches builds for both archs, that its bf16 dots run
on tensor cores (``wgmma`` on sm_90, ``mma.sync`` on sm_80), that with ``num_stages >= 2``
its K/V (or Q/dO) loads are software-pipelined (asynchronous copies or TMA in the TTGIR),
and that its shared memory fits the arch. Launch arguments come from the backend's own
launchers, specialized by triton's own binder (see :mod:`attn.bench.compile`).

The builds run in a child process: this pytest process imported the kernels in interpreter
mode (``tests/conftest.py``), and the compiler needs them decorated without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

# A covering set for the default suite: every D with the variant flags off and on, each arch
# at every D; `-m slow` builds the full product and every config _prune keeps.
DEFAULT_CASES = [(90, 64, "all"), (90, 128, "plain"), (90, 256, "all"),
                 (80, 64, "plain"), (80, 128, "all"), (80, 256, "plain")]
# packed sequences (every flag on; sm_90 only here, both archs under -m slow: the varlen flag
# changes addressing, not how the dots lower) and split-KV decoding (every flag its kernels
# take), at head dims the dense cases pair differently
DEFAULT_CASES += [(90, 128, "varlen"), (90, 256, "decode"), (80, 64, "decode")]
FULL_CASES = [(a, d, v) for a in (90, 80) for d in (64, 128, 256)
              for v in ("plain", "causal", "all", "varlen", "decode")]
# decoding from a paged cache (its page-table load, every flag it takes): sm_90 by default,
# sm_80 with the rest under -m slow
DEFAULT_CASES += [(90, 128, "paged")]
FULL_CASES += [(a, d, "paged") for a in (90, 80) for d in (64, 128, 256)]
# ... and from a quantized cache (int4 codes, per-channel key scales, recent pages: the most
# of its dequantizing load), likewise
DEFAULT_CASES += [(90, 128, "paged_int4")]
FULL_CASES += [(a, d, "paged_int4") for a in (90, 80) for d in (64, 128, 256)]
# float32 at D = 128 for sm_90, each dense kernel's largest kept config, with ptxas -v
FP32_KERNELS = ["_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_jvp"]

_CHILD = textwrap.dedent("""
    import json, sys
    from concurrent.futures import ProcessPoolExecutor
    from dataclasses import asdict

    DENSE_DOT = ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_jvp")

    def build(task):
        import torch
        from attn.bench import compile as aot
        arch, d, variant, dtype, only, every = task
        out = []
        for launch in aot.record_launches(head_dim=d, variant=variant,
                                          dtype=getattr(torch, dtype)):
            if only is not None and launch.name != only:
                continue
            if launch.name == "_attn_jvp" and only is None and not every and variant == "plain":
                continue  # the default suite builds the forward-mode kernel with flags on
            cfgs = launch.configs(arch=arch)
            if isinstance(every, str):  # one named config, kept or not
                cfgs = [c for c in launch.configs(arch=arch, pruned=False)
                        if aot._config_name(c) == every]
                variant = "loop"
            # registers, spills and the loop's SASS: the named builds, and the dense dot
            # kernels on sm_90
            measure = only is not None or (arch >= 90 and launch.name in DENSE_DOT)
            for cfg in (cfgs if every else [aot.largest(cfgs)]):
                out.append(asdict(aot.compile_launch(launch, cfg, arch=arch, variant=variant,
                                                     ptxas_verbose=measure)))
        return out

    if __name__ == "__main__":
        tasks = [tuple(t) for t in json.loads(sys.argv[1])]
        with ProcessPoolExecutor(max_workers=2) as pool:
            builds = [b for bs in pool.map(build, tasks) for b in bs]
        print(json.dumps(builds))
""")


def _cost(task: list) -> float:
    """A rough build time, to hand the two workers the longest tasks first (measured on the
    2-core CI machine: every flag on and D = 128 cost most, a split-KV case a few seconds)."""
    arch, d, variant, dtype, only, every = task
    if only is not None:
        return 8.0
    return {"decode": 4.0, "paged": 6.0, "paged_int4": 8.0,
            "plain": 8.0 + d / 32}.get(variant, 16.0 + d / 16)


def _compile(cases: list[tuple], every_config: bool, timeout: int,
             fp32_kernels: tuple[str, ...] = (), loop_config: str | None = None) -> list[dict]:
    """Build ``cases`` (bf16) and, each alone with ptxas -v, the float32 D = 128 sm_90
    ``fp32_kernels`` and the bf16 D = 128 sm_90 forward at ``loop_config`` (variant
    "loop"), in one child process with two workers."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, without its warning
    tasks = [[a, d, v, "bfloat16", None, every_config] for a, d, v in cases]
    tasks += [[90, 128, "plain", "float32", k, False] for k in fp32_kernels]
    if loop_config:
        tasks.append([90, 128, "plain", "bfloat16", "_attn_fwd", loop_config])
    tasks.sort(key=_cost, reverse=True)
    try:
        res = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(tasks)],
                             capture_output=True, text=True, env=env, timeout=timeout,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    except subprocess.TimeoutExpired:
        pytest.fail(f"compiling the kernels took more than {timeout} s")
    if res.returncode != 0:
        pytest.fail(f"the compile process failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def default_builds() -> list[dict]:
    """The default cases and the float32 builds, compiled together (one child, one import of
    torch and triton, and the two workers kept busy to the end)."""
    return _compile(DEFAULT_CASES, every_config=False, timeout=600,
                    fp32_kernels=tuple(FP32_KERNELS), loop_config=FWD_LOOP_CONFIG)


def _label(b: dict) -> str:
    return f"{b['kernel']} sm_{b['arch']} D={b['head_dim']} {b['variant']} [{b['config']}]"


def _check(builds: list[dict]) -> None:
    from attn.bench.compile import NO_DOT, SMEM_LIMIT

    problems = []
    for b in builds:
        if b["error"]:
            problems.append(f"{_label(b)} does not compile: {b['error']}")
            continue
        if b["shared"] > SMEM_LIMIT[b["arch"]]:
            problems.append(f"{_label(b)} needs {b['shared'] // 1024} KiB of shared memory, "
                            f"sm_{b['arch']} has {SMEM_LIMIT[b['arch']] // 1024} KiB")
        if b["kernel"] in NO_DOT:
            continue  # a row reduction: no dots, nothing to pipeline
        if not b["tensor_cores"]:
            problems.append(f"{_label(b)}: bf16 dots did not lower to the arch's tensor-core "
                            f"instructions (wgmma on sm_90, mma.sync on sm_80)")
        if b["arch"] >= 90 and b["mma_sync"]:
            problems.append(f"{_label(b)}: mma.sync on sm_90 (dots that missed wgmma)")
        if b["num_stages"] >= 2 and not b["pipelined"]:
            problems.append(f"{_label(b)}: num_stages={b['num_stages']} but no asynchronous "
                            f"copies or TMA loads in the TTGIR (loads not pipelined)")
    assert not problems, "\n".join(problems)


# The forward's steady loop on sm_90 at 128 x 128 tiles, D = 128, 8 warps, 3 stages: at most
# this many SASS instructions per iteration (888 with triton 3.9 and 3.6 before the base-2
# softmax; 557 / 529 after), no more than 1 KiB of spills, both tensor products on wgmma
# at N >= 64. And every kept config of the default cases spills at most SPILL_LIMIT.
FWD_LOOP_CONFIG = "BLOCK_M=128 BLOCK_N=128 w8 s3"
FWD_LOOP_BOUND = 560
SPILL_LIMIT = 1024


def test_every_kernel_builds_for_sm90_and_sm80(default_builds):
    builds = [b for b in default_builds if b["dtype"] == "bfloat16" and b["variant"] != "loop"]
    kernels = {b["kernel"] for b in builds}
    assert kernels == {"_attn_fwd", "_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq",
                       "_attn_fwd_split", "_attn_split_combine", "_attn_fwd_paged", "_attn_jvp"}
    built = {(b["variant"], b["kernel"]) for b in builds}
    assert {("varlen", k) for k in ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq",
                                    "_attn_jvp")} <= built
    # the forward-mode kernel on both archs, every flag on (its heaviest tiles)
    assert {(b["arch"], b["variant"]) for b in builds if b["kernel"] == "_attn_jvp"} >= {
        (90, "all"), (80, "all")}
    _check(builds)


@pytest.mark.slow
def test_every_pruned_config_builds_everywhere():
    _check(_compile(FULL_CASES, every_config=True, timeout=7200))


def test_float32_configs_do_not_spill(default_builds):
    """float32 dots run as exact FMAs without tensor cores, so the product tile sits in
    registers: the largest config _prune keeps at D = 128 must build for sm_90 with at most
    3 KiB of spills per thread (4-warp tiles spilled up to 179 KB and ran for minutes on an
    H100; the forward's smallest 8-warp tile spills 2.8 KB with triton 3.6, none with 3.9)."""
    builds = [b for b in default_builds if b["dtype"] == "float32"]
    builds = [b for b in builds if b["variant"] != "loop"]
    assert {b["kernel"] for b in builds} == set(FP32_KERNELS)  # dQ twice: with its Δ pass too
    for b in builds:
        assert not b["error"], (_label(b), b["error"])
        assert b["spill_bytes"] is not None and b["spill_bytes"] <= 3072, (_label(b), b)


def test_forward_steady_loop_is_short_on_sm90(default_builds):
    """The base-2 softmax's steady loop: exp2 of one FFMA per score, the row max on raw q·k
    (see attn.flash_triton.kernels._softmax_step). A regression to exp, a scale applied
    before the max, or extra address work per tile pushes it past FWD_LOOP_BOUND."""
    (b,) = [b for b in default_builds if b["variant"] == "loop"]
    assert not b["error"], b["error"]
    assert b["loop_sass"] is not None and b["loop_sass"] <= FWD_LOOP_BOUND, (_label(b), b)
    assert b["spill_bytes"] is not None and b["spill_bytes"] <= SPILL_LIMIT, (_label(b), b)
    assert b["wgmma_n"] is not None and b["wgmma_n"] >= 64 and not b["mma_sync"], b


def test_kept_dense_configs_spill_at_most_1_kib_on_sm90(default_builds):
    """The largest config _prune keeps for each dense kernel (forward, dK/dV, dQ, JVP) of the
    default sm_90 cases, every variant flag on included, spills at most SPILL_LIMIT bytes
    per thread (ptxas -v): a kept config that spills more is a tile rule to fix in
    attn.flash_triton.tune."""
    builds = [b for b in default_builds if b["arch"] == 90 and b["dtype"] == "bfloat16"
              and b["kernel"] in ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_jvp")
              and b["variant"] != "loop" and b["head_dim"] <= 128]
    # (D = 256 with every flag on: dK/dV's smallest tile, 16 x 64, spills 1468 bytes with
    # triton 3.9; no config is smaller)
    assert {b["variant"] for b in builds} >= {"plain", "all", "varlen"}
    over = [f"{_label(b)}: {b['spill_bytes']} bytes" for b in builds
            if b["spill_bytes"] is None or b["spill_bytes"] > SPILL_LIMIT]
    assert not over, "\n".join(over)
