"""Typed configs for the toy GPT. Plain dataclasses of primitives, so a checkpoint can store
them as dicts and load them back with ``torch.load(weights_only=True)``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from attn.nn import QK_NORM_KINDS, QKNormConfig


@dataclass
class AttentionConfig:
    """The arguments of :class:`attn.nn.MultiHeadAttention` other than ``dim``."""

    heads: int = 4
    kv_heads: int | None = None  # None = heads (plain multi-head); fewer = GQA / MQA
    qk_norm: str | None = None  # None, "l2", "rms" or "layer"
    qk_norm_position: str = "before"  # relative to RoPE
    qk_norm_g_init: float | None = None  # l2 only; None = log2(L² − L) with L = block_size
    temperature: float = 1.0  # fixed, or the initial value when learned
    learn_temperature: bool = False  # per-head τ, kept positive through log τ
    softcap: float | None = None
    window: int | None = None  # sliding window: keys at most this far back
    # layers that use the window (None = all). Local layers interleaved with global ones as in
    # Gemma 2/3 and gpt-oss; a window of 1 on layer 0 hands each position its predecessor.
    window_layers: list[int] | None = None
    sinks: bool = False
    rope: bool = True  # False = learned absolute position embeddings in the GPT
    dropout: float = 0.0
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.qk_norm is not None and self.qk_norm not in QK_NORM_KINDS:
            raise ValueError(f"qk_norm must be None or one of {QK_NORM_KINDS}, "
                             f"got {self.qk_norm!r}")

    def qk_norm_config(self, train_len: int) -> QKNormConfig | None:
        if self.qk_norm is None:
            return None
        return QKNormConfig(self.qk_norm, self.qk_norm_position, self.qk_norm_g_init,
                            train_len=train_len)


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 128  # training context length
    n_layer: int = 4
    dim: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0  # residual and embedding dropout
    bias: bool = False
    attention: AttentionConfig = field(default_factory=AttentionConfig)

    def __post_init__(self) -> None:
        if isinstance(self.attention, dict):  # coming back from a checkpoint
            self.attention = AttentionConfig(**self.attention)
        a = self.attention
        if self.dim % a.heads != 0:
            raise ValueError(f"attention.heads must divide dim, got dim={self.dim}, "
                             f"heads={a.heads}")
        kv = a.heads if a.kv_heads is None else a.kv_heads
        if kv <= 0 or a.heads % kv != 0:
            raise ValueError(f"attention.kv_heads must divide heads, got heads={a.heads}, "
                             f"kv_heads={a.kv_heads}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        return cls(**d)
