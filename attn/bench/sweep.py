"""The sweep runner: backends × N × D × causal × dtype × {fwd, fwd+bwd} on one device
(docs/benchmarks.md, 'The report'). Each point's inputs exist before its memory call and its
timed calls (:mod:`attn.timing`); the backends of one shape run back to back, so
``ratio_to_sdpa = sdpa_ms / ms`` compares like with like. Users' functions (docs/benchmarks.md,
``--fn``) are called as ``fn(q, k, v, causal=True)``, attn's convention (attn.adapters.adapt).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from attn.api import BACKENDS, AttentionCall, attention, unsupported_reason
from attn.bench.competitors import COMPETITORS, competitor_unsupported, make_forward
from attn.bench.flops import MODES, attention_flops, matmul_tflops
from attn.masks import make_band
from attn.timing import benchmark, peak_bytes

CAUSAL = {"false": (False,), "true": (True,), "both": (False, True)}  # --causal's values
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}

# Predicted peak bytes = QUAD · (one N² score tensor: B·H·N²·itemsize)
#                      + LIN · (one input: B·H·N·D·itemsize)
#                      + TILE · (one fp32 tile: B·H·min(N, 256)·min(N, 512)·4),
# constants rounded up from CPU measurements (docs/benchmarks.md) so that a point predicted
# to fit does fit (tests/test_bench.py checks that the prediction bounds the measurement).
_PREDICT = {  # backend: {mode: (QUAD, LIN, TILE)}
    "reference": {"fwd": (3.4, 2, 0), "fwd+bwd": (6.7, 6, 0)},
    "tiled": {"fwd": (0, 3, 6), "fwd+bwd": (0, 8, 12)},
    "sdpa": {"fwd": (0, 3, 4), "fwd+bwd": (0, 8, 8)},
    "triton": {"fwd": (0, 3, 1), "fwd+bwd": (0, 8, 2)},
}


def predicted_peak_bytes(backend: str, mode: str, B: int, H: int, N: int, D: int,
                         dtype: torch.dtype) -> int:
    """A deliberately generous estimate of ``peak_bytes`` for one point (see ``_PREDICT``)."""
    quad, lin, tile = _PREDICT.get(backend, _PREDICT["tiled"])[mode]
    itemsize = torch.empty((), dtype=dtype).element_size()
    return int(quad * B * H * N * N * itemsize + lin * B * H * N * D * itemsize
               + tile * B * H * min(N, 256) * min(N, 512) * 4)


def available_memory_bytes(device: str) -> int:
    """Free memory now: CUDA's free bytes, or MemAvailable from /proc/meminfo on CPU."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_unsupported(backend: str, device: str) -> str | None:
    """Why ``backend`` cannot run on ``device`` at all (before asking the backend itself)."""
    if backend == "triton" and torch.device(device).type != "cuda" \
            and os.environ.get("TRITON_INTERPRET") != "1":
        return "triton needs CUDA (or TRITON_INTERPRET=1 for the slow interpreter)"
    return None


def square_call(device: str, dtype: torch.dtype, D: int, N: int, causal: bool, **more
                ) -> AttentionCall:
    """The :class:`attn.api.AttentionCall` of an N × N point (``more``: its other fields)."""
    return AttentionCall(device=torch.device(device).type, dtype=dtype, head_dim=D,
                         head_dim_v=D, n_q=N, n_k=N,
                         band=make_band(N, N, causal=causal, window=None), **more)


def attn_backends() -> tuple[str, ...]:
    return tuple(b for b in BACKENDS if b != "auto")


def all_backends() -> tuple[str, ...]:
    """attn's backends, then torch's kernels timed beside them."""
    return (*attn_backends(), *COMPETITORS)


def default_backends(device: str = "cpu") -> tuple[str, ...]:
    """attn's backends; on CUDA torch's forced SDPA kernels and compiled Flex join them (on
    CPU they are the same kernel as sdpa, or compile for tens of seconds per point)."""
    return all_backends() if torch.device(device).type == "cuda" else attn_backends()


def function_name(fn: Callable) -> str:
    """The name a user's function goes by in a sweep's rows: its ``.name`` (an adapted
    function's), else its ``__name__``."""
    name = getattr(fn, "name", None) or getattr(fn, "__name__", None)
    if not isinstance(name, str) or not name or name == "<lambda>":
        raise ValueError(f"a function in backends needs a name for its rows: define it with "
                         f"def, or give it a .name attribute; got {fn!r}")
    return name


def describe_function(fn: Callable) -> str:
    """What a results header records about a user's function."""
    style, layout = getattr(fn, "style", None), getattr(fn, "layout", None)
    if style is not None:
        return f"{function_name(fn)} ({style} style, {layout})"
    where = getattr(fn, "__module__", None)
    return f"{where}:{getattr(fn, '__qualname__', function_name(fn))}" if where else \
        function_name(fn)


@dataclass
class SweepConfig:
    """What a sweep measures. ``backends`` holds names (:func:`all_backends`) and users'
    functions, each with a name (:func:`function_name`); after construction it holds names
    only, and ``functions`` maps a user function's name to it."""

    n: tuple[int, ...] = (512, 1024, 2048)
    backends: tuple[str | Callable, ...] = field(default_factory=default_backends)
    d: tuple[int, ...] = (64,)
    causal: tuple[bool, ...] = (False,)
    dtypes: tuple[str, ...] = ("float32",)
    modes: tuple[str, ...] = MODES
    batch: int = 1
    heads: int = 8
    # fixed work per point, FlashAttention's benchmark convention: B = tokens // N and
    # H = width // D for each point (None: batch and heads as given)
    tokens: int | None = None
    width: int | None = None
    device: str = "cpu"
    measure_memory: bool = True
    measure_time: bool = True
    warmup: int = 1  # untimed calls before timing; the memory call counts as one
    repeats: int = 5
    min_repeats: int = 2
    budget_s: float = 2.0  # per point: stop repeating after this many seconds of timed calls
    max_bytes: int | None = None  # skip points predicted above this; None: 60% of free memory
    matmul_n: int | None = None  # size of the square matmul giving the device's rate
    seed: int = 0
    functions: dict[str, Callable] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.functions = dict(self.functions)
        names = []
        for b in self.backends:
            if callable(b):
                name = function_name(b)
                if name in all_backends() or self.functions.get(name, b) is not b:
                    raise ValueError(f"backends: the function {b!r} is named {name!r}, which "
                                     f"is already taken; give it another .name")
                self.functions[name] = b
                b = name
            elif b not in all_backends() and b not in self.functions:
                raise ValueError(f"backends must be among {all_backends()} or callables with "
                                 f"a name, got {b!r}")
            if b in names:
                raise ValueError(f"backends: {b!r} is given twice")
            names.append(b)
        self.backends = tuple(names)
        for name, allowed in (("modes", MODES), ("dtypes", tuple(DTYPES))):
            bad = [x for x in getattr(self, name) if x not in allowed]
            if bad:
                raise ValueError(f"{name} must be among {allowed}, got {bad[0]!r}")
        if not (self.measure_memory or self.measure_time):
            raise ValueError("nothing to measure: measure_memory and measure_time are both off")
        if self.max_bytes is None:
            self.max_bytes = int(0.6 * available_memory_bytes(self.device))


@dataclass
class Row:
    backend: str  # an attn backend, a torch competitor, or a user function's name
    device: str
    dtype: str
    B: int
    H: int
    N: int
    D: int
    causal: bool
    mode: str
    status: str = "ok"  # ok | skipped | oom | error | failed (a user's function raised)
    note: str = ""
    ms: float | None = None  # median
    ms_min: float | None = None
    repeats: int = 0
    flops: float = 0.0
    tflops: float | None = None
    matmul_fraction: float | None = None  # tflops / the device's square-matmul TFLOP/s
    peak_bytes: int | None = None
    predicted_bytes: int = 0
    ratio_to_sdpa: float | None = None  # sdpa_ms / ms, both from this run

    def key(self) -> tuple:
        """The point without its backend: rows with equal keys compare against each other."""
        return (self.device, self.dtype, self.B, self.H, self.N, self.D, self.causal, self.mode)

    def as_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        return f"{self.backend} {self.mode} N={self.N} D={self.D}" \
            f"{' causal' if self.causal else ''} {self.dtype}"

    def line(self) -> str:
        """The finished point, as a sweep prints it while it runs."""
        if self.status != "ok":
            return f"{self.label()}: {self.status}" + (f" ({self.note})" if self.note else "")
        parts = [] if self.ms is None else [f"{self.ms:.3g} ms, {self.tflops:.3g} TFLOP/s"]
        if self.peak_bytes is not None:
            parts.append(f"peak {self.peak_bytes / 2**20:,.1f} MiB")
        return f"{self.label()}: {', '.join(parts)}"


def plan(cfg: SweepConfig) -> list[Row]:
    """Every point of the sweep, in run order, before anything runs."""
    rows = []
    for dtype, D, causal, mode, N in itertools.product(cfg.dtypes, cfg.d, cfg.causal,
                                                       cfg.modes, sorted(cfg.n)):
        B = cfg.batch if cfg.tokens is None else max(1, cfg.tokens // N)
        H = cfg.heads if cfg.width is None else max(1, cfg.width // D)
        rows += [Row(b, cfg.device, dtype, B, H, N, D, causal, mode) for b in cfg.backends]
    return rows


def skip_reason(row: Row, cfg: SweepConfig) -> str | None:
    """Why ``row`` cannot run here (backend, device, or predicted memory), else None.
    Also fills the row's ``flops`` and ``predicted_bytes``."""
    row.flops = attention_flops(row.B, row.H, row.N, row.N, row.D, causal=row.causal,
                                mode=row.mode)
    user = row.backend in cfg.functions
    # nothing is known of a user's function: assume it holds the N² scores, as the reference
    row.predicted_bytes = predicted_peak_bytes("reference" if user else row.backend, row.mode,
                                               row.B, row.H, row.N, row.D, DTYPES[row.dtype])
    if user:
        why = None
    elif row.backend in COMPETITORS:
        why = competitor_unsupported(row.backend, cfg.device, DTYPES[row.dtype], row.D,
                                     row.causal, row.mode)
    else:
        why = device_unsupported(row.backend, cfg.device)
    if why is None and row.backend in attn_backends():
        why = unsupported_reason(row.backend, square_call(cfg.device, DTYPES[row.dtype], row.D,
                                                          row.N, row.causal))
    if why is None and row.predicted_bytes > cfg.max_bytes:
        why = (f"predicted peak {row.predicted_bytes / 2**30:.1f} GiB > budget "
               f"{cfg.max_bytes / 2**30:.1f} GiB"
               + (" (a user's function is assumed to hold N² scores; --max-mem-gb raises "
                  "the budget)" if user else ""))
    return why


def make_call(row: Row, cfg: SweepConfig) -> Callable[[], None]:
    """The measured call: forward (inputs without grad, so no graph is kept), or forward then
    backward from a fixed dO with the gradients of the previous call dropped first. Its
    inputs (q, k, v and dO, seeded) are allocated here, before anything is measured."""
    g = torch.Generator().manual_seed(cfg.seed)
    shape = (row.B, row.H, row.N, row.D)
    dtype, grad = DTYPES[row.dtype], row.mode == "fwd+bwd"
    q, k, v = (torch.randn(shape, generator=g).to(device=cfg.device, dtype=dtype)
               .requires_grad_(grad) for _ in range(3))
    d_out = torch.randn(shape, generator=g).to(device=cfg.device, dtype=dtype) if grad else None
    if row.backend in COMPETITORS:
        forward = make_forward(row.backend, row.causal, row.N, cfg.device)
    elif row.backend in cfg.functions:
        fn = cfg.functions[row.backend]
        causal = {"causal": True} if row.causal else {}  # a plain fn(q, k, v) runs non-causal

        def forward(q, k, v):
            out = fn(q, k, v, **causal)
            return out[0] if isinstance(out, (tuple, list)) else out
    else:
        def forward(q, k, v):
            return attention(q, k, v, causal=row.causal, backend=row.backend)

    def fwd() -> None:
        forward(q, k, v)

    def fwd_bwd() -> None:
        q.grad = k.grad = v.grad = None
        forward(q, k, v).backward(d_out)

    return fwd if d_out is None else fwd_bwd


def _measure(row: Row, cfg: SweepConfig) -> None:
    fn = make_call(row, cfg)
    if row.backend in ("flex", "triton"):
        # compiling (flex) and autotuning (triton: its timer allocates a 256 MB buffer to
        # flush L2) are first-call costs that allocate and take seconds: neither belongs to
        # the point
        fn()
    if cfg.measure_memory:
        row.peak_bytes = peak_bytes(fn, cfg.device)
    if cfg.measure_time:
        # the memory call has already run the point once: it is the first warm-up call
        warmup = max(cfg.warmup - 1, 0) if cfg.measure_memory else cfg.warmup
        t = benchmark(fn, device=cfg.device, warmup=warmup, repeats=cfg.repeats,
                      min_repeats=cfg.min_repeats, budget_s=cfg.budget_s)
        row.ms, row.ms_min, row.repeats = t.median_ms, t.min_ms, t.repeats
        row.tflops = row.flops / (row.ms * 1e-3) / 1e12


def run_sweep(cfg: SweepConfig, rows: list[Row] | None = None) -> Iterator[Row]:
    """Run (or skip) every planned point, yielding each row as soon as it is done; a point out
    of memory skips the larger N of its series. :func:`finish` fills ``ratio_to_sdpa`` and
    ``matmul_fraction`` once every sdpa row is known."""
    rows = plan(cfg) if rows is None else rows
    failed: set[tuple] = set()
    for row in rows:
        series = (row.backend, row.dtype, row.D, row.causal, row.mode)
        why = skip_reason(row, cfg)
        if why is None and series in failed:
            why = "a smaller N of this series ran out of memory"
        if why is not None:
            row.status, row.note = "skipped", why
            yield row
            continue
        try:
            _measure(row, cfg)
        except Exception as exc:  # one bad point must not end an hour-long sweep
            oom = isinstance(exc, torch.OutOfMemoryError) or (
                isinstance(exc, RuntimeError) and "memory" in str(exc).lower())
            row.status = "oom" if oom else "error"
            if row.status == "error" and row.backend in COMPETITORS:
                row.status = "skipped"  # torch's kernel refusing a shape is not attn's error
            elif row.status == "error" and row.backend in cfg.functions:
                # a user's function failing is its result at this point, not attn's error;
                # NotImplementedError is the adapter's "this function cannot express it"
                row.status = "skipped" if isinstance(exc, NotImplementedError) else "failed"
            row.note = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
            if row.status == "oom":
                failed.add(series)
        finally:
            if torch.device(cfg.device).type == "cuda":
                torch.cuda.empty_cache()
        yield row


def finish(rows: list[Row], matmul_rate: dict[str, float] | None = None) -> list[Row]:
    """Fill the columns that compare rows: ratio to sdpa, and fraction of the matmul rate
    (``matmul_rate`` maps dtype name to TFLOP/s measured in this run)."""
    sdpa = {r.key(): r.ms for r in rows if r.backend == "sdpa" and r.ms is not None}
    for r in rows:
        if r.ms is not None and sdpa.get(r.key()) is not None:
            r.ratio_to_sdpa = sdpa[r.key()] / r.ms
        if r.tflops is not None and matmul_rate and matmul_rate.get(r.dtype):
            r.matmul_fraction = r.tflops / matmul_rate[r.dtype]
    return rows


def measure_matmul_rates(cfg: SweepConfig) -> dict[str, float]:
    """The square-matmul TFLOP/s of this device for each dtype of the sweep (a dtype whose
    matmul does not run here is left out)."""
    rates = {}
    for name in cfg.dtypes:
        try:
            rates[name] = matmul_tflops(cfg.device, DTYPES[name], cfg.matmul_n)
        except RuntimeError:  # a dtype without a matmul kernel here: no ceiling to compare
            continue
    return rates
