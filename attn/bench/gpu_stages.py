"""The stages of ``attn gpu-check``, each run in a process of its own (docs/gpu.md: the stages,
why a process each, their boxes, what each drops to fit and the dry run).
``python -m attn.bench.gpu_stages MODULE:FUNCTION CONTEXT_JSON`` runs one stage function with
its :class:`~attn.bench.gpu_record.StageContext`.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import platform
import signal
import subprocess
import sys
import traceback
from functools import partial
from importlib.util import find_spec
from pathlib import Path
from unittest import mock

import torch

import attn
from attn.bench.competitors import SDPA_KERNELS, flex_variant
from attn.bench.flops import matmul_tflops
from attn.bench.gpu_record import StageContext, exc_line
from attn.sdpa import torch_sdpa
from attn.testing import compare_to_reference, make_inputs
from attn.timing import benchmark
from attn.varlen import cu_seqlens_from_lengths, unpack

GPU_ONLY = "GPU only"
# the triton outer kernels by the kind their autotune configs are listed under
_KERNELS = {"fwd": "_attn_fwd", "dkdv": "_attn_bwd_dkdv", "dq": "_attn_bwd_dq"}


def _device(ctx: StageContext) -> str:
    return "cpu" if ctx.dry_run else "cuda"


def _fits(ctx: StageContext, nbytes: float, what: str) -> bool:
    """Whether a point predicted to need ``nbytes`` stays under 60% of free memory; when not,
    it is recorded as skipped with the prediction (an out-of-memory kill ends the stage)."""
    from attn.bench.sweep import available_memory_bytes

    free = available_memory_bytes(_device(ctx))
    if nbytes <= 0.6 * free:
        return True
    ctx.row(kind="skip", what=what, status="skipped",
            note=f"predicted {nbytes / 2**30:.1f} GiB > 60% of {free / 2**30:.1f} GiB free")
    ctx.log(f"{what}: skipped, predicted {nbytes / 2**30:.1f} GiB of {free / 2**30:.1f} free")
    return False


def _time_ms(ctx: StageContext, fn, repeats: int) -> float:
    return benchmark(fn, device=_device(ctx), warmup=1, repeats=repeats, min_repeats=1,
                     budget_s=0.05 if ctx.dry_run else 1.0).median_ms


def _try_ms(ctx: StageContext, fn, repeats: int, **row) -> float | None:
    """:func:`_time_ms` of ``fn`` without autograd, or None after a failed row with
    ``row``'s fields (a point that raises is its result, not the stage's error)."""
    try:
        with torch.no_grad():
            return _time_ms(ctx, fn, repeats)
    except Exception as exc:
        ctx.row(**row, status="failed", note=exc_line(exc))
        return None


# -- 1. env ------------------------------------------------------------------------------------

def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None


def env(ctx: StageContext) -> None:
    """Device, versions, and the ceilings measured now: bf16 matmul TFLOP/s and
    device-to-device copy GB/s."""
    from attn.bench import report

    dev = _device(ctx)
    facts = {"device_name": report.device_name(dev), "torch": torch.__version__,
             "triton": report._triton_version(), "python": platform.python_version(),
             "cuda": torch.version.cuda, "cpu_count": os.cpu_count()}
    if dev == "cuda":
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        facts.update(sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                     memory_gib=round(total / 2**30, 1), free_gib=round(free / 2**30, 1),
                     driver=_driver())
    for item, value in facts.items():
        ctx.row(kind="env", item=item, value=value)
    ctx.info(**facts)
    ctx.log(", ".join(f"{k} {v}" for k, v in facts.items()))
    n = 256 if ctx.dry_run else 8192
    rate = matmul_tflops(dev, torch.bfloat16, n=n, repeats=2 if ctx.dry_run else 10)
    ctx.row(kind="env", item=f"bf16 matmul {n}³, TFLOP/s", value=round(rate, 3))
    ctx.info(matmul_tflops={"bfloat16": rate})
    ctx.log(f"bf16 matmul {n}³: {rate:.3g} TFLOP/s")
    nbytes = (16 if ctx.dry_run else 1024) * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = benchmark(lambda: dst.copy_(src), device=dev, warmup=2, repeats=10)
    gbps = 2 * nbytes / (t.median_ms * 1e-3) / 1e9  # read and write
    ctx.row(kind="env", item=f"copy {nbytes >> 20} MiB, GB/s (read + write)",
            value=round(gbps, 1))
    ctx.info(copy_gb_per_s=gbps)
    ctx.log(f"copy {nbytes >> 20} MiB: {gbps:.4g} GB/s")


# -- 2. correctness ----------------------------------------------------------------------------

def _pytest_command(ctx: StageContext) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider",
           "-p", "no:benchmark", "-p", "attn.bench.gpu_pytest"]
    if ctx.dry_run:
        # on CPU `-m cuda` selects only tests that skip: run one interpreter case instead,
        # through the same plugin and files
        cmd += ["-m", "not slow", "-k", "test_forward_deterministic",
                str(Path(ctx.tests) / "test_triton.py")]
    else:
        # NCCL's own test runs in the context-parallel stage, alone on the GPU: among 13
        # other pytest workers it ran out of memory in its first call
        cmd += ["-m", "cuda and not slow", "-k", "not test_nccl_world_size_one", ctx.tests]
        if find_spec("xdist") is not None:
            cmd += ["-n", str(max(1, ctx.cores - 2))]
    if find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", "150"]
    return cmd


@contextlib.contextmanager
def _pytest_beside(ctx: StageContext):
    """pytest in its own process (its own session, so a kill reaches its xdist workers), its
    output to pytest.txt, while the body runs; then waited for until the box (less a few
    seconds to write), and cut there. Nothing to run when there is no tests folder."""
    if not Path(ctx.tests).is_dir():
        ctx.dropped("pytest -m cuda", f"no tests folder at {ctx.tests} (run from a checkout "
                                      "or give --tests)")
        yield
        return
    cmd = _pytest_command(ctx)
    env = {**os.environ, "ATTN_GPU_CHECK_LOG": str(Path(ctx.out) / "log.txt"),
           "ATTN_GPU_CHECK_ROWS": ctx.scratch}
    ctx.log(f"{' '.join(cmd[1:])}")
    with open(Path(ctx.out) / "pytest.txt", "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                cwd=Path(ctx.tests).parent, start_new_session=True)
        yield
        try:
            rc = proc.wait(timeout=max(ctx.left() - 5, 1))
            ctx.log(f"pytest exit code {rc}")
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its xdist workers too
            proc.wait()
            ctx.dropped("the rest of pytest -m cuda",
                        f"cut at the stage's {ctx.budget_s:.0f} s box")
            f.write(f"\n[attn gpu-check: pytest cut at the stage's {ctx.budget_s:.0f} s box]\n")


def _triton_inputs(ctx: StageContext, B: int, H: int, N: int, D: int, Hkv: int | None = None):
    q, k, v = make_inputs(B=B, H=H, Hkv=Hkv, N=N, D=D, dtype=torch.bfloat16,
                          device=_device(ctx), seed=N)
    return tuple(t.requires_grad_() for t in (q, k, v))


def _determinism(ctx: StageContext) -> None:
    """The forward and dK/dV, called again and again on the same inputs: bit for bit equal."""
    runs = 2 if ctx.dry_run else 100  # the dry run: one repeat shows the comparison works
    shape = dict(B=1, H=2, N=40, D=16) if ctx.dry_run else dict(B=2, H=8, N=2048, D=128)
    q, k, v = _triton_inputs(ctx, **shape)
    do = torch.randn_like(q)
    what = ", ".join(f"{n}={x}" for n, x in shape.items()) + ", bf16, causal"

    def fwd():
        with torch.no_grad():
            return (attn.attention(q, k, v, causal=True, backend="triton"),)

    def dkdv():
        out = attn.attention(q, k, v, causal=True, backend="triton")
        return torch.autograd.grad(out, (k, v), do)

    for name, fn in (("forward", fwd), ("dK/dV", dkdv)):
        first = fn()
        done, same = 1, True
        while done < runs and ctx.left() > 10:
            same &= all(torch.equal(a, b) for a, b in zip(first, fn()))
            done += 1
        if done < runs:
            ctx.dropped(f"determinism {name}: runs {done + 1}-{runs}", "the box ran short")
        ctx.row(kind="check", check="determinism", what=f"{name}: {done} runs, {what}",
                status="ok" if same else "failed",
                note="" if same else "outputs differ between identical calls")
        ctx.log(f"determinism {name}: {done} runs, {'bitwise equal' if same else 'DIFFER'}")


def _variant_kwargs(name: str, H: int, N: int, dev: str) -> dict:
    """attn.attention keywords of one variant (Hkv through the ``gqa`` name)."""
    g = torch.Generator().manual_seed(N)
    extra = {"softcap": {"softcap": 20.0}, "window": {"window": (max(N // 4, 1), 0)},
             "dropout": {"dropout_p": 0.1}, "temperature": {"temperature": 0.5},
             "causal": {}, "gqa": {}}
    if name in extra:
        return {"causal": True, **extra[name]}
    if name == "plain":
        return {}
    if name == "sinks":
        return {"causal": True, "sinks": torch.randn(H, generator=g).to(dev).requires_grad_()}
    if name == "alibi":
        slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)
        return {"causal": True, "alibi_slopes": slopes.to(dev)}
    if name == "float_mask":
        mask = torch.randn(N, N, generator=g)
        mask[torch.rand(N, N, generator=g) < 0.2] = float("-inf")
        return {"attn_mask": mask.to(dev, torch.bfloat16)}
    if name == "bool_mask":
        return {"attn_mask": (torch.rand(N, N, generator=g) > 0.2).to(dev)}
    raise ValueError(f"unknown variant {name!r}")


VARIANTS = ("plain", "causal", "softcap", "sinks", "window", "gqa", "alibi", "dropout",
            "float_mask", "bool_mask", "temperature")


def _nan_scan(ctx: StageContext) -> None:
    """Every variant on triton, forward and backward, at lengths that leave tiles partly
    empty: out and every gradient finite."""
    lengths = (5,) if ctx.dry_run else (17, 1, 4097, 2, 5)
    H, D = (4, 16) if ctx.dry_run else (8, 64)
    if ctx.dry_run:
        ctx.dropped("NaN scan N=1, 2, 17, 4097", "dry run: the interpreter takes a second a "
                                                 "call")
    for N in lengths:
        for name in VARIANTS:
            if ctx.left() < 10:
                ctx.dropped(f"NaN scan N={N} {name} and after", "the box ran short")
                return
            q, k, v = _triton_inputs(ctx, 1, H, N, D, Hkv=H // 4 if name == "gqa" else None)
            kw = _variant_kwargs(name, H, N, _device(ctx))
            try:
                torch.manual_seed(0)
                out = attn.attention(q, k, v, backend="triton", **kw)
                leaves = [t for t in (q, k, v, kw.get("sinks")) if t is not None]
                grads = torch.autograd.grad(out, leaves, torch.randn_like(out))
                bad = [n for n, t in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads))
                       if not torch.isfinite(t).all()]
                status, note = ("failed", "not finite: " + ", ".join(bad)) if bad else ("ok", "")
            except Exception as exc:  # a crash here is this point's result
                status, note = "failed", exc_line(exc)
            ctx.row(kind="check", check="nan scan", what=f"{name} N={N}", status=status,
                    note=note)
            ctx.log(f"nan scan {name} N={N}: {status} {note}")


def _compile_check(ctx: StageContext) -> None:
    """torch.compile(fullgraph=True) of an attn.nn module on triton against eager."""
    if ctx.dry_run:
        ctx.row(kind="check", check="torch.compile", what="MultiHeadAttention, fullgraph",
                status="skipped", note=f"{GPU_ONLY}: inductor around the triton op compiles "
                                       "for minutes on CPU")
        return
    from attn.nn import MultiHeadAttention

    torch.manual_seed(0)
    m = MultiHeadAttention(256, 4, causal=True, backend="triton").cuda().to(torch.bfloat16)
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    try:
        eager = m(x)
        got = torch.compile(m, fullgraph=True)(x)
        err = (got.float() - eager.float()).abs().max().item()
        ok = err <= 2e-2 * eager.float().abs().max().item() + 1e-3
        status, note = ("ok" if ok else "failed"), f"max abs difference {err:.2e}"
    except Exception as exc:
        status, note = "failed", exc_line(exc)
    ctx.row(kind="check", check="torch.compile", what="MultiHeadAttention(256, 4), bf16, "
            "fullgraph", status=status, note=note)
    ctx.log(f"torch.compile fullgraph vs eager: {status} ({note})")


def correctness(ctx: StageContext) -> None:
    """pytest -m cuda in its own process and, beside it on the cores its workers leave free,
    determinism, the NaN scan and the torch.compile check, until the box ends (docs/gpu.md)."""
    with _pytest_beside(ctx):
        _determinism(ctx)
        _compile_check(ctx)
        _nan_scan(ctx)


# -- 3. speed and memory -----------------------------------------------------------------------

def _speed_config(ctx: StageContext):
    from attn.bench.sweep import SweepConfig

    if ctx.dry_run:
        return SweepConfig(n=(32, 64), backends=("tiled", "sdpa", *SDPA_KERNELS), d=(16,),
                           causal=(False, True), dtypes=("bfloat16",), batch=1, heads=2,
                           device="cpu", repeats=2, warmup=1, min_repeats=1, budget_s=0.02)
    # issue 39's speed core: N 4k and 16k against cuDNN, FA2 and compiled flex, and torch's
    # own pick (sdpa: what a user swapping F.scaled_dot_product_attention runs, and the
    # ratio_to_sdpa baseline); the efficient kernel, never the fastest on Hopper, is left out
    return SweepConfig(n=(4096, 16384), backends=("triton", "sdpa", "sdpa-cudnn",
                                                  "sdpa-flash", "flex"),
                       d=(64, 128), causal=(False, True), dtypes=("bfloat16",), tokens=16384,
                       width=2048, device="cuda", repeats=10, warmup=2, min_repeats=2,
                       budget_s=0.5, matmul_n=8192)


def _priority(row) -> tuple:
    """D=128 before 64, then N = 4096 before 16384, and at each N: fwd, fwd+bwd, causal fwd,
    causal fwd+bwd, so a short box still holds every mode at one N."""
    return (-row.D, row.N, row.causal, row.mode != "fwd")


def autotune_picks() -> dict[str, str]:
    """The config each triton outer kernel's autotuner used last (its ``best_config``)."""
    try:
        import attn.flash_triton as ft
    except ImportError:
        return {}
    return {kind: str(best) for kind, name in _KERNELS.items()
            if (best := getattr(getattr(ft, name, None), "best_config", None)) is not None}


def _group(row) -> str:
    return f"{row.backend} {row.mode} D={row.D}{' causal' if row.causal else ''}"


def speed(ctx: StageContext) -> None:
    """Triton against torch's kernels (attn.bench.sweep, autotuning on), then the variant costs
    (:func:`_variant_costs`), which keep the last 40% of the box (docs/gpu.md: the speed row)."""
    from attn.bench.sweep import finish, measure_matmul_rates, plan, run_sweep

    cfg = _speed_config(ctx)
    if ctx.dry_run:
        ctx.dropped("triton and flex points", f"{GPU_ONLY}: the timing path runs on tiled "
                                              "and torch SDPA here")
    rows = sorted(plan(cfg), key=_priority)
    rate = ctx.env.get("matmul_tflops") or measure_matmul_rates(cfg)
    reserve = 0.4 * ctx.budget_s  # for the variant costs and their flex compiles
    if rows:
        ctx.running(_group(rows[0]) + f" N={rows[0].N}")
    for i, row in enumerate(run_sweep(cfg, rows)):
        r = finish([row], rate)[0]
        extra = autotune_picks() if r.backend == "triton" and r.status == "ok" else {}
        ctx.row(kind="speed", **r.as_dict(), autotune=extra)
        ctx.log(r.line())
        if i + 1 < len(rows):
            ctx.running(_group(rows[i + 1]) + f" N={rows[i + 1].N}")
        if i + 1 < len(rows) and ctx.left() < reserve:
            left: dict[str, list[int]] = {}
            for x in rows[i + 1:]:
                left.setdefault(_group(x), []).append(x.N)
            for g, ns in left.items():
                ctx.dropped(f"speed {g} N={','.join(map(str, ns))}", "the box ran short")
            break
    _variant_costs(ctx)


# variants timed against compiled flex on the same variant too (issue 39's target: flex ms /
# triton ms >= 1.2); they come right after plain causal, so a short box still holds them
FLEX_COMPARED = ("softcap", "window", "alibi", "sinks")
VARIANT_COSTS = ("causal", *FLEX_COMPARED, "gqa", "dropout", "float_mask")


def _flex_side(ctx: StageContext, name: str, kw: dict, q, k, v, ours, ours_ms: float) -> dict:
    """The flex fields of a variant's row: compiled flex on the same variant and inputs
    (compiled before the timing), its ms, ``flex_ratio`` = flex ms / ours ms and its largest
    difference from our output; or why flex did not run."""
    fn = flex_variant(kw, q.shape[2], _device(ctx))
    if isinstance(fn, str):  # a variant flex cannot express
        return {"flex_status": "skipped", "flex_note": fn}
    if ctx.dry_run:
        return {"flex_status": "skipped",
                "flex_note": f"{GPU_ONLY}: compiling flex takes ~10 s a variant on CPU"}
    if ctx.left() < 30:
        ctx.dropped(f"variant {name}: flex", "the box ran short (a flex compile takes ~10 s)")
        return {"flex_status": "skipped", "flex_note": "the box ran short"}
    ctx.running(f"variant {name}: compiling flex")

    def call():
        with torch.no_grad():
            return fn(q, k, v)
    try:
        diff = (call().float() - ours.float()).abs().max().item()  # the compile, untimed
        flex_ms = _time_ms(ctx, call, 10)
    except Exception as exc:
        return {"flex_status": "failed", "flex_note": exc_line(exc)}
    return {"flex_status": "ok", "flex_ms": flex_ms, "flex_ratio": flex_ms / ours_ms,
            "flex_max_diff": diff}


def _variant_costs(ctx: StageContext) -> None:
    """Each variant's forward at one shape: its ms as a ratio to plain causal and, for
    :data:`FLEX_COMPARED`, compiled flex's ms on the same variant."""
    backend = "tiled" if ctx.dry_run else "triton"
    B, H, N, D = (1, 4, 64, 16) if ctx.dry_run else (4, 16, 4096, 128)
    if not _fits(ctx, 8 * B * H * N * D * 2 + N * N * 2, f"variant costs N={N}"):
        return
    base_ms = None
    for name in VARIANT_COSTS:
        if ctx.left() < 5:
            ctx.dropped(f"variant cost {name} and after", "the box ran short")
            return
        ctx.running(f"variant {name}")
        q, k, v = (t.detach() for t in _triton_inputs(ctx, B, H, N, D,
                                                       Hkv=H // 4 if name == "gqa" else None))
        kw = {key: (val.detach() if isinstance(val, torch.Tensor) else val)
              for key, val in _variant_kwargs(name, H, N, _device(ctx)).items()}
        if name == "float_mask":
            kw["causal"] = True

        def call():
            with torch.no_grad():
                return attn.attention(q, k, v, backend=backend, **kw)
        ms = _try_ms(ctx, call, 3 if ctx.dry_run else 10, kind="variant", variant=name,
                     backend=backend)
        if ms is None:
            continue
        base_ms = ms if name == "causal" else base_ms
        ratio = ms / base_ms if base_ms else None
        flex = (_flex_side(ctx, name, kw, q, k, v, call(), ms) if name in FLEX_COMPARED
                else {})
        ctx.row(kind="variant", variant=name, backend=backend, status="ok", ms=ms,
                ratio=ratio, note=f"fwd, bf16, B={B} H={H} N={N} D={D}",
                autotune=autotune_picks() if backend == "triton" else {}, **flex)
        ctx.log(f"variant {name}: {ms:.3g} ms, {ratio:.2f}x plain causal"
                + (f"; flex {flex['flex_ms']:.3g} ms, flex / {backend} "
                   f"{flex['flex_ratio']:.2f}" if flex.get("flex_ms") else
                   f"; flex {flex['flex_status']}: {flex['flex_note']}" if flex else ""))


# -- 4. varlen and decode ----------------------------------------------------------------------

def _varlen(ctx: StageContext) -> None:
    """Packed varlen on ours against SDPA on the same sequences padded to the longest
    (causal: the padded keys come after every real one, so no padding mask is needed)."""
    dev = _device(ctx)
    backend = "tiled" if ctx.dry_run else "triton"
    H, D = (2, 16) if ctx.dry_run else (16, 128)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 17, 33] if ctx.dry_run else torch.randint(512, 4097, (8,), generator=g).tolist()
    total, longest = sum(lengths), max(lengths)
    if not _fits(ctx, 12 * len(lengths) * H * longest * D * 2, "varlen"):
        return
    q, k, v = (torch.randn(total, H, D, generator=g).to(dev, torch.bfloat16) for _ in range(3))
    cu = cu_seqlens_from_lengths(torch.tensor(lengths)).to(dev)
    real = (torch.arange(longest) < torch.tensor(lengths)[:, None]).to(dev)  # (B, longest)
    padded = [unpack(x, real).transpose(1, 2).contiguous() for x in (q, k, v)]
    shape = f"{len(lengths)} sequences, {total} tokens (longest {longest}), H={H} D={D}, bf16"
    paths = {f"{backend} packed": lambda: attn.varlen_attention(
                 q, k, v, cu, cu, longest, longest, causal=True, backend=backend),
             "sdpa padded": lambda: torch_sdpa(*padded, is_causal=True)}
    ms = {}
    for name, fn in paths.items():
        ctx.running(f"varlen {name}")
        t = _try_ms(ctx, fn, 3 if ctx.dry_run else 10, kind="varlen", path=name, shape=shape)
        if t is not None:
            ms[name] = t
    for name, t in ms.items():
        ratio = ms["sdpa padded"] / t if "sdpa padded" in ms else None
        ctx.row(kind="varlen", path=name, shape=shape, status="ok", ms=t, ratio_to_sdpa=ratio,
                note="fwd, causal")
        ctx.log(f"varlen {name}: {t:.3g} ms" + (f", SDPA / this {ratio:.2f}" if ratio else ""))


def _decode(ctx: StageContext) -> None:
    """One step of Nq new queries against a cache of Nk keys (GQA 32:8, D=128, bf16)."""
    H, Hkv, D = (4, 2, 16) if ctx.dry_run else (32, 8, 128)
    # each path, and why it cannot run here (None: it runs)
    paths = {"split-KV triton": None, "plain triton": None, "sdpa": None}
    if ctx.dry_run:
        grid = [(1, B, nk) for B in (1, 2) for nk in (64, 256)]
        ctx.dropped("decode Nq=4, B=8/64, Nk 1k-128k", "dry run: tiny sizes")
        gpu = f"{GPU_ONLY}: compiled triton"
        paths = {"split-KV triton": gpu, "plain triton": gpu, "sdpa": None, "tiled": None}
    else:  # B=8, Nq=1 first: the common serving case
        grid = sorted(((nq, B, nk) for nq in (1, 4) for B in (1, 8, 64)
                       for nk in (1024, 4096, 16384, 65536, 131072)),
                      key=lambda p: (p[0] != 1, p[1] != 8, p[1], p[2]))
    dev = _device(ctx)
    for i, (nq, B, nk) in enumerate(grid):
        if ctx.left() < 3:
            ctx.dropped(f"decode: {len(grid) - i} shapes from Nq={nq} B={B} Nk={nk}",
                        "the box ran short")
            return
        cache = 2 * B * Hkv * nk * D * 2
        base = {"kind": "decode", "B": B, "Nq": nq, "Nk": nk}
        if not _fits(ctx, cache, f"decode B={B} Nk={nk}"):
            continue
        g = torch.Generator().manual_seed(nk)
        q = torch.randn(B, H, nq, D, generator=g).to(dev, torch.bfloat16)
        k, v = (torch.randn(B, Hkv, nk, D, generator=g).to(dev, torch.bfloat16)
                for _ in range(2))
        ms = {}
        for path, why in paths.items():
            if why is None and path == "sdpa" and not _fits(ctx, cache * (1 + H // Hkv),
                                                          f"decode sdpa B={B} Nk={nk}"):
                why = "predicted over 60% of free memory (GQA expanded to H heads)"
            if why is not None:
                ctx.row(**base, path=path, status="skipped", note=why)
                continue
            ctx.running(f"decode {path} Nq={nq} B={B} Nk={nk}")
            backend = "tiled" if path == "tiled" else "triton"
            fn = (partial(torch_sdpa, q, k, v, enable_gqa=H != Hkv) if path == "sdpa" else
                  partial(attn.attention, q, k, v, backend=backend))
            # the two triton paths differ in this only: split-KV off for plain triton, else auto
            with mock.patch.dict(os.environ):
                os.environ.pop("ATTN_TRITON_SPLIT_KV", None)
                if path == "plain triton":
                    os.environ["ATTN_TRITON_SPLIT_KV"] = "0"
                t = _try_ms(ctx, fn, 3 if ctx.dry_run else 20, **base, path=path)
            if t is not None:
                ms[path] = t
        for path, t in ms.items():
            ratio = ms["sdpa"] / t if "sdpa" in ms else None
            ctx.row(**base, path=path, status="ok", ms=t, gb_per_s=cache / (t * 1e-3) / 1e9,
                    ratio_to_sdpa=ratio)
        ctx.log(f"decode Nq={nq} B={B} Nk={nk}: "
                + ", ".join(f"{p} {t:.3g} ms" for p, t in ms.items()))
        del q, k, v
        if dev == "cuda":
            torch.cuda.empty_cache()


def varlen_decode(ctx: StageContext) -> None:
    _varlen(ctx)
    _decode(ctx)


# -- 5. tune -----------------------------------------------------------------------------------

def _tune_configs(kind: str, N: int, D: int, arch: int | None) -> list:
    import triton

    from attn.flash_triton import tune

    args = {"TUNE_N": triton.next_power_of_2(N), "BLOCK_D": D, "BLOCK_DV": D, "MASK_KIND": 0}
    return tune.prune_for(tune.gpu_configs(kind), args, kind=kind, arch=arch)


def tune(ctx: StageContext) -> None:
    """Every config prune_for keeps, forced on its kernel, against the autotuner's pick
    (docs/gpu.md); dK/dV and dQ configs time the forward and backward, the other kernels at
    their picks. Changes no code: ``--adopt`` writes the "best of the sweep" rows."""
    shapes = [(D, causal) for D in (128, 64) for causal in (False, True)]
    N, B, H = 4096, 4, 16
    if ctx.dry_run:
        for D, causal in shapes:
            for kind in _KERNELS:
                n = len(_tune_configs(kind, N, D, 90))
                ctx.row(kind="tune", kernel=kind, shape=f"D={D} causal={causal} N={N}",
                        config=f"{n} configs kept for sm_90", status="skipped",
                        note=f"{GPU_ONLY}: the interpreter has one config and times nothing")
        ctx.log("planned the sweep; nothing timed without a GPU")
        return
    os.environ["ATTN_TRITON_TUNED"] = "0"  # before the first launch reads the table
    import attn.flash_triton as ft
    from attn.flash_triton import tune as tuning

    arch = tuning._device_arch()
    for D, causal in shapes:
        shape = f"D={D} causal={causal} N={N} B={B} H={H} bf16"
        q, k, v = _triton_inputs(ctx, B, H, N, D)
        do = torch.randn_like(q)

        def fwd():
            with torch.no_grad():
                attn.attention(q, k, v, causal=causal, backend="triton")

        def fwd_bwd():
            out = attn.attention(q, k, v, causal=causal, backend="triton")
            torch.autograd.grad(out, (q, k, v), do)

        ctx.running(f"tune {shape}: autotuning")
        tuning.LAST_KEYS.clear()
        fwd_bwd()  # the autotuner's own choice, compiled and timed by triton
        picks, keys = autotune_picks(), dict(tuning.LAST_KEYS)
        pick_ms = {"fwd": _time_ms(ctx, fwd, 10)}
        pick_ms["dkdv"] = pick_ms["dq"] = _time_ms(ctx, fwd_bwd, 10)
        for kind, fn in (("fwd", fwd), ("dkdv", fwd_bwd), ("dq", fwd_bwd)):
            best = (None, pick_ms[kind])
            pick_config = None
            for config in _tune_configs(kind, N, D, arch):
                if ctx.left() < 10:
                    ctx.dropped(f"tune {kind} {shape} and after", "the box ran short")
                    return
                ctx.running(f"tune {kind} {shape} {config}")
                try:  # the autotuner's list cut to one config, which it runs without timing
                    with mock.patch.object(getattr(ft, _KERNELS[kind]), "configs", [config]):
                        ms, status, note = _time_ms(ctx, fn, 10), "ok", ""
                except Exception as exc:  # a config that does not launch here
                    ms, status, note = None, "failed", exc_line(exc, 160)
                is_pick = str(config) == picks.get(kind)
                pick_config = config if is_pick else pick_config
                ctx.row(kind="tune", kernel=kind, shape=shape, config=str(config),
                        status=status, ms=ms, pick=is_pick, note=note)
                if ms is not None and ms < best[1]:
                    best = (config, ms)
            chosen = best[0] if best[0] is not None else pick_config
            ctx.row(kind="tune", kernel=kind, shape=shape,
                    config=str(best[0]) if best[0] is not None else "the pick",
                    status="ok", ms=best[1], pick=best[0] is None, pick_ms=pick_ms[kind],
                    best_over_pick=pick_ms[kind] / best[1], note="best of the sweep",
                    key=keys.get(kind),
                    fields=None if chosen is None else tuning.config_fields(chosen))
            ctx.log(f"tune {kind} {shape}: best {best[0] or 'the pick'}, pick / best "
                    f"{pick_ms[kind] / best[1]:.2f}")


# -- 6. context parallel -----------------------------------------------------------------------

def context_parallel(ctx: StageContext) -> None:
    """Ring and Ulysses through the public API on a group of one (NCCL on the GPU, gloo in a
    dry run), forward and backward against the float64 reference; alone in its process."""
    import torch.distributed as dist

    import attn.distributed as cp
    from attn.bench.context_parallel import _free_port

    dev = _device(ctx)
    port = _free_port()
    backend = "gloo" if ctx.dry_run else "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        if dev == "cuda":
            torch.cuda.set_device(0)
        dtype = torch.float32 if ctx.dry_run else torch.bfloat16
        q, k, v = make_inputs(B=2, H=4, Hkv=2, N=65 if ctx.dry_run else 1024, D=16 if
                              ctx.dry_run else 64, dtype=dtype, device=dev)
        for strategy, run in (("ring", cp.ring_attention), ("ulysses", cp.ulysses_attention)):
            ctx.running(f"{strategy} over {backend}")

            def fn(q, k, v, return_lse=False, **kw):
                out, lse = run(cp.shard_sequence(q), cp.shard_sequence(k),
                               cp.shard_sequence(v), return_lse=True, **kw)
                out, lse = cp.gather_sequence(out), cp.gather_sequence(lse)
                return (out, lse) if return_lse else out
            try:
                rep = compare_to_reference(fn, q, k, v, causal=True)
                worst = max(c.error for c in rep.comparisons)
                status, note = ("ok" if rep.ok else "failed"), "" if rep.ok else str(rep)[:300]
            except Exception as exc:
                worst, status = None, "failed"
                note = exc_line(exc)
            ctx.row(kind="cp", strategy=strategy, backend=f"{backend}, world size 1",
                    status=status, max_err=worst, note=note)
            ctx.log(f"{strategy} over {backend}, world size 1: {status} {note}")
    finally:
        dist.destroy_process_group()


def stage_process(target: str, ctx_json: str, env: dict) -> None:
    """The body of a stage's process, forked from gpu-check's fork server: its own process
    group (so a kill at its deadline reaches what it started), the environment triton reads
    at import, then :func:`main`. The child imports this module before running it, so it
    imports torch (the fork server's preload) and attn's lazy top level, never triton or
    torch's compiler: torch 2.13's ``torch.nn.attention.bias`` pulls triton in before
    ``TRITON_INTERPRET`` is set, and the dry run's interpreted kernels fail."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    sys.exit(main([target, ctx_json]))


def main(argv: list[str]) -> int:
    """``python -m attn.bench.gpu_stages MODULE:FUNCTION CONTEXT_JSON``."""
    target, ctx = argv[0], StageContext(**json.loads(argv[1]))
    module, _, name = target.partition(":")
    try:
        getattr(importlib.import_module(module), name)(ctx)
    except BaseException as exc:  # recorded as the stage's failure, with its traceback
        ctx._put({"error": exc_line(exc, 400)[:400]})
        ctx.log("FAILED:\n" + traceback.format_exc())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
