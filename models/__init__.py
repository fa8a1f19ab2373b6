"""Toy GPT built from :mod:`attn.nn` modules: config, model, KV cache, data, training."""

from attn.models.cache import KVCache
from attn.models.config import AttentionConfig, GPTConfig
from attn.models.gpt import GPT, load_checkpoint, model_from_checkpoint, save_checkpoint

__all__ = ["AttentionConfig", "GPT", "GPTConfig", "KVCache", "load_checkpoint",
           "model_from_checkpoint", "save_checkpoint"]
