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
from attn.varlen import cu_seqlens_from_lengths, position_ids
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
        """idx (B, T) token ids in [0, vocab_size) → logits (B, T, V), and the mean
        cross-entropy over targets (B, T) that are not -100 when targets are given. With
        ``caches`` the tokens continue the cached sequence.

        ``doc_ids`` (B, T) integer, non-decreasing over the flattened batch: packed documents,
        the rows laid end to end, each document attending only to itself
        (attn.varlen_attention) and counting its positions from its own start, so every
        document gets the logits it gets alone, also one that runs on from the end of a row
        into the next (its tokens there still see its earlier ones)."""
        self._check_idx(idx)
        B, T = idx.shape
        cu_seqlens = None
        if doc_ids is not None:
            if caches is not None:
                raise ValueError("doc_ids (packed documents) and caches do not mix")
            cu_seqlens = _doc_offsets(doc_ids, idx)
        x = self.tok_emb(idx)  # (B, T, C)
        if self.pos_emb is not None:
            start = 0 if caches is None else caches[0].length
            if cu_seqlens is not None:  # from each document's start, across rows too
                pos = position_ids(cu_seqlens, B * T).view(B, T)
                longest = int(cu_seqlens.diff().max())
                if longest > self.cfg.block_size:
                    raise ValueError(f"doc_ids hold a document of {longest} tokens, more than "
                                     f"block_size {self.cfg.block_size} (learned position "
                                     f"embeddings)")
                x = x + self.pos_emb(pos)
            elif start + T > self.cfg.block_size:
                raise ValueError(f"positions up to {start + T} exceed block_size "
                                 f"{self.cfg.block_size} (learned position embeddings)")
            elif self.context_parallel is not None:  # this rank's shard: its global positions
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

    def _check_idx(self, idx: object) -> None:
        if not isinstance(idx, Tensor):
            raise TypeError(f"idx must be a torch.Tensor of token ids, got {type(idx).__name__}")
        if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
            raise TypeError(f"idx must hold integer token ids, got {idx.dtype} of shape "
                            f"{tuple(idx.shape)}")
        if idx.dim() != 2:
            raise ValueError(f"idx must be (B, T), got shape {tuple(idx.shape)}")
        if idx.numel() and not torch.compiler.is_compiling():
            # the embedding would read out of bounds (a device-side assert on CUDA)
            lo, hi = int(idx.min()), int(idx.max())
            V = self.cfg.vocab_size
            if lo < 0 or hi >= V:
                raise ValueError(f"idx must hold token ids in [0, {V}), got ids from {lo} to "
                                 f"{hi} in idx of shape {tuple(idx.shape)}")

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> Tensor:
        """Sample ``max_new_tokens`` after the prompt idx (B, T) → (B, T + max_new_tokens).

        The prompt runs once through the model filling the KV caches; then each step feeds
        only the newest token. ``temperature == 0`` is greedy; ``top_k`` keeps the k most
        likely tokens before sampling."""
        _check_sampling(temperature, top_k)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self._check_idx(idx)
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


def _doc_offsets(doc_ids: object, idx: Tensor) -> Tensor:
    """cu_seqlens of the packed documents that ``doc_ids`` (B, T) mark over the rows laid end
    to end (a document may run on into the next row)."""
    if not isinstance(doc_ids, Tensor):
        raise TypeError(f"doc_ids must be a torch.Tensor, got {type(doc_ids).__name__}")
    if doc_ids.is_floating_point() or doc_ids.is_complex() or doc_ids.dtype == torch.bool:
        raise TypeError(f"doc_ids must hold integer ids, got {doc_ids.dtype}")
    if doc_ids.shape != idx.shape:
        raise ValueError(f"doc_ids must have idx's shape (B, T), got doc_ids of shape "
                         f"{tuple(doc_ids.shape)} for idx of shape {tuple(idx.shape)}")
    if doc_ids.device != idx.device:
        raise ValueError(f"doc_ids is on {doc_ids.device}, idx on {idx.device}")
    flat = doc_ids.flatten().to(torch.int64)
    if bool((flat.diff() < 0).any()):
        raise ValueError("doc_ids must be non-decreasing over the flattened batch (rows laid "
                         "end to end)")
    # a document starts wherever the id changes; ids that are skipped own no token
    starts = torch.nonzero(flat.diff() != 0).flatten() + 1
    edges = torch.cat([flat.new_zeros(1), starts, flat.new_full((1,), flat.numel())])
    return cu_seqlens_from_lengths(edges.diff())


def _check_sampling(temperature: float, top_k: int | None) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise TypeError(f"top_k must be an int or None, got {type(top_k).__name__}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1 (or None for no cut), got {top_k}")


def sample_next(logits: Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator | None) -> Tensor:
    """logits (B, V) → token ids (B, 1)."""
    _check_sampling(temperature, top_k)
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
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
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
    state = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(state, dict):
        raise TypeError(f"checkpoint {str(path)!r} must hold a dict (as save_checkpoint "
                        f"writes), got {type(state).__name__}")
    return state


def model_from_checkpoint(path: str | Path, map_location: str | torch.device = "cpu"
                          ) -> tuple[GPT, dict[str, Any]]:
    state = load_checkpoint(path, map_location)
    missing = [k for k in ("model", "model_config") if k not in state]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} has no {' or '.join(missing)} entry: not a "
                         f"model checkpoint (keys: {sorted(map(str, state))})")
    model = GPT(GPTConfig.from_dict(state["model_config"]))
    model.load_state_dict(state["model"])
    return model, state
