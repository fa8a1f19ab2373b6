"""Ahead-of-time compiles of the Triton kernels for named GPU archs, on a machine without a GPU
(docs/gpu.md, "Built for GPUs, checked without one": the method and what a :class:`Build`
reports). The launches are recorded from the launchers on CPU tensors, so there is no list of
parameter names to keep in sync with the kernels.

Must run in a process where the triton backend is *not* in interpreter mode
(``TRITON_INTERPRET`` unset before ``attn.flash_triton`` is imported).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import torch

from attn.masks import make_band
from attn.spec import LaunchSpec, Operands, PageTable, QuantPages

ARCHS = (90, 80)
# opt-in shared memory per block: H100 227 KiB, A100 163 KiB
SMEM_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
KERNELS = ("_attn_fwd", "_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq",
           "_attn_fwd_split", "_attn_split_combine", "_attn_fwd_paged", "_attn_jvp")
# row reductions: no dots, nothing to pipeline
NO_DOT = ("_attn_bwd_preprocess", "_attn_split_combine")
# the variant flags a kernel is specialized on (docs/gpu.md says what each turns on)
VARIANTS = ("plain", "causal", "all", "varlen", "decode", "paged", "paged_int4")
_PAGED = ("paged", "paged_int4")
_FORWARD_ONLY = ("decode", *_PAGED)


@dataclass
class Launch:
    """One kernel launch as the triton backend's launcher made it (grid left out)."""

    name: str
    kernel: Any  # the Autotuner or JITFunction
    args: tuple
    kwargs: dict

    @property
    def autotuned(self) -> bool:
        from triton.runtime.autotuner import Autotuner

        return isinstance(self.kernel, Autotuner)

    @property
    def jit_fn(self):
        return self.kernel.fn if self.autotuned else self.kernel

    def named_args(self) -> dict:
        return {**dict(zip(self.jit_fn.arg_names, self.args)), **self.kwargs}

    def configs(self, *, arch: int | None = None, pruned: bool = True) -> list:
        """The autotune configs this launch would try (after ``_prune`` for ``arch``), or,
        for a kernel without autotuning, the warps and stages the launcher passed (triton's
        defaults, 4 and 3, where it passed none)."""
        import triton

        if not self.autotuned:  # its block sizes named too, for the report
            blocks = {k: v for k, v in self.kwargs.items() if k.startswith("BLOCK_")
                      and k not in ("BLOCK_D", "BLOCK_DV")}
            return [triton.Config(blocks, num_warps=self.kwargs.get("num_warps", 4),
                                  num_stages=self.kwargs.get("num_stages", 3))]
        if not pruned:
            return list(self.kernel.configs)
        prune = self.kernel.early_config_prune  # partial(_prune, kind=...)
        return prune.func(list(self.kernel.configs), self.named_args(), **prune.keywords, arch=arch)


@dataclass
class Build:
    """One compiled (kernel, config, arch): what the compiler made of it."""

    kernel: str
    arch: int
    variant: str
    head_dim: int
    dtype: str
    config: str  # "BLOCK_M=64 BLOCK_N=64 w4 s3"
    num_stages: int
    shared: int  # bytes of shared memory per block
    tensor_cores: bool  # the dots lowered to wgmma (sm_90) / mma.sync (sm_80)
    pipelined: bool  # async copies or TMA loads in the TTGIR
    wgmma_n: int | None = None  # the narrowest wgmma N (m64nNk16) in the PTX; None: none
    mma_sync: bool = False  # any mma.sync in the PTX (on sm_90: dots that missed wgmma)
    tma: bool = False  # TMA loads (bulk tensor copies) in the PTX
    warp_specialized: bool = False  # the TTGIR partitions warps (producer / consumer)
    loop_sass: int | None = None  # SASS instructions per iteration of the steady loop
    registers: int | None = None
    spill_bytes: int | None = None  # ptxas spill stores + loads, bytes
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.shared <= SMEM_LIMIT[self.arch]


class _Recorder:
    """Stands in for a kernel object: ``kernel[grid](*args, **kwargs)`` is recorded, not run."""

    def __init__(self, name: str, kernel: Any, sink: list[Launch]) -> None:
        self._name, self._kernel, self._sink = name, kernel, sink

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._kernel, attr)

    def __getitem__(self, grid: Any):
        def launch(*args, **kwargs):
            self._sink.append(Launch(self._name, self._kernel, args, kwargs))
        return launch


def _variant_call(variant: str, H: int, n_q: int, n_k: int, scale: float) -> tuple[Any, dict]:
    """The launch spec and tensor arguments of one variant."""
    if variant == "plain":
        return LaunchSpec(qk_scale=scale), {}
    if variant == "causal":
        return LaunchSpec(qk_scale=scale, band=make_band(n_q, n_k, causal=True, window=None)), {}
    if variant in ("all", "varlen", *_FORWARD_ONLY):  # every flag a kernel takes, at once
        g = torch.Generator().manual_seed(0)
        # seed 1: the JIT would turn an int argument equal to 1 into a constant; split-KV
        # (decode, paged) runs without dropout, packed sequences (varlen) without a mask;
        # a paged call's band is counted from each row's end (no keys in the spec's)
        forward_only = variant in _FORWARD_ONLY
        spec = LaunchSpec(qk_scale=scale,
                          band=make_band(n_q, 0 if variant in _PAGED else n_k, causal=True,
                                         window=(n_k // 4, 0)),
                          dropout_p=0.0 if forward_only else 0.1, dropout_seed=1)
        tensors = {"softcap": torch.full((H,), 30.0, requires_grad=True),
                   "sinks": torch.zeros(H, requires_grad=True),
                   "alibi": 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)}
        if variant not in ("varlen", *_PAGED):
            tensors["attn_mask"] = torch.rand(1, 1, n_q, n_k, generator=g) > 0.1
        return spec, tensors
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def _paged_call(tri, spec, tensors: dict, rand, *, head_dim: int, B: int, H: int,
                H_kv: int, N: int, n_q: int, quant: bool = False) -> None:
    """One forward of ``tri.paged_attention``: pages of 16 positions in a shuffled block
    table, B rows of ragged lengths up to N (the last one N), split-KV forced as for decode.
    ``quant``: the pages hold int4 codes, keys scaled per channel and values per group of
    32, each row's last two pages full-precision ids into a ring of its own."""
    page = 16
    per_row = -(-N // page)
    g = torch.Generator().manual_seed(1)
    table = torch.randperm(B * per_row, generator=g).view(B, per_row).to(torch.int32)
    lengths = torch.linspace(N // 3, N, B).long()
    shape = (B * per_row, page, H_kv, head_dim)
    ops = Operands(**tensors, pages=PageTable(table, torch.zeros_like(lengths), lengths))
    if quant:
        W = 2
        recent_from = (-(-lengths // page) - W).clamp(min=0)
        for b in range(B):  # the ring slots b·W + j % W of row b's recent pages
            j = torch.arange(int(recent_from[b]), -(-int(lengths[b]) // page))
            table[b, j] = (b * W + j % W).to(torch.int32)
        ops = ops._replace(quant=QuantPages(
            "int4", torch.rand(shape[0], 1, H_kv, head_dim, generator=g).half(),
            torch.rand(*shape[:3], head_dim // 32, generator=g).half(), recent_from,
            rand(B * W, *shape[1:]), rand(B * W, *shape[1:])))
        pages = [torch.randint(0, 256, (*shape[:3], head_dim // 2), generator=g,
                               dtype=torch.uint8) for _ in range(2)]  # two codes per byte
    else:
        pages = [rand(*shape) for _ in range(2)]
    tri.paged_attention(rand(B, H, n_q, head_dim), *pages, spec, ops)


def _run_variant(tri, variant: str, *, head_dim: int, dtype: torch.dtype, B: int, H: int,
                 H_kv: int, N: int) -> None:
    """One call of ``tri.triton_attention`` for ``variant``: forward, backward and the
    forward-mode pass (``tri._jvp``, a tangent on every input that takes one) for dense
    and varlen, or a decoding forward (decode: 16 query rows, split-KV forced to 4 chunks;
    paged: the same through a block table; paged_int4: from a quantized cache)."""
    g = torch.Generator().manual_seed(0)
    forward_only = variant in _FORWARD_ONLY
    n_q = 16 if forward_only else N  # 16 rows x a group of 4: the largest q block

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(not forward_only)

    spec, tensors = _variant_call(variant, H, n_q, N, head_dim ** -0.5)
    if variant == "varlen":  # packed (total, H, D): an empty sequence and a short last one
        cu = torch.tensor([0, N // 3, N // 3, N, N + 17], dtype=torch.int32)
        q, k, v = rand(N + 17, H, head_dim), rand(N + 17, H_kv, head_dim), rand(N + 17, H_kv, head_dim)
        spec = replace(spec, max_seqlen_q=N - N // 3, max_seqlen_k=N - N // 3)
        ops = Operands(**tensors, cu_seqlens_q=cu, cu_seqlens_k=cu)
    elif variant not in _PAGED:
        q, k, v = rand(B, H, n_q, head_dim), rand(B, H_kv, N, head_dim), rand(B, H_kv, N, head_dim)
        ops = Operands(**tensors)
    with mock.patch.dict(os.environ, ATTN_TRITON_SPLIT_KV="4" if forward_only else "0"):
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            if variant in _PAGED:
                return _paged_call(tri, spec, tensors, rand, head_dim=head_dim, B=B, H=H,
                                   H_kv=H_kv, N=N, n_q=n_q, quant=variant == "paged_int4")
            out, lse = tri.triton_attention(q, k, v, spec, ops)
        if not forward_only:
            (out.float().sum() + lse.sum()).backward()
            with torch.no_grad():
                tangents = tri.Tangents(q, k, v, None, ops.sinks, ops.softcap, ops.alibi)
                tri._jvp(q, k, v, out, lse, spec, ops, tangents)


def record_launches(*, head_dim: int, dtype: torch.dtype = torch.bfloat16,
                    variant: str = "plain", B: int = 2, H: int = 8, H_kv: int = 2,
                    N: int = 1024) -> list[Launch]:
    """Every kernel launch of one forward + backward of ``triton_attention`` on CPU tensors
    (contiguous, as a typical call passes them), recorded instead of run; for ``decode``,
    the launches of one split-KV forward, for ``paged`` of one paged forward."""
    # the launchers look their kernels up in attn.flash_triton.launch: record them there
    from attn.flash_triton import launch as flash_triton

    if flash_triton._INTERPRET:
        raise RuntimeError("attn.flash_triton was imported in interpreter mode "
                           "(TRITON_INTERPRET=1): compile checks need the compiler")
    sink: list[Launch] = []
    with contextlib.ExitStack() as patched:
        for name in KERNELS:
            recorder = _Recorder(name, getattr(flash_triton, name), sink)
            patched.enter_context(mock.patch.object(flash_triton, name, recorder))
        _run_variant(flash_triton, variant, head_dim=head_dim, dtype=dtype, B=B, H=H,
                     H_kv=H_kv, N=N)
    return sink


def _specialize(launch: Launch, cfg, target):
    """What the JIT hands to ``triton.compile`` for this launch and config (triton's binder)."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.jit_fn
    kwargs = {**launch.kwargs, **cfg.kwargs, "num_warps": cfg.num_warps,
              "num_stages": cfg.num_stages}
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args,
                                                           specialization, options)
    return ASTSource(fn, signature, constexprs, attrs), options


def _nvidia_tool(name: str, arch: int, args: list[str], data: str | bytes, suffix: str
                 ) -> subprocess.CompletedProcess:
    """Run the wheel's bundled ``ptxas`` or ``nvdisasm`` on ``data`` written to a temporary
    file (``args`` around ``{src}`` and ``{tmp}``, filled in)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    tool = ptxas if name == "ptxas" else os.path.join(os.path.dirname(ptxas), name)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k" + suffix)
        with open(src, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        return subprocess.run([tool, *(a.format(src=src, tmp=tmp) for a in args)],
                              capture_output=True, text=True, timeout=300)


def _ptxas_verbose(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """Registers and spill bytes from the bundled ptxas's ``-v`` report."""
    sm = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    res = _nvidia_tool("ptxas", arch, ["-v", f"--gpu-name={sm}", "{src}", "-o", "{tmp}/k.o"],
                       ptx, ".ptx")
    text = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    stores = re.search(r"(\d+) bytes spill stores", text)
    loads = re.search(r"(\d+) bytes spill loads", text)
    spills = None if stores is None else int(stores.group(1)) + int(loads.group(1))
    return (None if regs is None else int(regs.group(1))), spills


_SASS_LINE = re.compile(r"^\s*(?:(\.L_x_\d+):|/\*[0-9a-f]+\*/\s+(.*?)\s*;)", re.M)
_SASS_BRA = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")


def sass_loops(sass: str) -> list[list[str]]:
    """The loops of a disassembled kernel (``nvdisasm -c``): for each backward branch, the
    instructions from its target label to the branch."""
    labels: dict[str, int] = {}
    instrs: list[str] = []
    for label, ins in _SASS_LINE.findall(sass):
        if label:
            labels[label] = len(instrs)
        else:
            instrs.append(ins)
    loops = []
    for i, ins in enumerate(instrs):
        target = _SASS_BRA.search(ins)
        if target and labels.get(target.group(1), i + 1) <= i:
            loops.append(instrs[labels[target.group(1)]:i + 1])
    return loops


def steady_loop_sass(sass: str) -> int | None:
    """Instructions per iteration of the smallest loop holding a tensor-core op (HGMMA on
    sm_90, HMMA on sm_80): the unmasked middle stage of the kernels' walks (the masked edge
    loops are the same plus their masking); None when no loop has one."""
    sizes = [len(body) for body in sass_loops(sass)
             if any(" HGMMA" in f" {i}" or " HMMA" in f" {i}" for i in body)]
    return min(sizes) if sizes else None


def _config_name(cfg) -> str:
    blocks = " ".join(f"{k}={v}" for k, v in sorted(cfg.kwargs.items()))
    return f"{blocks} w{cfg.num_warps} s{cfg.num_stages}".strip()


def compile_launch(launch: Launch, cfg, *, arch: int, variant: str = "?",
                   ptxas_verbose: bool = False) -> Build:
    """Compile one launch with one config for ``arch``; errors are reported, not raised.
    ``ptxas_verbose``: also registers and spills (ptxas -v) and the steady loop's SASS."""
    import triton
    from triton.backends.compiler import GPUTarget

    named = launch.named_args()
    # the inputs' dtype (the combine kernel's first tensors are its float32 partials)
    q = named.get("Q", named.get("Out"))
    head_dim = int(named.get("HEAD_DIM", named.get("HEAD_DIM_V", 0)))
    build = Build(kernel=launch.name, arch=arch, variant=variant, head_dim=head_dim,
                  dtype=str(q.dtype).removeprefix("torch."), config=_config_name(cfg),
                  num_stages=cfg.num_stages, shared=0, tensor_cores=False, pipelined=False)
    target = GPUTarget("cuda", arch, 32)
    try:
        src, options = _specialize(launch, cfg, target)
        compiled = triton.compile(src, target=target, options=options.__dict__)
    except Exception as exc:  # noqa: BLE001 - a compile error is the finding, not a crash
        build.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        return build
    build.shared = int(compiled.metadata.shared)
    ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
    # the arch's own tensor-core instructions: on sm_90 wgmma only (mma.sync runs there too,
    # at a fraction of the rate: a kernel with it is not on Hopper's tensor cores)
    build.tensor_cores = "wgmma.mma_async" in ptx if arch >= 90 else "mma.sync" in ptx
    # cp.async copies into shared memory, or TMA loads (ops renamed across triton versions)
    build.pipelined = bool(re.search(r"async_copy_global_to_local|async_tma_copy|tma_load|"
                                     r"async_load|ttng\.async_tma", ttgir))
    widths = [int(n) for n in re.findall(r"wgmma\.mma_async\S*?\.m64n(\d+)k", ptx)]
    build.wgmma_n = min(widths) if widths else None
    build.mma_sync = "mma.sync" in ptx
    build.tma = "cp.async.bulk.tensor" in ptx
    build.warp_specialized = "ttg.warp_specialize" in ttgir
    if ptxas_verbose:  # the measuring mode: ptxas's report and the disassembly
        build.registers, build.spill_bytes = _ptxas_verbose(compiled.asm["ptx"], arch)
        sass = _nvidia_tool("nvdisasm", 90, ["-c", "{src}"], compiled.asm["cubin"], ".cubin")
        build.loop_sass = steady_loop_sass(sass.stdout)
    return build


def largest(configs: list) -> Any:
    """The config with the largest tiles, then the most stages and warps: the one most
    likely to outgrow shared memory or registers."""
    return max(configs, key=lambda c: (c.kwargs.get("BLOCK_M", 0) * c.kwargs.get("BLOCK_N", 0),
                                       c.num_stages, c.num_warps))


def sweep(*, archs=ARCHS, head_dims=(64, 128, 256), variants=VARIANTS,
          dtypes=(torch.bfloat16,), configs: str = "largest", ptxas_verbose: bool = False,
          kernels=None, config_names=None) -> Iterator[Build]:
    """Compile every kernel x config x D x variant x dtype x arch, ``configs`` as
    ``--configs`` says (every one, those ``_prune`` keeps, or the largest kept), noting on
    each autotuned build whether ``_prune`` keeps its config on that arch. ``kernels`` keeps
    only those kernels; ``config_names`` (as :func:`_config_name` writes them) builds those
    configs, kept or pruned, where a kernel has them, instead."""
    for dtype, d, variant in itertools.product(dtypes, head_dims, variants):
        for launch in record_launches(head_dim=d, dtype=dtype, variant=variant):
            if kernels and launch.name not in kernels:
                continue
            if launch.name in NO_DOT and variant not in ("plain", "decode", "paged"):
                # (paged_int4's combine is paged's: the codes are the paged kernel's)
                continue  # no variant flags: one build per D is enough
            for arch in archs:
                cfgs = launch.configs(arch=arch, pruned=configs != "all")
                kept = launch.configs(arch=arch, pruned=True)
                chosen = [largest(cfgs)] if configs == "largest" else cfgs
                if config_names:
                    every = launch.configs(arch=arch, pruned=False)
                    chosen = [c for c in every if _config_name(c) in config_names]
                for cfg in chosen:
                    build = compile_launch(launch, cfg, arch=arch, variant=variant,
                                           ptxas_verbose=ptxas_verbose)
                    if launch.autotuned:
                        build.notes.append("kept" if cfg in kept else "pruned")
                    yield build


# -- the report: `attn bench compile` ----------------------------------------------------------

def add_arguments(p) -> None:
    p.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), choices=list(ARCHS),
                   help="compute capabilities to build for (default: 90 80)")
    p.add_argument("--d", type=int, nargs="+", default=[64, 128, 256], help="head dims")
    p.add_argument("--variant", nargs="+", default=["plain", "all"], choices=list(VARIANTS),
                   help="variant flags: plain, causal (banded), all (every flag on)")
    p.add_argument("--dtype", nargs="+", default=["bfloat16"],
                   choices=["bfloat16", "float16", "float32"])
    p.add_argument("--configs", choices=["all", "pruned", "largest"], default="all",
                   help="every autotune config (default), those _prune keeps, or the largest kept")
    p.add_argument("--kernel", nargs="+", choices=list(KERNELS), help="only these kernels")
    p.add_argument("--config", nargs="+", metavar="NAME",
                   help='only these configs, kept or pruned, e.g. "BLOCK_M=64 BLOCK_N=128 w8 s3"')
    p.add_argument("--no-ptxas", action="store_true", help="skip registers/spills (ptxas -v)")
    p.add_argument("--out", type=str, default="out/compile", help="folder for results.{json,md}")
    p.add_argument("--append", action="store_true",
                   help="merge into the report already in --out: its builds stay, those this "
                        "run repeats (same kernel, arch, D, dtype, variant, config) are replaced")


def _header(argv: list[str]) -> dict:
    import triton

    from attn.bench import report  # here: it imports attn.api, after TRITON_INTERPRET is off

    return {**report.run_header("cpu", argv),
            "what": "ahead-of-time Triton compiles of attn's kernels (no GPU used)",
            "triton": triton.__version__,
            "smem_limit_bytes": {f"sm_{a}": SMEM_LIMIT[a] for a in ARCHS}}


def markdown(header: dict, builds: list[Build]) -> str:
    lines = [f"# {header['what']}", "",
             f"`{header['command']}` — {header['date']}, triton {header['triton']}, "
             f"torch {header['torch']}. Shared memory limit per block: sm_90 227 KiB, "
             f"sm_80 163 KiB. `kept` = `_prune` keeps the config on that arch. "
             f"Spills = ptxas spill stores + loads (bytes). Loop SASS = instructions per "
             f"iteration of the steady (unmasked) loop; tensor cores = wgmma on sm_90, "
             f"mma.sync on sm_80.", ""]
    cols = ("kernel", "arch", "D", "dtype", "variant", "config", "kept", "smem KiB", "fits",
            "regs", "spills", "loop SASS", "tensor cores", "wgmma N", "mma.sync", "TMA",
            "warp spec", "pipelined", "error")
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    yes = {True: "yes", False: "no"}
    for b in builds:
        kept = "yes" if "kept" in b.notes else ("no" if "pruned" in b.notes else "")
        cells = (b.kernel, f"sm_{b.arch}", b.head_dim, b.dtype, b.variant, b.config, kept,
                 f"{b.shared / 1024:.0f}", "yes" if b.fits else "**no**",
                 *("" if x is None else x for x in (b.registers, b.spill_bytes, b.loop_sass)),
                 yes[b.tensor_cores], b.wgmma_n or "",
                 *(yes[x] for x in (b.mma_sync, b.tma, b.warp_specialized, b.pipelined)),
                 b.error or "")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _appended(old: dict, builds: list[Build], header: dict) -> tuple[list[Build], dict]:
    """An earlier report's builds, those of this run replacing the ones it repeats, and a
    header naming both commands (each with its date and versions)."""
    def key(b: Build) -> tuple:
        return b.kernel, b.arch, b.head_dim, b.dtype, b.variant, b.config

    new_keys = {key(b) for b in builds}
    kept = [b for b in (Build(**d) for d in old["builds"]) if key(b) not in new_keys]
    prev = old["header"]
    header = {**header, "command": f"{prev['command']}` ({prev['date']}, triton "
                                   f"{prev['triton']}, torch {prev['torch']}), then "
                                   f"`{header['command']}"}
    return kept + builds, header


def run(args, argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        if "attn.flash_triton" in sys.modules:
            raise SystemExit("attn bench compile: run it without TRITON_INTERPRET=1")
        os.environ.pop("TRITON_INTERPRET")
    dtypes = [getattr(torch, d) for d in args.dtype]
    builds: list[Build] = []
    for b in sweep(archs=tuple(args.arch), head_dims=tuple(args.d), variants=tuple(args.variant),
                   dtypes=dtypes, configs=args.configs, ptxas_verbose=not args.no_ptxas,
                   kernels=args.kernel, config_names=args.config):
        builds.append(b)
        what = b.error or (f"{b.shared // 1024} KiB, regs {b.registers}, spills "
                           f"{b.spill_bytes}, loop {b.loop_sass}, wgmma n{b.wgmma_n}")
        print(f"{b.kernel} sm_{b.arch} D={b.head_dim} {b.variant} {b.config}: {what}",
              file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = _header(argv)
    if args.append and (out / "results.json").exists():
        builds, header = _appended(json.loads((out / "results.json").read_text()), builds,
                                   header)
    (out / "results.json").write_text(json.dumps(
        {"header": header, "builds": [asdict(b) for b in builds]}, indent=1))
    (out / "results.md").write_text(markdown(header, builds))
    print(f"wrote {out / 'results.json'} and {out / 'results.md'} ({len(builds)} builds)")
    bad = [b for b in builds if b.error or ("kept" in b.notes and not b.fits)]
    return 1 if bad else 0
