"""A small GPT built from :class:`attn.nn.MultiHeadAttention`: pre-norm blocks, GELU MLP, tied
embeddings, KV-cached sampling, atomic checkpoints. No attention math lives here."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attn.nn import MultiHeadAttention
from attn.models.cache import KVCache
from attn.models.config import GPTConfig


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: int, bias: bool, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, ratio * dim, bias=bias)
        self.proj = nn.Linear(ratio * dim, dim, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: GPTConfig, layer: int) -> None:
        super().__init__()
        a = cfg.attention
        local = a.window_layers is None or layer in a.window_layers
        self.norm1 = nn.LayerNorm(cfg.dim, bias=cfg.bias)
        train_len = cfg.block_size if a.qk_norm_train_len is None else a.qk_norm_train_len
        self.attn = MultiHeadAttention(cfg.dim, options=a, window=a.window if local else None,
                                       qk_norm_train_len=train_len)
        self.drop = nn.Dropout(cfg.dropout)
        self.norm2 = nn.LayerNorm(cfg.dim, bias=cfg.bias)
        self.mlp = MLP(cfg.dim, cfg.mlp_ratio, cfg.bias, cfg.dropout)

    def forward(self, x: Tensor, kv_cache: KVCache | None = None,
                cu_seqlens: Tensor | None = None) -> Tensor:
        x = x + self.drop(self.attn(self.norm1(x), kv_cache, cu_seqlens=cu_seqlens))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        # RoPE carries position inside attention; without it, learned absolute positions
        self.pos_emb = None if cfg.attention.rope else nn.Embedding(cfg.block_size, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.dim, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied (Press & Wolf 2017)
        self.context_parallel = None  # see attn.distributed.ContextParallel.apply_to
        self.apply(self._init)
        # residual branches scaled down with depth so the stream's variance stays O(1) (GPT-2)
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def new_caches(self, batch: int, max_len: int) -> list[KVCache]:
        """One empty :class:`KVCache` per layer, in the model's dtype and device."""
        a = self.blocks[0].attn
        p = self.tok_emb.weight
        return [KVCache(batch, a.kv_heads, max_len, a.head_dim, p.dtype, p.device)
                for _ in self.blocks]

    def forward(self, idx: Tensor, targets: Tensor | None = None,
                caches: list[KVCache] | None = None, doc_ids: Tensor | None = None
                ) -> tuple[Tensor, Tensor | None]:
        """idx (B, T) token ids → logits (B, T, V), and the mean cross-entropy over targets
        (B, T) that are not -100 when targets are given. With ``caches`` the tokens continue
        the cached sequence. ``doc_ids`` (B, T), non-decreasing over the flattened batch:
        packed documents, each attending only to itself (attn.varlen_attention)."""
        B, T = idx.shape
        cu_seqlens = None
        if doc_ids is not None:
            from attn.varlen import cu_seqlens_from_document_ids
            flat = doc_ids.flatten()
            cu_seqlens = cu_seqlens_from_document_ids(flat - flat[0])
        x = self.tok_emb(idx)  # (B, T, C)
        if self.pos_emb is not None:
            start = 0 if caches is None else caches[0].length
            if start + T > self.cfg.block_size:
                raise ValueError(f"positions up to {start + T} exceed block_size "
                                 f"{self.cfg.block_size} (learned position embeddings)")
            if self.context_parallel is not None:  # this rank's shard: its global positions
                x = x + self.pos_emb(self.context_parallel.positions(idx.device))
            else:
                x = x + self.pos_emb(torch.arange(start, start + T, device=idx.device))
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i], cu_seqlens)
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                   ignore_index=-100)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> Tensor:
        """Sample ``max_new_tokens`` after the prompt idx (B, T) → (B, T + max_new_tokens).

        The prompt runs once through the model filling the KV caches; then each step feeds
        only the newest token. ``temperature == 0`` is greedy; ``top_k`` keeps the k most
        likely tokens before sampling."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        B, T = idx.shape
        caches = self.new_caches(B, T + max_new_tokens)
        logits, _ = self(idx, caches=caches)
        out = [idx]
        for step in range(max_new_tokens):
            nxt = sample_next(logits[:, -1], temperature, top_k, generator)  # (B, 1)
            out.append(nxt)
            if step + 1 < max_new_tokens:
                logits, _ = self(nxt, caches=caches)
        return torch.cat(out, dim=1)


def sample_next(logits: Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator | None) -> Tensor:
    """logits (B, V) → token ids (B, 1)."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)


# -- checkpoints -------------------------------------------------------------------------------

def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` to a temporary file beside ``path``, then rename it into place: a crash
    mid-write leaves the previous checkpoint intact (rename is atomic on POSIX)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The dict :func:`save_checkpoint` wrote; ``weights_only=True`` so no code is unpickled."""
    return torch.load(path, map_location=map_location, weights_only=True)


def model_from_checkpoint(path: str | Path, map_location: str | torch.device = "cpu"
                          ) -> tuple[GPT, dict[str, Any]]:
    state = load_checkpoint(path, map_location)
    model = GPT(GPTConfig.from_dict(state["model_config"]))
    model.load_state_dict(state["model"])
    return model, state
