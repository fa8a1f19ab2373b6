"""torch's fused CUDA attention kernels, shaped as the fused backend's block primitive.

:mod:`attn.fused` calls one kernel pair per piece of its plan: ``fwd(q, k, v, causal, mask,
scale) -> (out, lse)`` and ``bwd(do, q, k, v, out, lse, causal, mask, scale) -> (dq, dk,
dv)``, q ``(1, G, rows, D)``, k and v ``(1, 1, keys, D)`` (one kv head with its G query
heads), ``causal`` torch's top-left causal, ``mask`` additive in q's dtype ``(1, G or 1, rows,
keys)`` or None, lse ``(1, G, rows)`` float32. On CPU the pair is torch's ``_for_cpu`` op;
here it is one of torch's three CUDA ops that return an lse, their quirks hidden
(docs/design.md, "The fused backend"). ``auto`` takes one only where ``attn gpu-check``
verified it (:func:`verified_op`, ``attn/fused_cuda_table.json``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import pathlib
import warnings
from typing import Callable, NamedTuple

import torch
from torch import Tensor

OPS = ("cudnn", "flash", "efficient")  # in order of preference, verified ones first

SCHEMAS = {
    "flash": (
        "aten::_scaled_dot_product_flash_attention(Tensor query, Tensor key, Tensor value, "
        "float dropout_p=0., bool is_causal=False, bool return_debug_mask=False, *, "
        "float? scale=None) -> (Tensor output, Tensor logsumexp, Tensor cum_seq_q, "
        "Tensor cum_seq_k, SymInt max_q, SymInt max_k, Tensor rng_state, Tensor unused, "
        "Tensor debug_attn_mask)"),
    "flash_backward": (
        "aten::_scaled_dot_product_flash_attention_backward(Tensor grad_out, Tensor query, "
        "Tensor key, Tensor value, Tensor out, Tensor logsumexp, Tensor cum_seq_q, "
        "Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, "
        "Tensor philox_seed, Tensor philox_offset, *, float? scale=None) -> "
        "(Tensor grad_query, Tensor grad_key, Tensor grad_value)"),
    "efficient": (
        "aten::_scaled_dot_product_efficient_attention(Tensor query, Tensor key, Tensor value, "
        "Tensor? attn_bias, bool compute_log_sumexp, float dropout_p=0., bool is_causal=False, "
        "*, float? scale=None) -> (Tensor output, Tensor log_sumexp, Tensor philox_seed, "
        "Tensor philox_offset)"),
    "efficient_backward": (
        "aten::_scaled_dot_product_efficient_attention_backward(Tensor grad_out_, "
        "Tensor query, Tensor key, Tensor value, Tensor attn_bias, Tensor out, "
        "Tensor logsumexp, Tensor philox_seed, Tensor philox_offset, float dropout_p, "
        "bool[4] grad_input_mask, bool is_causal=False, *, float? scale=None) -> "
        "(Tensor, Tensor, Tensor, Tensor)"),
    "cudnn": (
        "aten::_scaled_dot_product_cudnn_attention(Tensor query, Tensor key, Tensor value, "
        "Tensor? attn_bias, bool compute_log_sumexp, float dropout_p=0., bool is_causal=False, "
        "bool return_debug_mask=False, *, float? scale=None) -> (Tensor output, "
        "Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, "
        "Tensor philox_seed, Tensor philox_offset, Tensor debug_attn_mask)"),
    "cudnn_backward": (
        "aten::_scaled_dot_product_cudnn_attention_backward(Tensor grad_out, Tensor query, "
        "Tensor key, Tensor value, Tensor out, Tensor logsumexp, Tensor philox_seed, "
        "Tensor philox_offset, Tensor attn_bias, Tensor cum_seq_q, Tensor cum_seq_k, "
        "SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, *, float? scale=None) "
        "-> (Tensor, Tensor, Tensor)"),
}

TABLE = pathlib.Path(__file__).with_name("fused_cuda_table.json")


def checked_ops(schemas: dict[str, str], where: str = "", *, show: bool = False
                ) -> dict[str, Callable] | str:
    """torch's op for each key of ``schemas`` (key -> the schema this module was written
    for, which names the op), or why they cannot be used: one is absent, or has another
    schema (``show``: the one found, in the reason); then one warning that the fused backend
    is off (``where``), for the caller's caller."""
    found = {}
    for key, expected in schemas.items():
        name = expected.split("(", 1)[0].removeprefix("aten::")
        packet = getattr(torch.ops.aten, name, None)
        overload = None if packet is None else getattr(packet, "default", None)
        if overload is None:
            why = f"torch {torch.__version__} has no aten::{name}"
        elif str(overload._schema) != expected:
            why = f"aten::{name} has another schema on torch {torch.__version__}"
            why += f": {overload._schema}" if show else ""
        else:
            found[key] = overload
            continue
        warnings.warn(f"attn: the fused backend is off{where}: {why}", RuntimeWarning,
                      stacklevel=4)
        return why
    return found


@functools.cache
def ops() -> dict[str, Callable] | str:
    """torch's CUDA ops by name (``flash``, ``flash_backward`` ...), or why they cannot be
    used (:func:`checked_ops`, one warning per process)."""
    return checked_ops(SCHEMAS, " on CUDA")


def can_run(op: str, dtype: torch.dtype, head_dim: int, masked: bool) -> bool:
    """What each op takes, as torch documents its kernels (the verification table settles
    the rest): flash and cuDNN fp16/bf16 only, flash no mask, head dims up to 256."""
    if dtype == torch.float64 or head_dim > 256:
        return False
    if op == "efficient":
        return True
    half = dtype in (torch.float16, torch.bfloat16)
    return half and not (op == "flash" and masked)


def _key(op: str, dtype: torch.dtype, head_dim: int, device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)  # a CUDA build with a GPU
    torch_mm = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return f"{op}|torch {torch_mm}|sm_{major}{minor}|{str(dtype).removeprefix('torch.')}|" \
           f"d{head_dim}"


@functools.cache
def table() -> dict[str, dict]:
    """The committed verification table: key (:func:`_key`) -> its row."""
    if not TABLE.exists():
        return {}
    return {row["key"]: row for row in json.loads(TABLE.read_text())["rows"]}


def verified_op(dtype: torch.dtype, head_dim: int, masked: bool,
                device: torch.device, *, faster: bool = False) -> str | None:
    """The first op with a passing verification entry for this torch, arch, dtype and head
    dim that can compute the call (``masked``: some piece carries a mask), or None; with
    ``faster`` only one measured at least as fast as triton (``speedup_vs_triton``)."""
    rows = table()
    if not rows:  # nothing verified (and no GPU needed to say so)
        return None
    for op in OPS:
        row = rows.get(_key(op, dtype, head_dim, device))
        if row is None or not row.get("exact") or not can_run(op, dtype, head_dim, masked):
            continue
        if faster and (row.get("speedup_vs_triton") or 0.0) < 1.0:
            continue
        return op
    return None


_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("attn_fused_cuda_op",
                                                                    default=None)


def forced_op() -> str | None:
    """The op :func:`force_op` set for this context, or None."""
    return _FORCED.get()


@contextlib.contextmanager
def force_op(op: str):
    """Every piece of a fused CUDA call in this context runs ``op`` (one of :data:`OPS`),
    whatever the table says: how ``attn gpu-check`` verifies each op in turn."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    token = _FORCED.set(op)
    try:
        yield
    finally:
        _FORCED.reset(token)


class Pair(NamedTuple):
    """One op as the fused backend's block primitive (see the module docstring)."""
    name: str
    fwd: Callable
    bwd: Callable


def _pad8(t: Tensor) -> Tensor:
    d = t.shape[-1]
    return t if d % 8 == 0 else torch.nn.functional.pad(t, (0, 8 - d % 8))


def _bias(mask: Tensor | None, G: int, rows: int, keys: int) -> Tensor | None:
    """The additive mask as the efficient and cuDNN ops read a bias: (1, G, rows, keys),
    stored with its last dimension padded to a multiple of 16 (a view of the first keys)."""
    if mask is None:
        return None
    width = -(-keys // 16) * 16
    store = torch.zeros(1, G, rows, width, dtype=mask.dtype, device=mask.device)
    store[..., :keys] = mask.expand(1, G, rows, keys)
    return store[..., :keys]


def pair(op: str, table_ops: dict[str, Callable] | None = None) -> Pair:
    """The kernel pair for ``op`` (one of :data:`OPS`); ``table_ops`` replaces torch's ops
    (the tests hand in stand-ins that behave as the CUDA ops do, on CPU)."""
    a = ops() if table_ops is None else table_ops
    if isinstance(a, str):
        raise NotImplementedError(f"backend='fused' is off on CUDA: {a}")

    def prep(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None
             ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """q, k, v padded to 8 columns, K/V expanded to q's G heads, and the mask as a bias."""
        if op == "flash" and mask is not None:
            raise ValueError("the flash op takes no mask: a masked piece must run another op")
        G = q.shape[1]
        return (_pad8(q), _pad8(k).expand(1, G, -1, -1), _pad8(v).expand(1, G, -1, -1),
                _bias(mask, G, q.shape[2], k.shape[2]))

    def fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Tensor | None,
            scale: float) -> tuple[Tensor, Tensor]:
        Dv, rows = v.shape[-1], q.shape[2]
        qp, kp, vp, bias = prep(q, k, v, mask)
        if op == "flash":
            res = a["flash"](qp, kp, vp, 0.0, causal, False, scale=scale)
        else:
            res = a[op](qp, kp, vp, bias, True, 0.0, causal and bias is None, scale=scale)
        # the lse as (1, G, rows); a row the mask hides may come back NaN, which the fused
        # backend zeroes (docs/design.md, "The fused backend", On CUDA)
        lse = res[1]
        return res[0][..., :Dv], lse.reshape(lse.shape[0], lse.shape[1], -1)[..., :rows]

    def bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
            causal: bool, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        D, Dv, rows, keys = q.shape[-1], v.shape[-1], q.shape[2], k.shape[2]
        qp, kp, vp, bias = prep(q, k, v, mask)
        dop, outp = _pad8(do), _pad8(out)
        zero = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: unread
        lse = lse.contiguous()  # float32: the accumulation dtype of every dtype CUDA takes
        if op == "flash":
            gq, gk, gv = a["flash_backward"](dop, qp, kp, vp, outp, lse, None, None, rows,
                                             keys, 0.0, causal, zero, zero, scale=scale)
        elif op == "efficient":
            pad = -(-rows // 32) * 32 - rows  # the op reads its lse padded to 32 rows
            lse32 = torch.nn.functional.pad(lse, (0, pad), value=float("inf"))
            gq, gk, gv, _ = a["efficient_backward"](
                dop, qp, kp, vp, bias, outp, lse32, zero, zero, 0.0,
                [True, True, True, False], causal and bias is None, scale=scale)
        else:
            gq, gk, gv = a["cudnn_backward"](dop, qp, kp, vp, outp, lse.unsqueeze(-1), zero,
                                             zero, bias, None, None, rows, keys, 0.0,
                                             causal and bias is None, scale=scale)
        # the G heads' shares of one kv head, summed in head order
        return (gq[..., :D], gk.sum(1, keepdim=True)[..., :D],
                gv.sum(1, keepdim=True)[..., :Dv])

    return Pair(op, fwd, bwd)


def choose(dtype: torch.dtype, head_dim: int, masked: bool, device: torch.device) -> str:
    """The op a call on ``device`` runs: the verified one, else the first that can."""
    op = verified_op(dtype, head_dim, masked, device)
    if op is not None:
        return op
    for op in OPS[1:]:  # unverified: flash and efficient, whose quirks are known
        if can_run(op, dtype, head_dim, masked):
            return op
    raise NotImplementedError(f"backend='fused' cannot compute a {dtype} call with head dim "
                              f"{head_dim} on CUDA: no torch fused op takes it")
