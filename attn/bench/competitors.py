"""torch's own attention kernels as competitor rows of a sweep (docs/benchmarks.md, 'The
report'): SDPA with one kernel forced (:data:`SDPA_KERNELS`; plain ``sdpa`` is attn's backend,
torch's own choice) and compiled FlexAttention (``flex``, :func:`flex_variant`), both through
:data:`attn.sdpa.torch_sdpa` (:mod:`attn.sdpa` says why).
"""

from __future__ import annotations

import functools
import operator
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from attn.sdpa import torch_sdpa

# competitor name → the torch.nn.attention.SDPBackend member it forces
SDPA_KERNELS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION",
                "sdpa-cudnn": "CUDNN_ATTENTION"}
COMPETITORS = (*SDPA_KERNELS, "flex")
# torch has these kernels on CUDA only; asking elsewhere says nothing new
_CUDA_ONLY = ("sdpa-efficient", "sdpa-cudnn")


def _check_name(name: str) -> None:
    if name not in COMPETITORS:
        raise ValueError(f"competitor must be one of {COMPETITORS}, got {name!r}")


def _sdpa_forward(name: str, causal: bool) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernel = getattr(SDPBackend, SDPA_KERNELS[name])

    def forward(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with sdpa_kernel(kernel):
            return torch_sdpa(q, k, v, is_causal=causal)
    return forward


# what flex_variant cannot express, and why
FLEX_CANNOT = {
    "sinks": "flex_attention has no sinks argument (a sink is an extra column of the "
             "softmax's denominator, not a score of any key)",
    "dropout_p": "flex_attention has no dropout",
    "attn_mask": "a dense mask is not a flex variant (a mask_mod reading it would be)",
}


def flex_variant(kw: dict, N: int, device: str, *, compile: bool = True
                 ) -> Callable[[Tensor, Tensor, Tensor], Tensor] | str:
    """``forward(q, k, v) → out`` running flex on the attn.attention variant ``kw``
    (``causal``, ``window``, ``softcap`` as a float, ``alibi_slopes`` of shape (H,); Nq =
    Nk = N, where attn's bottom-right alignment is the plain one), or why flex cannot
    express it. The score_mod applies attn's order after the scale: softcap, then ALiBi's
    ``−slope·|j − i|``; causal and the window become a block mask. ``compile`` False runs
    flex eagerly (its math path: for checking the translation, not for timing)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    for name, why in FLEX_CANNOT.items():
        if kw.get(name) is not None and not (name == "dropout_p" and kw[name] == 0.0):
            return why
    unknown = sorted(set(kw) - {"causal", "window", "softcap", "alibi_slopes", *FLEX_CANNOT})
    if unknown:
        return f"no flex translation of {unknown}"
    cap, slopes = kw.get("softcap"), kw.get("alibi_slopes")
    if cap is not None and not isinstance(cap, float):
        return "a learned (tensor) softcap has no flex translation here"
    left, right = kw.get("window") or (-1, -1)
    keeps = [lambda i, j: i >= j] if kw.get("causal") else []
    keeps += [lambda i, j: i - j <= left] if left >= 0 else []
    keeps += [lambda i, j: j - i <= right] if right >= 0 else []

    def mask_mod(b, h, q_idx, kv_idx):
        return functools.reduce(operator.and_, (keep(q_idx, kv_idx) for keep in keeps))

    def score_mod(score, b, h, q_idx, kv_idx):
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        if slopes is not None:
            score = score - slopes[h] * (kv_idx - q_idx).abs()
        return score

    block_mask = (create_block_mask(mask_mod, B=None, H=None, Q_LEN=N, KV_LEN=N,
                                    device=device) if keeps else None)
    mod = score_mod if cap is not None or slopes is not None else None
    run = torch.compile(flex_attention, dynamic=False) if compile else flex_attention
    return lambda q, k, v: run(q, k, v, score_mod=mod, block_mask=block_mask,
                               enable_gqa=q.shape[1] != k.shape[1])


def make_forward(name: str, causal: bool, N: int, device: str
                 ) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """``forward(q, k, v) → out`` for q, k, v of shape (B, H, N, D) on ``device``."""
    _check_name(name)
    if name == "flex":  # Nq == Nk in a sweep: top-left and bottom-right alignment agree
        return flex_variant({"causal": True} if causal else {}, N, device)
    return _sdpa_forward(name, causal)


def competitor_unsupported(name: str, device: str, dtype: torch.dtype, D: int, causal: bool,
                           mode: str) -> str | None:
    """Why competitor ``name`` cannot run a point with this device, dtype, head dim, causal
    flag and mode ("fwd" or "fwd+bwd"), or None when it can (a forced kernel's answer depends
    on the GPU and the build: it is asked once, on a tiny input)."""
    _check_name(name)
    kind = torch.device(device).type
    if name in _CUDA_ONLY and kind != "cuda":
        return f"{name}: torch has this kernel on CUDA only"
    if name == "flex":
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except ImportError:
            return f"flex: torch {torch.__version__} has no torch.nn.attention.flex_attention"
        if mode == "fwd+bwd" and kind != "cuda":
            return "flex: FlexAttention has no backward off CUDA"
        return None  # probing would mean compiling: a failure shows up in the point itself
    return _probe_sdpa(name, str(device), dtype, D, causal, mode)


@functools.lru_cache(maxsize=None)
def _probe_sdpa(name: str, device: str, dtype: torch.dtype, D: int, causal: bool,
                mode: str) -> str | None:
    """Run the forced kernel once on (1, 1, 16, D) inputs; its refusal is the reason."""
    grad = mode == "fwd+bwd"
    q, k, v = (torch.randn(1, 1, 16, D, device=device, dtype=dtype).requires_grad_(grad)
               for _ in range(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = _sdpa_forward(name, causal)(q, k, v)
            if grad:
                out.sum().backward()
        except RuntimeError as exc:
            why = "; ".join(dict.fromkeys(str(w.message).splitlines()[0] for w in caught))
            return (f"{name}: torch's {SDPA_KERNELS[name]} kernel refuses {dtype} D={D}"
                    f"{' causal' if causal else ''} {mode} here: "
                    f"{why or str(exc).splitlines()[0]}")[:300]
    return None
