"""attn: exact, memory-linear scaled-dot-product attention for PyTorch."""

from attn.api import (
    AttentionCall,
    BackendChoice,
    attention,
    scaled_dot_product_attention,
    select_backend,
)
from attn.flex import create_block_mask, flex_attention
from attn.merge import merge_attention
from attn.varlen import varlen_attention
from attn.nn import AttentionOptions, MultiHeadAttention, QKNorm, QKNormConfig, RotaryEmbedding
from attn.patch import SdpaPatch, patch_sdpa

__all__ = [
    "AttentionCall",
    "AttentionOptions",
    "BackendChoice",
    "MultiHeadAttention",
    "QKNorm",
    "QKNormConfig",
    "RotaryEmbedding",
    "SdpaPatch",
    "attention",
    "create_block_mask",
    "flex_attention",
    "merge_attention",
    "patch_sdpa",
    "scaled_dot_product_attention",
    "select_backend",
    "varlen_attention",
]
__version__ = "0.1.0"
