"""attn.distributed with real processes: gloo on 127.0.0.1, world sizes 2, 3 and 4.

Processes are expensive on 2 cores (starting one costs more than all its cases), so four are
spawned once and every world size runs on them (``_results``): P = 4 on the default group,
P = 2 and 3 on subgroups of the *last* ranks (global ranks 2-3 and 1-3), so ``group=`` and
the mapping of group ranks to global ranks in the ring's send/recv are exercised too; each
test then checks its case's record. A launch that does not finish within ``_TIMEOUT_S`` is
killed and its tests fail: a hang can never stall the suite. Inputs are the same on every
rank (seeded generators), every rank compares its gathered result with ``attn.attention``
on the unsharded tensors through ``attn.testing.compare_to_reference`` (float64 unless the
case names another dtype), and every rank's record is checked.

The fused backend's cases count the calls of attn.fused's launchers in each process
(``_count_fused_launchers``), so a ring that ran another backend's steps fails them.

Sizes are awkward on purpose: N = 23 and 29 divide neither P nor 2P, Nq != Nk both ways,
and Nq > Nk with causal=True leaves the first rows with no key at all (lse = -inf), so
the merge of early ring steps sees -inf running states.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch

_TIMEOUT_S = 300  # a whole launch (all its cases); generous on a loaded 2-core machine
_WORLD = 4
_GROUP = None  # the process group of the world size being run (set in each process)
STRATEGIES = ("ring", "ulysses")
LAYOUTS = ("zigzag", "contiguous")


# -- variants: name -> (inputs, keywords), built the same on every rank --------------------------

def _variant(name: str, P: int) -> tuple[dict, dict]:
    """Input sizes and attention keywords of one variant for world size P."""
    H = 2 * P  # Ulysses needs H % P == 0
    shape = dict(B=2, H=H, N=23, D=8, Hkv=None, Nk=None, dtype=torch.float64)
    g = torch.Generator().manual_seed(7)

    def param(*s, lo=0.5, hi=1.5):
        return (lo + (hi - lo) * torch.rand(*s, generator=g, dtype=torch.float64)
                ).requires_grad_()

    kw: dict = {"causal": True}
    if name == "causal":
        pass
    elif name == "full":
        kw["causal"] = False
    elif name == "window":
        kw["window"] = (4, 0)  # whole ring steps lie outside it: skipped
    elif name == "window_both":
        kw.update(causal=False, window=(3, 2))
    elif name == "gqa":
        shape["Hkv"] = P
    elif name == "mqa":
        shape["Hkv"] = 1  # Ulysses replicates the one KV head onto every rank
    elif name == "gqa_replicated":
        shape.update(H=4 * P, Hkv=2)
    elif name == "scale_temperature":
        kw.update(scale=0.3, temperature=0.7)
    elif name == "temperature_tensor":
        kw["temperature"] = param(1, H)
    elif name == "softcap":
        kw["softcap"] = 1.5
    elif name == "softcap_learned":
        kw["softcap"] = param(H, lo=1.0, hi=3.0)
    elif name == "sinks":
        kw["sinks"] = param(H, lo=-1.0, hi=1.0)
    elif name == "dropout":
        kw["dropout_p"] = 0.25
    elif name == "rows_unseen":  # Nq > Nk, causal bottom-right: the first 10 rows see nothing
        shape.update(N=29, Nk=19)
        kw["sinks"] = param(H, lo=-1.0, hi=1.0)
    elif name == "cross_window":  # Nq < Nk
        shape.update(N=13, Nk=31)
        kw["window"] = (5, 2)
    elif name == "everything":
        shape["Hkv"] = P
        kw.update(window=(9, 0), scale=0.5, temperature=param(1, H), softcap=param(H, lo=1.0,
                  hi=3.0), sinks=param(H, lo=-1.0, hi=1.0), dropout_p=0.1)
    elif name == "float32":
        shape["dtype"] = torch.float32
        kw["window"] = (6, 0)
    elif name == "bfloat16":
        shape["dtype"] = torch.bfloat16
    elif name == "triton":  # the kernels in the Triton interpreter (conftest sets it on CPU)
        shape.update(dtype=torch.float32, D=16, Hkv=P)
        kw.update(backend="triton", window=(9, 0), softcap=2.0,
                  sinks=param(H, lo=-1.0, hi=1.0))
    elif name == "triton_dropout":  # the kernels' hash reads global positions: shards agree
        shape.update(dtype=torch.float32, D=16, Hkv=P)
        kw.update(backend="triton", dropout_p=0.25)
    # the fused backend's launchers in the ring steps (torch's CPU kernel per piece)
    elif name == "fused":
        shape.update(dtype=torch.float32, Hkv=P)
        kw["backend"] = "fused"
    elif name == "fused_full":
        shape.update(dtype=torch.float32, Hkv=P)
        kw.update(backend="fused", causal=False)
    elif name == "fused_everything":  # every keyword fused expresses, float64
        shape["Hkv"] = P
        kw.update(backend="fused", window=(9, 0), scale=0.5, temperature=param(1, H),
                  sinks=param(H, lo=-1.0, hi=1.0))
    elif name == "fused_rows_unseen":  # rows with no key: lse -inf through fused's pieces
        shape.update(N=29, Nk=19)
        kw.update(backend="fused", sinks=param(H, lo=-1.0, hi=1.0))
    elif name == "fused_nan_key":  # keys 9 and 12 are hidden from every row (see _poison)
        shape.update(N=13, Nk=31, dtype=torch.float32)
        kw.update(backend="fused", window=(5, 2))
    # calls auto gives to fused on CPU (float32 with a gradient, at least 128 x 128 per
    # launch: attn.choose's train class); P = 2 only: 150 x 150 per launch there
    elif name == "fused_auto":
        shape.update(N=300, H=4, Hkv=2, dtype=torch.float32)
    elif name == "fused_auto_full":
        shape.update(N=300, H=4, Hkv=2, dtype=torch.float32)
        kw["causal"] = False
    else:
        raise KeyError(name)
    return shape, kw


VARIANTS = ("causal", "full", "window", "window_both", "gqa", "mqa", "gqa_replicated",
            "scale_temperature", "temperature_tensor", "softcap", "softcap_learned", "sinks",
            "dropout", "rows_unseen", "cross_window", "everything", "float32", "bfloat16",
            "triton", "triton_dropout", "fused", "fused_full", "fused_everything",
            "fused_rows_unseen", "fused_nan_key", "fused_auto", "fused_auto_full")
FUSED_AUTO = ("fused_auto", "fused_auto_full")
BAD_INPUTS = ("k_length_on_rank1", "head_dim_on_rank1", "dtype_on_rank1", "ulysses_heads",
              "ulysses_kv_heads", "attn_mask")


def _case_list(P: int) -> list[tuple[str, str, dict]]:
    """Every strategy x layout x variant (a case costs milliseconds, a process seconds),
    then the collective counts, balance, bad inputs, error and training checks."""
    cases = []
    for v in VARIANTS:
        if (v == "gqa_replicated" and P % 2) or (v.startswith("triton") and P != 2) or (
                v in FUSED_AUTO and P != 2):
            continue  # Hkv = 2 must divide P; the interpreter is slow: one world size;
            # auto's fused calls need long launches: one world size
        for s in STRATEGIES:
            for lay in LAYOUTS:
                cases.append((f"{s}-{lay}-{v}", "compare", dict(strategy=s, layout=lay,
                                                                  variant=v)))
    for s in STRATEGIES:
        for dropout in (False, True):
            cases.append((f"count-{s}-{'dropout' if dropout else 'plain'}", "count",
                          dict(strategy=s, dropout=dropout)))
    cases.append(("balance", "balance", {}))
    cases.append(("fused_ran", "fused_ran", {}))
    for bad in BAD_INPUTS:
        cases.append((f"bad-{bad}", "bad_input", dict(kind=bad)))
    cases.append(("errors_float32", "error_vs_p", {}))
    if P == _WORLD:  # training reads the default group
        cases.append(("train", "train", {}))
    return cases


# -- what the processes run ------------------------------------------------------------------

_COUNTED = ("all_gather_object", "all_gather", "broadcast", "batch_isend_irecv",
            "all_to_all_single", "all_reduce")
_counts: dict[str, int] = {}
_fused_calls: dict[str, int] = {"fwd": 0, "bwd": 0}  # attn.fused's launchers, in this process


def _count_fused_launchers() -> None:
    """Wrap attn.fused._fwd / _bwd with counters: the ring's steps (which look them up at
    each call) and Ulysses' attn.call.run both reach torch's kernel through them."""
    import attn.fused

    for name, key in (("_fwd", "fwd"), ("_bwd", "bwd")):
        fn = getattr(attn.fused, name)

        def counted(*a, __fn=fn, __key=key, **kw):
            _fused_calls[__key] += 1
            return __fn(*a, **kw)

        setattr(attn.fused, name, counted)


def _count_collectives() -> None:
    """Wrap torch.distributed's collectives used by attn.distributed with counters."""
    import torch.distributed as dist

    for name in _COUNTED:
        fn = getattr(dist, name)

        def counted(*a, __fn=fn, __name=name, **kw):
            _counts[__name] = _counts.get(__name, 0) + 1
            return __fn(*a, **kw)

        setattr(dist, name, counted)


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward all-reduces: turns a replicated parameter's per-rank
    contribution into the full gradient (what DDP does), so it compares with the oracle."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist

        g = g.clone()
        dist.all_reduce(g, group=_GROUP)
        return g


def _sharded_fn(strategy: str, layout: str, backend: str = "auto", poison=None):
    """``fn(q, k, v, **kw)`` for compare_to_reference: shard, run, gather. ``poison``: added
    to the full k first (NaN / inf where poisoned, 0 elsewhere), so the oracle sees the clean
    keys and k's gradient passes unchanged (a NaN dk at a poisoned key shows)."""
    import attn.distributed as cp

    run = cp.ring_attention if strategy == "ring" else cp.ulysses_attention

    def fn(q, k, v, return_lse=False, **kw):
        kw["backend"] = backend  # not a keyword of compare_to_reference: its oracle is fixed
        kw = {n: _SumGrad.apply(t) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
        if poison is not None:
            k = k + poison
        g = _GROUP
        out, lse = run(cp.shard_sequence(q, layout, g), cp.shard_sequence(k, layout, g),
                       cp.shard_sequence(v, layout, g), layout=layout, group=g,
                       return_lse=True, **kw)
        out = cp.gather_sequence(out, layout, g)
        return (out, cp.gather_sequence(lse, layout, g)) if return_lse else out

    return fn


def _inputs(shape: dict):
    from attn.testing import make_inputs

    return make_inputs(**shape, seed=3)


def _compare(rank, P, strategy, layout, variant):
    from attn.testing import compare_to_reference

    shape, kw = _variant(variant, P)
    q, k, v = _inputs(shape)
    poison = _poison(k) if variant == "fused_nan_key" else None
    fn = _sharded_fn(strategy, layout, kw.pop("backend", "auto"), poison)
    before = dict(_fused_calls)
    report = compare_to_reference(fn, q, k, v, **kw)
    import attn.distributed as cp

    return {"ok": report.ok, "report": str(report),
            "errors": {c.name: (c.error, c.budget) for c in report.comparisons},
            "fused_calls": {n: _fused_calls[n] - before[n] for n in before},
            # the ring's last call on this rank (every call of the comparison is the same)
            "ring_launches": cp.last_ring_stats.launches if strategy == "ring" else None,
            "ring_backends": (cp.last_ring_stats.backend, cp.last_ring_backward_stats.backend),
            "ring_reason": cp.last_ring_stats.reason}


def _poison(k):
    """NaN at key 9 and inf at key 12 of fused_nan_key's keys (Nq = 13, Nk = 31, window
    (5, 2) bottom-right: row 0 sees keys 13..20, so no row sees 0..12). Key 12 lies in a
    chunk whose other keys some rows see (at P = 2, 3, 4), so its ring steps run with it."""
    poison = torch.zeros_like(k)
    poison[:, :, 9] = float("nan")
    poison[:, :, 12] = float("inf")
    return poison


def _count(rank, P, strategy, dropout):
    import attn.distributed as cp

    shape, kw = _variant("dropout" if dropout else "sinks", P)
    q, k, v = (cp.shard_sequence(t, "zigzag", _GROUP).detach().requires_grad_()
               for t in _inputs(shape))
    run = cp.ring_attention if strategy == "ring" else cp.ulysses_attention
    _counts.clear()
    out, lse = run(q, k, v, return_lse=True, group=_GROUP, **kw)
    fwd = dict(_counts)
    _counts.clear()
    (out.sum() + lse.sum()).backward()
    return {"fwd": fwd, "bwd": dict(_counts), "stats_fwd": vars(cp.last_ring_stats).copy(),
            "stats_bwd": vars(cp.last_ring_backward_stats).copy()}


def _balance(rank, P):
    """Causal zigzag with N % 2P == 0: every rank launches the same number of chunk pairs."""
    import attn.distributed as cp

    full = _inputs(dict(B=1, H=2, N=8 * P, D=8))
    q, k, v = (cp.shard_sequence(t, group=_GROUP) for t in full)
    cp.ring_attention(q, k, v, causal=True, group=_GROUP)
    zig = vars(cp.last_ring_stats).copy()
    q, k, v = (cp.shard_sequence(t, "contiguous", _GROUP) for t in full)
    cp.ring_attention(q, k, v, causal=True, layout="contiguous", group=_GROUP)
    return {"zigzag": zig, "contiguous": vars(cp.last_ring_stats).copy()}


def _fused_ran(rank, P):
    """One causal float32 GQA ring call (zigzag) on each of fused and tiled: how often the
    fused launchers ran, forward and backward, and the stats of each call."""
    import attn.distributed as cp

    shape = dict(B=1, H=2 * P, Hkv=P, N=8 * P + 3, D=8, dtype=torch.float32)
    res = {}
    for backend in ("fused", "tiled"):
        q, k, v = (cp.shard_sequence(t, group=_GROUP).detach().requires_grad_()
                   for t in _inputs(shape))
        before = dict(_fused_calls)
        out, lse = cp.ring_attention(q, k, v, causal=True, group=_GROUP, backend=backend,
                                     return_lse=True)
        fwd = _fused_calls["fwd"] - before["fwd"]
        (out.sum() + lse.sum()).backward()
        res[backend] = {"fwd": fwd, "bwd": _fused_calls["bwd"] - before["bwd"],
                        "stats_fwd": vars(cp.last_ring_stats).copy(),
                        "stats_bwd": vars(cp.last_ring_backward_stats).copy()}
    return res


def _bad_input(rank, P, kind):
    import attn.distributed as cp

    shape = dict(B=1, H=2 * P, N=4 * P + 1, D=8)
    run = cp.ulysses_attention if kind.startswith("ulysses") else cp.ring_attention
    kw = {}
    if kind == "ulysses_heads":
        shape["H"] = 2 * P + 1
    elif kind == "ulysses_kv_heads":  # Hkv neither divides over P nor replicates onto it
        shape.update({2: dict(H=6, Hkv=3), 3: dict(H=6, Hkv=2), 4: dict(H=12, Hkv=3)}[P])
    q, k, v = (cp.shard_sequence(t, group=_GROUP) for t in _inputs(shape))
    if rank == 1 and kind == "k_length_on_rank1":
        k, v = k[:, :, :-1], v[:, :, :-1]  # a length no layout split gives
    if rank == 1 and kind == "head_dim_on_rank1":
        q = torch.cat([q, q[..., :1]], -1)
    if rank == 1 and kind == "dtype_on_rank1":
        q, k, v = q.double(), k.double(), v.double()  # the others hold float32
    if kind == "attn_mask":
        kw["attn_mask"] = torch.ones(1, dtype=torch.bool)
    _counts.clear()
    try:
        run(q, k, v, causal=True, group=_GROUP, **kw)
    except (ValueError, TypeError, NotImplementedError) as exc:
        return {"raised": type(exc).__name__, "message": str(exc), "counts": dict(_counts)}
    return {"raised": None, "counts": dict(_counts)}


def _error_vs_p(rank, P):
    """Float32 ring and Ulysses, zigzag, on fixed inputs: the error against float64."""
    from attn.testing import compare_to_reference

    kw = dict(causal=True, window=(40, 0))
    q, k, v = _inputs(dict(B=1, H=4, N=96, D=16, dtype=torch.float32))
    res = {}
    for s in STRATEGIES:
        if s == "ulysses" and 4 % P:
            continue
        rep = compare_to_reference(_sharded_fn(s, "zigzag"), q, k, v, **kw)
        res[s] = {c.name: (c.error, c.budget) for c in rep.comparisons}
    return res


# a tiny text run (causal, RoPE, a window and sinks) whose sequence (37) divides no 2P
_TRAIN = dict(task="text", steps=4, batch_size=2, block_size=37, n_layer=2, dim=32, heads=4,
              window=9, sinks=True, eval_every=2, eval_batches=2, dtype="float64", threads=1,
              save_every=1000)


def _train(rank, P):
    import tempfile

    import conftest  # noqa: F401  (this checkout's models/ as attn.models, as in the parent)
    from attn.models.train import TrainConfig, train

    with tempfile.TemporaryDirectory() as out:
        m = train(TrainConfig(**_TRAIN, context_parallel=P), out, progress=False)
    return {k: m[k] for k in ("losses", "val_loss", "step_peak_bytes_per_rank")}


_CASES = {"train": _train, "compare": _compare, "count": _count, "balance": _balance,
          "bad_input": _bad_input, "error_vs_p": _error_vs_p, "fused_ran": _fused_ran}


def _worker(rank: int, port: int, plan: list, out_q) -> None:
    """One of the ``_WORLD`` processes: every world size of ``plan`` in turn, on its group."""
    global _GROUP
    torch.set_num_threads(1)
    import torch.distributed as dist

    import functools

    import attn.tiled

    # small tiles: each ring step's launch crosses several tile edges even at N = 23. The ring
    # and Ulysses call the tiled launchers through attn.tiled: bind the config there
    small = attn.tiled.TileConfig(block_m=4, block_n=8)
    for name in ("_fwd", "_bwd", "tiled_attention"):
        setattr(attn.tiled, name, functools.partial(getattr(attn.tiled, name), config=small))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=_WORLD, timeout=timedelta(seconds=_TIMEOUT_S))
    # every rank creates every group, in the same order (new_group is a collective)
    groups = {P: None if P == _WORLD else dist.new_group(list(range(_WORLD - P, _WORLD)))
              for P, _ in plan}
    _count_collectives()
    _count_fused_launchers()
    try:
        for P, cases in plan:
            if rank >= _WORLD - P:
                _GROUP = groups[P]
                g_rank = dist.get_rank(_GROUP)
                for case_id, kind, params in cases:
                    t0 = time.perf_counter()
                    try:
                        rec = _CASES[kind](g_rank, P, **params)
                    except Exception:  # recorded, the test fails with it; the run goes on
                        rec = {"exception": traceback.format_exc()}
                    rec["seconds"] = time.perf_counter() - t0
                    out_q.put((P, g_rank, case_id, rec))
            dist.barrier()  # the ranks outside this group wait here
    finally:
        out_q.put((None, rank, None, None))
        dist.destroy_process_group()


# -- the parent: one launch of _WORLD processes, reused by every test --------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(plan: list) -> dict[tuple[int, str], dict[int, dict]]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    # the ranks hold CPU tensors: triton runs on them only in the interpreter, which a spawned
    # rank must be told even where this process compiles for a GPU
    env = {"OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, plan, out_q), daemon=True)
             for r in range(_WORLD)]
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results: dict[tuple[int, str], dict[int, dict]] = {}
    done, deadline = 0, time.monotonic() + _TIMEOUT_S
    try:
        while done < _WORLD:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"processes did not finish within {_TIMEOUT_S} s (a hang); "
                                   f"results so far: {sorted(results)}")
            try:
                P, rank, case_id, rec = out_q.get(timeout=min(left, 5.0))
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a process died (exit codes "
                                       f"{[p.exitcode for p in procs]})")
                continue
            if case_id is None:
                done += 1
            else:
                results.setdefault((P, case_id), {})[rank] = rec
    finally:
        for p in procs:  # only the processes started here, by handle
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return results


_RUN: list = []  # the one launch's results, or the exception that ended it


def _results() -> dict[tuple[int, str], dict[int, dict]]:
    if not _RUN:
        try:
            _RUN.append(_launch([(P, _case_list(P)) for P in (2, 3, 4)]))
        except BaseException as exc:  # every test fails with the same reason
            _RUN.append(exc)
    if isinstance(_RUN[0], BaseException):
        raise _RUN[0]
    return _RUN[0]


def _case(P: int, case_id: str) -> dict[int, dict]:
    recs = _results().get((P, case_id))
    assert recs is not None and sorted(recs) == list(range(P)), \
        f"case {case_id} at P={P}: records from ranks {sorted(recs or {})}"
    for r, rec in recs.items():
        assert "exception" not in rec, f"rank {r} of {P}:\n{rec['exception']}"
    return recs


# -- tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("P, case_id", [
    pytest.param(P, cid, id=f"P{P}-{cid}")
    for P in (2, 3, 4) for cid, kind, _ in _case_list(P) if kind == "compare"])
def test_matches_unsharded_attention(P, case_id):
    for rank, rec in _case(P, case_id).items():
        assert rec["ok"], f"rank {rank} of {P}, {case_id}:\n{rec['report']}"


@pytest.mark.parametrize("P", (2, 3, 4))
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dropout", (False, True), ids=("plain", "dropout"))
def test_collectives_per_call(P, strategy, dropout):
    for rank, rec in _case(P, f"count-{strategy}-{'dropout' if dropout else 'plain'}").items():
        fwd, bwd = rec["fwd"], rec["bwd"]
        seed = {"broadcast": 1} if dropout else {}
        if strategy == "ring":
            # one validation all-gather, P − 1 K/V hops; backward: P − 1 K/V + P dK/dV hops
            assert fwd == {"all_gather_object": 1, "batch_isend_irecv": P - 1, **seed}, fwd
            assert bwd == {"batch_isend_irecv": 2 * P - 1}, bwd
            assert rec["stats_fwd"]["kv_exchanges"] == P - 1
            assert rec["stats_bwd"]["dkv_exchanges"] == P
        else:
            # q, k, v in; out and lse back; backward: the reverse of each
            assert fwd == {"all_gather_object": 1, "all_to_all_single": 5, **seed}, fwd
            assert bwd == {"all_to_all_single": 5}, bwd


@pytest.mark.parametrize("P", (2, 3, 4))
def test_zigzag_balances_causal_work(P):
    recs = _case(P, "balance")
    zig = [recs[r]["zigzag"]["launches"] for r in range(P)]
    contig = [recs[r]["contiguous"]["launches"] for r in range(P)]
    assert len(set(zig)) == 1, f"zigzag launches per rank {zig}"
    assert contig == list(range(1, P + 1)), f"contiguous launches per rank {contig}"
    # masked (query chunk, key chunk) pairs are skipped, not computed
    assert all(recs[r]["zigzag"]["skipped"] > 0 for r in range(P))


@pytest.mark.parametrize("P, case_id", [
    pytest.param(P, cid, id=f"P{P}-{cid}")
    for P in (2, 3, 4) for cid, kind, params in _case_list(P)
    if kind == "compare" and params["variant"].startswith("fused")])
def test_fused_calls_run_torchs_kernel(P, case_id):
    """The compare cases above that ask for fused (or that auto gives to it) ran attn.fused's
    launchers forward and backward, ring steps and Ulysses alike; the one whose keys hold a
    NaN and an inf under a window ran none (every rank on tiled, as attention would)."""
    recs = _case(P, case_id)
    for rank, rec in recs.items():
        calls = rec["fused_calls"]
        # a rank whose queries see no key at all (fused_rows_unseen's early rows) launches
        # nothing, on any backend
        if case_id.endswith("fused_nan_key") or rec["ring_launches"] == 0:
            assert calls == {"fwd": 0, "bwd": 0}, (rank, calls)
        else:
            assert calls["fwd"] > 0 and calls["bwd"] > 0, (rank, calls)
    if not case_id.endswith("fused_nan_key"):
        assert any(rec["fused_calls"]["fwd"] for rec in recs.values()), recs
    if case_id.startswith("ring"):  # which launchers the ring's steps ran, as it says
        want = ("tiled",) * 2 if case_id.endswith("fused_nan_key") else ("fused",) * 2
        for rank, rec in recs.items():
            assert tuple(rec["ring_backends"]) == want, (rank, rec["ring_backends"])
            if case_id.endswith("fused_nan_key"):
                assert "non-finite key" in rec["ring_reason"], rec["ring_reason"]


@pytest.mark.parametrize("P", (2, 3, 4))
def test_ring_steps_launch_fused_once_each(P):
    """backend="fused": each ring step that the band leaves visible is one call of fused's
    forward (and one of its backward), and the stats count launches and skipped pairs as
    tiled's ring does on the same call."""
    for rank, rec in _case(P, "fused_ran").items():
        f, t = rec["fused"], rec["tiled"]
        assert f["stats_fwd"]["backend"] == f["stats_bwd"]["backend"] == "fused", f
        assert f["fwd"] == f["stats_fwd"]["launches"] > 0, (rank, f)
        assert f["bwd"] == f["stats_bwd"]["launches"] > 0, (rank, f)
        assert t["fwd"] == t["bwd"] == 0 and t["stats_fwd"]["backend"] == "tiled", (rank, t)
        for d in ("stats_fwd", "stats_bwd"):
            for key in ("launches", "skipped", "kv_exchanges", "dkv_exchanges"):
                assert f[d][key] == t[d][key], (rank, d, key, f[d], t[d])


@pytest.mark.parametrize("P", (2, 3, 4))
@pytest.mark.parametrize("kind", BAD_INPUTS)
def test_bad_input_raises_on_every_rank(P, kind):
    recs = _case(P, f"bad-{kind}")
    want = {"attn_mask": "NotImplementedError", "dtype_on_rank1": "ValueError"}.get(
        kind, "ValueError")
    for rank, rec in recs.items():
        assert rec["raised"] == want, f"rank {rank}: {rec}"
        # raised after the one validation all-gather, before any K/V moved
        assert rec["counts"] == {"all_gather_object": 1}, rec["counts"]
    msgs = [recs[r]["message"] for r in range(P)]
    if kind.endswith("rank1"):
        assert all("rank 1" in m or r == 1 for r, m in enumerate(msgs)), msgs
    if kind == "ulysses_heads":
        assert all(f"H = {2 * P + 1}" in m for m in msgs), msgs
    if kind == "ulysses_kv_heads":
        assert all("Hkv" in m for m in msgs), msgs


def test_error_does_not_grow_with_p():
    """Float32 error against float64 at P = 2, 3, 4, each within attn.testing's budget (which
    does not depend on P); the table is printed so a run can publish it (-s)."""
    rows = []
    for P in (2, 3, 4):
        rec = _case(P, "errors_float32")[0]
        for s in STRATEGIES:
            for name, (err, budget) in rec.get(s, {}).items():
                assert err <= budget, f"{s} P={P} {name}: {err:.3e} > {budget:.3e}"
                rows.append((s, P, name, err))
    print("\nstrategy  P  tensor  error (float32 vs float64)")
    for s, P, name, err in rows:
        print(f"{s:<9} {P}  {name:<6}  {err:.3e}")


def test_layout_split_agrees_with_tensor_split():
    from attn.distributed import shard_ranges

    for n in (4, 5, 23, 64):
        for P in (1, 2, 3, 4):
            if n < P:
                continue
            x = torch.arange(n)
            chunks = torch.tensor_split(x, 2 * P)
            for r, ranges in enumerate(shard_ranges(n, P, "zigzag")):
                want = torch.cat([chunks[r], chunks[2 * P - 1 - r]])
                assert torch.equal(torch.cat([x[a:b] for a, b in ranges]), want)
            for r, ((a, b),) in enumerate(shard_ranges(n, P, "contiguous")):
                assert torch.equal(x[a:b], torch.tensor_split(x, P)[r])


def test_needs_an_initialised_group():
    import attn.distributed as cp

    with pytest.raises(RuntimeError, match="init_process_group"):
        cp.shard_sequence(torch.zeros(1, 1, 4, 2))


def test_context_parallel_training_matches_one_process(tmp_path):
    """scripts/train.py --context-parallel P's loop at P = 4: the loss curve matches one
    process at the same seed (the loss is reduced in float32, as GPT.forward does), and each
    rank's peak memory for the first step is below one process's for the same step."""
    from attn.timing import peak_bytes
    from attn.models.gpt import GPT
    from attn.models.train import TrainConfig, _Task, train

    one = train(TrainConfig(**_TRAIN), tmp_path, progress=False)
    recs = _case(_WORLD, "train")
    for rank, rec in recs.items():
        assert rec["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=0), rank
        assert rec["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5, abs=0)
    cfg = TrainConfig(**_TRAIN)
    torch.manual_seed(cfg.seed)
    task = _Task(cfg)
    model = GPT(cfg.model_config(task.vocab_size)).to(torch.float64)
    x, y, _ = task.batch("train", 0)
    whole = peak_bytes(lambda: model(x, y)[1].backward())
    per_rank = recs[0]["step_peak_bytes_per_rank"]
    assert max(per_rank) < whole, (per_rank, whole)


@pytest.mark.cuda
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nccl_world_size_one(strategy):
    """NCCL with one GPU (pinned: world size 1 where a single GPU is lent): the CUDA path,
    triton chosen by "auto", forward and backward against attn.attention."""
    import torch.distributed as dist

    from attn.testing import compare_to_reference, make_inputs

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        torch.cuda.set_device(0)
        q, k, v = make_inputs(B=2, H=4, Hkv=2, N=257, D=64, dtype=torch.bfloat16, device="cuda")
        for kw in (dict(causal=True), dict(causal=True, window=(64, 0), softcap=20.0,
                                           sinks=torch.zeros(4, device="cuda"))):
            rep = compare_to_reference(_sharded_fn(strategy, "zigzag"), q, k, v, **kw)
            assert rep.ok, f"{kw}:\n{rep}"
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_train_script_spawns_its_ranks(tmp_path):
    """``scripts/train.py --context-parallel 2`` without torchrun: it spawns two gloo ranks
    itself, and its losses match the one-process run of the same command."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    probe = subprocess.run([sys.executable, "-c", "import attn.models, pathlib; print(pathlib"
                            ".Path(attn.models.__file__).resolve().parent)"],
                           cwd=root, capture_output=True, text=True)
    if Path(probe.stdout.strip() or ".") != root / "models":
        pytest.skip("attn.models resolves to another checkout here (an editable install of "
                    "another tree): the spawned ranks would train that tree's code")
    flags = ["--task", "text", "--steps", "3", "--batch-size", "2", "--block-size", "37",
             "--n-layer", "2", "--dim", "32", "--heads", "4", "--eval-every", "3",
             "--eval-batches", "1", "--dtype", "float64", "--threads", "1", "--no-progress"]
    losses = {}
    for P in (None, 2):
        out = tmp_path / f"run{P}"
        extra = [] if P is None else ["--context-parallel", str(P)]
        subprocess.run([sys.executable, str(root / "scripts" / "train.py"), *flags, *extra,
                        "--out", str(out)], cwd=root, check=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        losses[P] = json.loads((out / "metrics.json").read_text())["losses"]
    assert losses[2] == pytest.approx(losses[None], rel=1e-5, abs=0)


@pytest.mark.slow
def test_bench_context_parallel_runs(tmp_path):
    """``attn bench context-parallel`` at tiny sizes: every point measured, memory above the
    inputs positive, errors against float64 within float32 rounding, files written."""
    import json

    from attn.bench.cli import main

    rc = main(["bench", "context-parallel", "--world-sizes", "1", "2", "--n", "64", "128",
               "--repeat", "1", "--error-n", "32", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    rows = res["rows"]
    assert {(r["strategy"], r["P"]) for r in rows} == {(s, P) for s in STRATEGIES
                                                      for P in (1, 2)}
    assert all(r["status"] == "ok" and r["peak_bytes"] > 0 and r["ms"] > 0 for r in rows)
    assert all(e[t] < 1e-4 for e in res["errors"] for t in ("out", "dq", "dk", "dv"))
    assert (tmp_path / "results.md").exists() and (tmp_path / "context_parallel.png").exists()
