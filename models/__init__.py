"""Toy GPT built from :mod:`attn.nn` modules: config, model, KV cache, data, training."""

from models.cache import KVCache
from models.config import AttentionConfig, GPTConfig
from models.gpt import GPT, load_checkpoint, model_from_checkpoint, save_checkpoint

__all__ = ["AttentionConfig", "GPT", "GPTConfig", "KVCache", "load_checkpoint",
           "model_from_checkpoint", "save_checkpoint"]
