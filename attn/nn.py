"""Modules that hold attention's parameters and call :func:`attn.attention`.

* :class:`QKNorm` — normalise queries and keys per head before the dot product: "l2"
  (cosine attention with a learnable scale g, Henry et al. 2020, "Query-Key Normalization for
  Transformers"), "rms" (RMSNorm with a per-dim gain shared across heads, Qwen3 / Gemma 3),
  "layer" (LayerNorm without bias, ViT-22B, Dehghani et al. 2023).
* :class:`RotaryEmbedding` — RoPE (Su et al. 2021), rotate-half layout, any position offset.
* :class:`MultiHeadAttention` — projections, optional RoPE and QK-norm, a fixed or learnable
  per-head temperature, softcap, sliding window, attention sinks, GQA, and a KV-cache path for
  decoding.

Layout is attn's everywhere: ``(B, H, N, D)``; activations entering and leaving
:class:`MultiHeadAttention` are ``(B, N, C)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attn.api import BACKENDS, attention

QK_NORM_KINDS = ("l2", "rms", "layer")
QK_NORM_POSITIONS = ("before", "after")


def default_l2_scale(train_len: int) -> float:
    """Henry et al.'s initial g for cosine attention: ``log2(L² − L)`` for training length L.

    With unit-norm q and k the scores lie in [-g, g]; this g lets a softmax over L keys still
    become sharp (the paper's heuristic)."""
    if train_len < 2:
        raise ValueError(f"train_len must be >= 2 for the l2 QK-norm default g, got {train_len}")
    return math.log2(train_len * train_len - train_len)


@dataclass(frozen=True)
class QKNormConfig:
    """How queries and keys are normalised. ``MultiHeadAttention(qk_norm="rms")`` is shorthand
    for ``QKNormConfig("rms")``."""

    kind: str  # "l2", "rms" or "layer"
    position: str = "before"  # relative to RoPE: "before" or "after"
    g_init: float | None = None  # l2 only: initial g; None = log2(train_len² − train_len)
    train_len: int = 1024  # l2 only: the training length L the default g is derived from
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.kind not in QK_NORM_KINDS:
            raise ValueError(f"qk_norm kind must be one of {QK_NORM_KINDS} (or None), "
                             f"got {self.kind!r}")
        if self.position not in QK_NORM_POSITIONS:
            raise ValueError(f"qk_norm position must be one of {QK_NORM_POSITIONS}, "
                             f"got {self.position!r}")
        if self.g_init is not None and not self.g_init > 0:
            raise ValueError(f"qk_norm g_init must be positive, got {self.g_init}")


class QKNorm(nn.Module):
    """Normalise q (B, H, Nq, D) and k (B, Hkv, Nk, D) over D, in float32 (float64 stays).

    * "l2": ``q̂ = q/‖q‖``, ``k̂ = k/‖k‖``, and the learnable scalar ``g`` multiplied into
      q̂, so the caller must attend with ``scale=1.0`` (see :attr:`attention_scale`): the score
      is then ``g · cos(q, k)``, and autograd gives g its exact gradient.
    * "rms": ``x / rms(x) · w`` with separate gains ``q_weight``, ``k_weight`` of shape (D,),
      shared across heads.
    * "layer": ``(x − mean) / std · w`` with gains of shape (D,), no bias (as in ViT-22B).
    """

    def __init__(self, config: QKNormConfig | str, head_dim: int) -> None:
        super().__init__()
        if isinstance(config, str):
            config = QKNormConfig(config)
        self.config = config
        self.head_dim = head_dim
        if config.kind == "l2":
            g0 = config.g_init if config.g_init is not None else default_l2_scale(config.train_len)
            self.g = nn.Parameter(torch.tensor(float(g0)))
        else:
            self.q_weight = nn.Parameter(torch.ones(head_dim))
            self.k_weight = nn.Parameter(torch.ones(head_dim))

    @property
    def attention_scale(self) -> float | None:
        """The ``scale`` to pass to :func:`attn.attention` after this norm (None = D^-0.5)."""
        return 1.0 if self.config.kind == "l2" else None

    def _norm(self, x: Tensor, weight: Tensor | None) -> Tensor:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        y = x.to(acc)
        eps = self.config.eps
        if self.config.kind == "l2":
            y = y * torch.rsqrt(y.pow(2).sum(-1, keepdim=True) + eps)
        elif self.config.kind == "rms":
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc)
        else:
            y = F.layer_norm(y, (y.shape[-1],), weight.to(acc), None, eps)
        return y

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        if self.config.kind == "l2":
            acc = torch.float64 if q.dtype == torch.float64 else torch.float32
            qn = self._norm(q, None) * self.g.to(acc)
            kn = self._norm(k, None)
        else:
            qn = self._norm(q, self.q_weight)
            kn = self._norm(k, self.k_weight)
        return qn.to(q.dtype), kn.to(k.dtype)

    def extra_repr(self) -> str:
        c = self.config
        return f"kind={c.kind!r}, position={c.position!r}, head_dim={self.head_dim}"


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al. 2021, "RoFormer"), rotate-half layout (GPT-NeoX / Llama).

    Rotates channel pairs ``(i, i + D/2)`` of q or k by ``pos · base^(−2i/D)``; positions
    start at ``offset`` so a decoding step continues where the KV cache ends.
    """

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.head_dim, self.base = head_dim, base

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """x (B, H, N, D) → x rotated, same shape and dtype (angles in float32 or float64)."""
        N = x.shape[2]
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        # angles in float64, then cast: position · frequency loses digits in fp32 at large N.
        # Not a buffer: Module.to(dtype) would round a float64 buffer to the model's dtype.
        f64 = dict(device=x.device, dtype=torch.float64)
        inv_freq = self.base ** (-torch.arange(0, self.head_dim, 2, **f64) / self.head_dim)
        pos = torch.arange(offset, offset + N, **f64)
        ang = (pos[:, None] * inv_freq[None, :]).to(acc)  # (N, D/2)
        cos, sin = ang.cos(), ang.sin()
        y = x.to(acc)
        y1, y2 = y.chunk(2, dim=-1)  # (B, H, N, D/2) each
        out = torch.cat((y1 * cos - y2 * sin, y2 * cos + y1 * sin), dim=-1)
        return out.to(x.dtype)


class KVCacheLike(Protocol):
    """What :class:`MultiHeadAttention` needs from a KV cache (``models.KVCache`` is one)."""

    @property
    def length(self) -> int: ...  # keys cached so far = position of the next query

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...  # → all keys, values


def _as_window(window: int | tuple[int, int] | None, causal: bool) -> tuple[int, int] | None:
    if window is None:
        return None
    if isinstance(window, bool):
        raise TypeError(f"window must be an int or a pair of ints, got {window!r}")
    if isinstance(window, int):
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        # w keys back (and, without causal, w ahead): the query itself plus w neighbours a side
        return (window, 0 if causal else window)
    if (isinstance(window, (tuple, list)) and len(window) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)):
        return (int(window[0]), int(window[1]))
    raise ValueError(f"window must be an int or a pair (left, right) of ints >= -1, "
                     f"got {window!r}")


class MultiHeadAttention(nn.Module):
    """Self-attention over ``x (B, N, C)`` → ``(B, N, C)`` through :func:`attn.attention`.

    Args:
        dim: model width C; ``heads`` must divide it (head_dim D = C / heads).
        heads: query heads H. ``kv_heads``: key/value heads Hkv (GQA, Ainslie et al. 2023;
            MQA when 1); must divide ``heads``; default ``heads``.
        qk_norm: None, a kind ("l2", "rms", "layer") or a :class:`QKNormConfig`.
        temperature: divides the scores. With ``learn_temperature`` it is the initial value of
            a per-head τ (H,) kept positive as ``exp(log τ)``.
        softcap: ``c·tanh(s/c)`` on the scores (Gemma 2), or None.
        window: sliding window: an int w (w keys back; also w ahead when not causal), or
            ``(left, right)`` as in :func:`attn.attention` (-1 = unbounded).
        sinks: a learnable per-head sink logit (H,) joining the softmax denominator
            (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks").
        rope: rotate q and k (RoPE). causal: bottom-right causal mask.
        dropout: attention-probability dropout, active only in training mode.
        backend: passed to :func:`attn.attention`. bias: biases on the projections.

    ``forward(x, kv_cache)``: with a cache (see :class:`KVCacheLike`) the new keys/values are
    appended and the new queries, at positions ``cache.length …``, attend to everything
    cached; bottom-right causal alignment makes that exact.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        kv_heads: int | None = None,
        qk_norm: QKNormConfig | str | None = None,
        temperature: float = 1.0,
        learn_temperature: bool = False,
        softcap: float | None = None,
        window: int | tuple[int, int] | None = None,
        sinks: bool = False,
        rope: bool = True,
        causal: bool = True,
        dropout: float = 0.0,
        backend: str = "auto",
        bias: bool = False,
    ) -> None:
        super().__init__()
        kv_heads = heads if kv_heads is None else kv_heads
        if heads <= 0 or dim % heads != 0:
            raise ValueError(f"heads must divide dim, got dim={dim}, heads={heads}")
        if kv_heads <= 0 or heads % kv_heads != 0:
            raise ValueError(f"kv_heads must divide heads, got heads={heads}, "
                             f"kv_heads={kv_heads}")
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
                and temperature > 0):
            raise ValueError(f"temperature must be a positive float, got {temperature!r}")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be positive or None, got {softcap!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.dim, self.heads, self.kv_heads = dim, heads, kv_heads
        self.head_dim = D = dim // heads
        self.causal, self.dropout, self.backend = causal, dropout, backend
        self.softcap = None if softcap is None else float(softcap)
        self.window = _as_window(window, causal)

        # one matmul for q, k and v: (B, N, C) → (B, N, (H + 2·Hkv)·D)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * D, bias=bias)
        self.proj = nn.Linear(heads * D, dim, bias=bias)
        self.qk_norm = None if qk_norm is None else QKNorm(qk_norm, D)
        self.rope = RotaryEmbedding(D) if rope else None
        self.scale = None if self.qk_norm is None else self.qk_norm.attention_scale
        if learn_temperature:
            self.log_tau = nn.Parameter(torch.full((heads,), math.log(temperature)))
            self.temperature = None
        else:
            self.log_tau = None
            self.temperature = float(temperature)
        self.sinks = nn.Parameter(torch.zeros(heads)) if sinks else None

    def _tau(self) -> float | Tensor:
        return self.temperature if self.log_tau is None else self.log_tau.exp()  # (H,)

    def forward(self, x: Tensor, kv_cache: KVCacheLike | None = None) -> Tensor:
        B, N, C = x.shape
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        offset = 0
        if kv_cache is not None:
            if not self.causal:
                raise ValueError("a KV cache needs causal attention: without it earlier "
                                 "queries would have to see later keys")
            offset = kv_cache.length
        qkv = self.qkv(x).view(B, N, H + 2 * Hkv, D).transpose(1, 2)  # (B, H + 2Hkv, N, D)
        q, k, v = qkv.split((H, Hkv, Hkv), dim=1)  # (B, H, N, D), (B, Hkv, N, D) × 2

        norm_first = self.qk_norm is not None and self.qk_norm.config.position == "before"
        if norm_first:
            q, k = self.qk_norm(q, k)
        if self.rope is not None:
            q, k = self.rope(q, offset), self.rope(k, offset)
        if self.qk_norm is not None and not norm_first:
            q, k = self.qk_norm(q, k)

        if kv_cache is not None:
            k, v = kv_cache.append(k, v)  # (B, Hkv, offset + N, D)
        y = attention(
            q, k, v, causal=self.causal, scale=self.scale, temperature=self._tau(),
            softcap=self.softcap, window=self.window, sinks=self.sinks,
            dropout_p=self.dropout if self.training else 0.0, backend=self.backend)
        y = y.transpose(1, 2).reshape(B, N, H * D)  # (B, H, N, D) → (B, N, H·D)
        return self.proj(y)

    def extra_repr(self) -> str:
        parts = [f"dim={self.dim}", f"heads={self.heads}", f"kv_heads={self.kv_heads}",
                 f"causal={self.causal}", f"backend={self.backend!r}"]
        if self.log_tau is not None:
            parts.append("temperature=learned")
        elif self.temperature != 1.0:
            parts.append(f"temperature={self.temperature}")
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap}")
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.sinks is not None:
            parts.append("sinks=True")
        return ", ".join(parts)
