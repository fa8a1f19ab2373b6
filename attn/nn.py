"""Modules that hold attention's parameters and call :func:`attn.attention`: :class:`QKNorm`,
:class:`RotaryEmbedding`, :class:`AttentionOptions` (every option of the module, declared
once: the GPT's config and the training command line derive from it) and
:class:`MultiHeadAttention`. Layout ``(B, H, N, D)`` inside; activations entering and
leaving :class:`MultiHeadAttention` are ``(B, N, C)``. Defaults and usage: docs/modules.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from attn.api import BACKENDS, attention
from attn.call import _check_tensor
from attn.decoding import decode
from attn.masks import module_window
from attn.spec import acc_dtype
from attn.varlen import check_cu_form, check_cu_values, position_ids, varlen_attention

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
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)):
            raise TypeError(f"qk_norm eps must be a float, got {type(self.eps).__name__}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"qk_norm eps must be positive and finite, got {self.eps}")


class QKNorm(nn.Module):
    """Normalise q (B, H, Nq, D) and k (B, Hkv, Nk, D) over D, in float32 (float64 stays).

    * "l2" (Henry et al. 2020): ``q̂ = q/‖q‖``, ``k̂ = k/‖k‖``, and the learnable scalar ``g``
      multiplied into q̂, so the caller must attend with ``scale=1.0`` (see
      :attr:`attention_scale`): the score is then ``g · cos(q, k)``, with g's exact gradient.
    * "rms" (Qwen3, Gemma 3): ``x / rms(x) · w`` with separate gains ``q_weight``,
      ``k_weight`` of shape (D,), shared across heads.
    * "layer": ``(x − mean) / std · w`` with gains of shape (D,), no bias (as in ViT-22B,
      Dehghani et al. 2023).
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
        acc = acc_dtype(x.dtype)
        y = x.to(acc)
        eps = self.config.eps
        if self.config.kind == "l2":
            return y * torch.rsqrt(y.pow(2).sum(-1, keepdim=True) + eps)
        if self.config.kind == "rms":
            return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc)
        return F.layer_norm(y, (y.shape[-1],), weight.to(acc), None, eps)

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        for name, t in (("q", q), ("k", k)):
            _check_tensor(name, t)
            if t.dim() == 0 or t.shape[-1] != self.head_dim:
                raise ValueError(f"QKNorm(head_dim {self.head_dim}) normalises over the last "
                                 f"dim, got {name} of shape {tuple(t.shape)}")
        if self.config.kind == "l2":  # no gains: g multiplies q̂ alone
            qn, kn = self._norm(q, None) * self.g.to(acc_dtype(q.dtype)), self._norm(k, None)
        else:
            qn, kn = self._norm(q, self.q_weight), self._norm(k, self.k_weight)
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

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """x (B, H, N, D) → x rotated, same shape and dtype (rotation in float32 or float64).
        ``offset``: the position of the first token, or every token's position: (N,) for all
        rows (a context-parallel shard holds positions that are not contiguous) or (B, N)
        per row (packed documents, each counted from its own start)."""
        _check_tensor("x", x)
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(f"RotaryEmbedding(head_dim {self.head_dim}) rotates x (B, H, N, "
                             f"{self.head_dim}), got x of shape {tuple(x.shape)}")
        B, _, N, _ = x.shape
        acc = acc_dtype(x.dtype)
        # Not a buffer: Module.to(dtype) would round a float64 buffer to the model's dtype.
        f64 = dict(device=x.device, dtype=torch.float64)
        inv_freq = self.base ** (-torch.arange(0, self.head_dim, 2, **f64) / self.head_dim)
        if isinstance(offset, Tensor):
            if tuple(offset.shape) not in ((N,), (B, N)):
                raise ValueError(f"offset must be an int or positions of shape ({N},) or "
                                 f"({B}, {N}) for x of shape {tuple(x.shape)}, got offset of "
                                 f"shape {tuple(offset.shape)}")
            pos = offset.to(**f64)
        else:
            pos = torch.arange(offset, offset + N, **f64)
        ang = pos[..., None] * inv_freq  # (N, D/2) or (B, N, D/2)
        if ang.dim() == 3:
            ang = ang[:, None]  # (B, 1, N, D/2): every head of a row alike
        # The angle and its cos/sin in float64, cast only then: an angle rounded to fp32 is off
        # by up to pos·eps radians (3e-2 at position 1M), whereas cos/sin rounded to fp32 are
        # off by eps/2 at any position.
        cos, sin = ang.cos().to(acc), ang.sin().to(acc)
        y1, y2 = x.to(acc).chunk(2, dim=-1)  # (B, H, N, D/2) each
        return torch.cat((y1 * cos - y2 * sin, y2 * cos + y1 * sin), dim=-1).to(x.dtype)


class KVCacheLike(Protocol):
    """What :class:`MultiHeadAttention` needs from a KV cache (``attn.models.KVCache`` is one).
    One that also has ``paged() -> attn.kvcache.PagedKVCache`` (the same keys, no copy) is
    read by :func:`attn.decode` where the call allows it (``MultiHeadAttention._decode``)."""

    @property
    def length(self) -> int: ...  # keys cached so far = position of the next query

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...  # → all keys, values


def _parse_window(s: str) -> int | tuple[int, int]:
    """Command-line spelling of a window: ``W`` or ``LEFT,RIGHT``."""
    parts = [int(p) for p in s.split(",")]
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return (parts[0], parts[1])
    raise ValueError(f"window must be W or LEFT,RIGHT, got {s!r}")


def opt_field(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field carrying its own help text; ``choices`` and ``parse`` (str → value)
    may join it. Command lines derive their flags from these (``attn.models.config.add_flags``)."""
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class AttentionOptions:
    """Every option of :class:`MultiHeadAttention` except its width ``dim``, declared once.

    ``MultiHeadAttention(dim, heads, **kw)`` takes these fields as keywords;
    ``attn.models.config.AttentionConfig`` extends them for the GPT, and ``scripts/train.py``
    derives its flags from them. Plain values only, so a checkpoint stores them as a dict.
    ``qk_norm`` may also be given as a :class:`QKNormConfig`; it is unpacked into the
    ``qk_norm_*`` fields.
    """

    heads: int = opt_field(4, "query heads H; must divide dim (head_dim = dim / H)")
    kv_heads: int | None = opt_field(
        None, "key/value heads Hkv (GQA, Ainslie et al. 2023; MQA when 1); must divide "
        "heads; none = heads")
    qk_norm: str | None = opt_field(
        None, "normalise q and k per head: l2 (cosine, learnable g), rms or layer; none = off",
        choices=QK_NORM_KINDS)
    qk_norm_position: str = opt_field("before", "QK-norm relative to RoPE",
                                      choices=QK_NORM_POSITIONS)
    qk_norm_g_init: float | None = opt_field(
        None, "l2 only: initial g; none = log2(L² - L), L = qk_norm_train_len")
    qk_norm_train_len: int | None = opt_field(
        None, "l2 only: the training length L behind the default g; none = 1024 "
        "(the GPT uses its block_size)")
    qk_norm_eps: float = opt_field(1e-6, "epsilon of the QK-norm")
    temperature: float = opt_field(
        1.0, "divides the scores; with learn_temperature, every head's initial value")
    learn_temperature: bool = opt_field(
        False, "learn a per-head temperature, kept positive as exp(log tau)")
    softcap: float | None = opt_field(None, "c*tanh(s/c) on the scores (Gemma 2); none = off")
    learn_softcap: bool = opt_field(
        False, "learn a per-head cap starting at softcap, kept positive as exp(log c)")
    window: int | tuple[int, int] | None = opt_field(
        None, "sliding window: W means (W, 0) when causal, (W, W) when not; or LEFT,RIGHT "
        "(-1 = unbounded); none = off", parse=_parse_window)
    sinks: bool = opt_field(
        False, "a learnable per-head sink logit joining the softmax denominator "
        "(Xiao et al. 2023)")
    rope: bool = opt_field(True, "rotary position embedding on q and k (Su et al. 2021)")
    # off by default, as in torch's module: an encoder must not be silently causal (docs/modules.md)
    causal: bool = opt_field(False, "bottom-right causal mask (a decoder's); off = every "
                             "query sees every key, as in torch.nn.MultiheadAttention")
    dropout: float = opt_field(0.0, "attention-probability dropout, in training mode only")
    backend: str = opt_field("auto", "the attn.attention backend", choices=BACKENDS)
    bias: bool = opt_field(False, "biases on the qkv and output projections")

    def __post_init__(self) -> None:
        if isinstance(self.qk_norm, QKNormConfig):
            self._unpack_qk_norm(self.qk_norm)
        if isinstance(self.heads, bool) or not isinstance(self.heads, int) or self.heads <= 0:
            raise ValueError(f"heads must be a positive int, got {self.heads!r}")
        kv = self.heads if self.kv_heads is None else self.kv_heads
        if kv <= 0 or self.heads % kv != 0:
            raise ValueError(f"kv_heads must divide heads, got heads={self.heads}, "
                             f"kv_heads={self.kv_heads}")
        self.qk_norm_config()  # QKNormConfig validates kind, position and g_init
        t = self.temperature
        if isinstance(t, bool) or not (isinstance(t, (int, float)) and math.isfinite(t)
                                       and t > 0):
            raise ValueError(f"temperature must be a positive float, got {t!r}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be positive or None, got {self.softcap!r}")
        if self.learn_softcap and self.softcap is None:
            raise ValueError("learn_softcap needs softcap, the cap's initial value")
        module_window(self.window, causal=self.causal)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")

    def _unpack_qk_norm(self, c: QKNormConfig) -> None:
        unpacked = dict(qk_norm_position=c.position, qk_norm_g_init=c.g_init,
                        qk_norm_train_len=c.train_len, qk_norm_eps=c.eps)
        defaults = {f.name: f.default for f in fields(AttentionOptions)}
        clash = [k for k in unpacked if getattr(self, k) != defaults[k]]
        if clash:
            raise TypeError(f"qk_norm is a QKNormConfig, which already sets {', '.join(clash)}:"
                            f" give qk_norm=<kind> with qk_norm_* fields, or the config alone")
        self.qk_norm = c.kind
        for k, v in unpacked.items():
            setattr(self, k, v)

    @property
    def window_pair(self) -> tuple[int, int] | None:
        """``window`` as the ``(left, right)`` pair :func:`attn.attention` takes."""
        return module_window(self.window, causal=self.causal)

    def qk_norm_config(self) -> QKNormConfig | None:
        if self.qk_norm is None:
            return None
        train_len = 1024 if self.qk_norm_train_len is None else self.qk_norm_train_len
        return QKNormConfig(self.qk_norm, self.qk_norm_position, self.qk_norm_g_init,
                            train_len=train_len, eps=self.qk_norm_eps)


class MultiHeadAttention(nn.Module):
    """Self-attention over ``x (B, N, C)`` → ``(B, N, C)`` (unbatched ``(N, C)`` → ``(N, C)``)
    through :func:`attn.attention`. ``dim`` is the width C; ``heads`` (H, default 4) must
    divide it; every other argument is an :class:`AttentionOptions` field, as keywords or as
    ``options=AttentionOptions(...)`` (keywords override it). ``forward(x, kv_cache)`` appends
    to a :class:`KVCacheLike` cache, and the new queries (positions ``cache.length …``) attend
    to all of it, exactly since causal is bottom-right. Defaults where torch's module
    differs (``causal=False``, ``rope=True``) and decoding: docs/modules.md.
    """

    def __init__(self, dim: int, heads: int | None = None, *,
                 options: AttentionOptions | None = None, **kw: Any) -> None:
        super().__init__()
        if heads is not None:
            kw["heads"] = heads
        o = AttentionOptions(**kw) if options is None else replace(options, **kw)
        if o.heads <= 0 or dim % o.heads != 0:
            raise ValueError(f"heads must divide dim, got dim={dim}, heads={o.heads}")
        self.options = o
        self.dim, self.heads = dim, o.heads
        self.kv_heads = o.heads if o.kv_heads is None else o.kv_heads
        self.head_dim = D = dim // o.heads
        self.causal, self.dropout, self.backend = o.causal, o.dropout, o.backend
        self.window = o.window_pair

        # one matmul for q, k and v: (B, N, C) → (B, N, (H + 2·Hkv)·D)
        self.qkv = nn.Linear(dim, (self.heads + 2 * self.kv_heads) * D, bias=o.bias)
        self.proj = nn.Linear(self.heads * D, dim, bias=o.bias)
        qk_cfg = o.qk_norm_config()
        self.qk_norm = None if qk_cfg is None else QKNorm(qk_cfg, D)
        self.rope = RotaryEmbedding(D) if o.rope else None
        self.scale = None if self.qk_norm is None else self.qk_norm.attention_scale
        self.log_tau, self.temperature = self._learnable(o.learn_temperature, o.temperature)
        self.log_softcap, self.softcap = self._learnable(o.learn_softcap, o.softcap)
        self.sinks = nn.Parameter(torch.zeros(self.heads)) if o.sinks else None
        # set by attn.distributed.ContextParallel.apply_to: x is then this rank's shard of
        # the sequence, RoPE reads its global positions and attention runs across the group
        self.context_parallel = None

    def _learnable(self, learn: bool, value: float | None
                   ) -> tuple[nn.Parameter | None, float | None]:
        """A learned per-head value as ``(log parameter (H,), None)`` (kept positive as its
        exp), else ``(None, the float)``."""
        if learn:
            return nn.Parameter(torch.full((self.heads,), math.log(value))), None
        return None, None if value is None else float(value)

    def _check_x(self, x: object) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor (B, N, C) or (N, C), got "
                            f"{type(x).__name__}")
        if x.dim() not in (2, 3) or x.shape[-1] != self.dim:
            raise ValueError(f"x must be (B, N, C) or unbatched (N, C) with C = dim = "
                             f"{self.dim}, got x of shape {tuple(x.shape)}")
        w = self.qkv.weight
        if not x.is_floating_point():
            raise TypeError(f"x must be floating point, got {x.dtype} of shape "
                            f"{tuple(x.shape)}")
        # under autocast the projections cast x themselves: any float dtype is fine then
        if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"x is {x.dtype} but the module's parameters are {w.dtype}: "
                            f"cast one to the other")
        if x.device != w.device:
            raise ValueError(f"x is on {x.device} but the module's parameters are on "
                             f"{w.device}")

    def forward(self, x: Tensor, kv_cache: KVCacheLike | None = None, *,
                cu_seqlens: Tensor | None = None) -> Tensor:
        """x (B, N, C) → (B, N, C), or unbatched (N, C) → (N, C). ``cu_seqlens`` (S + 1,)
        int: the B·N tokens, rows laid end to end, hold S packed documents that never see one
        another (:func:`attn.varlen_attention`; causal and window per document), each as if
        it ran alone: RoPE counts positions from each document's start, also for a document
        that runs on from one row into the next."""
        self._check_x(x)
        if x.dim() == 2:
            return self.forward(x[None], kv_cache, cu_seqlens=cu_seqlens)[0]
        B, N, C = x.shape
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        offset: int | Tensor = 0
        cp = self.context_parallel
        if cp is not None:
            if kv_cache is not None:
                raise ValueError("a KV cache and context parallelism do not combine")
            offset = cp.positions(x.device)  # (N,) global positions of this shard
        if kv_cache is not None:
            if not self.causal:
                raise ValueError("a KV cache needs causal attention (build the module with "
                                 "causal=True): without it earlier queries would have to see "
                                 "later keys")
            offset = kv_cache.length
        if cu_seqlens is not None:
            if kv_cache is not None:
                raise ValueError("cu_seqlens (packed documents) and a KV cache do not mix")
            if cp is not None:
                raise ValueError("cu_seqlens (packed documents) and context parallelism do "
                                 "not combine")
            # attn's one rule for packed offsets (attn.varlen), ending at B·N, the rows of x
            check_cu_form("cu_seqlens", cu_seqlens, x.device, "x")
            if not torch.compiler.is_compiling():  # reading the values would break the trace;
                check_cu_values("cu_seqlens", cu_seqlens, B * N, "B·N")  # varlen checks them
            offset = position_ids(cu_seqlens, B * N).view(B, N)  # from each document's start
        if B * N == 0:
            # nothing to attend over (attention refuses empty input): an empty result of the
            # output's shape, still connected to the projections
            return self.proj(self.qkv(x)[..., :H * D])
        qkv = rearrange(self.qkv(x), "b n (h d) -> b h n d", d=D)  # (B, H + 2Hkv, N, D)
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
        tau = self.temperature if self.log_tau is None else self.log_tau.exp()  # (H,) if learned
        cap = self.softcap if self.log_softcap is None else self.log_softcap.exp()
        opts = dict(causal=self.causal, scale=self.scale, temperature=tau, softcap=cap,
                    window=self.window, sinks=self.sinks,
                    dropout_p=self.dropout if self.training else 0.0, backend=self.backend)
        if cu_seqlens is not None:  # (no cache then)
            # (B, H, N, D) -> packed (B·N, H, D): rows laid end to end
            qp, kp, vp = (rearrange(t, "b h n d -> (b n) h d") for t in (q, k, v))
            y = varlen_attention(qp, kp, vp, cu_seqlens, cu_seqlens, **opts)
            return self.proj(rearrange(y, "(b n) h d -> b n (h d)", b=B))  # (B, N, H·D)
        y = self._decode(q, kv_cache, opts) if kv_cache is not None else None
        if y is None:
            y = (attention if cp is None else cp.attention)(q, k, v, **opts)
        return self.proj(rearrange(y, "b h n d -> b n (h d)"))  # (B, N, H·D)

    def _decode(self, q: Tensor, kv_cache: KVCacheLike, opts: dict) -> Tensor | None:
        """The new queries against a cache that can be read as pages (``kv_cache.paged()``)
        through :func:`attn.decode`, or None where the call needs what decoding from
        a cache does not take: a gradient, a chosen backend, a tensor scale, temperature or
        softcap (learned ones), dropout."""
        paged = getattr(kv_cache, "paged", None)
        tau, cap = opts["temperature"], opts["softcap"]
        if (paged is None or torch.is_grad_enabled() or opts["backend"] != "auto"
                or opts["dropout_p"] or any(isinstance(x, Tensor) for x in (tau, cap, self.scale))):
            return None
        scale = (self.scale if self.scale is not None else self.head_dim ** -0.5) / tau
        return decode(q, paged(), causal=self.causal, window=self.window, scale=scale,
                      softcap=cap, sinks=self.sinks)

    def extra_repr(self) -> str:
        parts = [f"dim={self.dim}", f"heads={self.heads}", f"kv_heads={self.kv_heads}",
                 f"causal={self.causal}", f"rope={self.rope is not None}",
                 f"backend={self.backend!r}"]
        for name, log, value, off in (("temperature", self.log_tau, self.temperature, 1.0),
                                      ("softcap", self.log_softcap, self.softcap, None)):
            if log is not None or value != off:  # learned, or a fixed value that does something
                parts.append(f"{name}={'learned' if log is not None else value}")
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.sinks is not None:
            parts.append("sinks=True")
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        return ", ".join(parts)
