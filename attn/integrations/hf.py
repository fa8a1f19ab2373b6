"""attn as a Hugging Face transformers attention implementation: :func:`register` (once,
before building models) adds an attention function and a mask function under one name, for
``from_pretrained(path, attn_implementation="attn")``. This module only translates HF's
keywords, layouts and mask conventions into attn's calls (``attn.attention``,
``attn.varlen_attention``, ``attn.decode``); the usage, the keyword table, continuous
batching, :class:`AttnQuantizedCache` and the one difference to eager (rows that see no key
are zeros): docs/hf.md.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from dataclasses import dataclass, replace

import torch
from torch import Tensor

try:
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import (
        AttentionMaskInterface,
        prepare_padding_mask,
        sdpa_mask,
    )
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "attn.integrations.hf needs Hugging Face transformers: pip install 'attn[hf]'"
    ) from exc

import attn
from attn.api import BACKENDS
from attn.kvcache import PagedKVCache
from attn.kvquant import KVQuant
from attn.masks import (dense_keep, hf_sliding_window, make_band, module_window,
                        split_band_padding)
from attn.varlen import check_cu_form, check_cu_values

_log = logging.getLogger(__name__)

# HF's own implementations: registering over one would change every model that asks for it.
_RESERVED = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3",
             "flash_attention_4", "paged|eager")

# Keywords HF threads through every attention call that carry no attention semantics
# (bookkeeping for caches, outputs and losses). Anything else unknown earns one warning.
_INERT = frozenset({
    "use_cache", "cache_position", "output_attentions", "output_hidden_states",
    "output_router_logits", "num_items_in_batch", "max_length_q", "max_length_k",
    "past_key_values", "past_key_value", "position_embeddings", "layer_idx", "deterministic",
    # continuous batching: the cache's indices (read by cache.update) and the sampler's inputs
    "read_index", "write_index", "max_seqlen_q", "max_seqlen_k", "logits_indices",
    "logits_processor_args",
})
_registered: set[str] = set()  # names register() gave attn, let through HF's continuous batching
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        _log.warning(message)


# -- masks: HF's conventions -> attn's --------------------------------------------------------

def _as_attn_mask(mask: Tensor) -> Tensor:
    """HF's 4-D mask as attn reads it: bool stays; a float mask whose only non-zero entries are
    "masked" (at or below finfo.min / 2, -inf included) becomes bool; any other float mask
    keeps its finite biases, with -inf where it masks."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise TypeError(f"attention_mask must be bool or floating, got {mask.dtype} of shape "
                        f"{tuple(mask.shape)}")
    # HF fills masked entries with finfo(dtype).min, not -inf; sums of two such masks reach
    # -inf. Anything that low is exp(.) == 0 next to any attended score, i.e. masked.
    blocked = mask <= torch.finfo(mask.dtype).min / 2
    if not bool(mask.masked_fill(blocked, 0).any()):
        return ~blocked
    return mask.masked_fill(blocked, float("-inf"))


@dataclass(frozen=True)
class _Plan:
    """How one layer call runs: the band attn applies and the mask it reads per tile."""

    causal: bool
    window: tuple[int, int] | None
    attn_mask: Tensor | None
    cu_seqlens: tuple[Tensor, Tensor] | None = None  # a packed batch: attn.varlen_attention


class _RecentMasks:
    """The last few masks seen, with what they turned into.

    A model builds its mask once per forward and hands the same tensor to every layer, so the
    O(B * Nq * Nk) conversion and band check run once per forward, not once per layer. Held
    by weak reference and keyed on the tensor's version counter, so a freed or modified mask
    is never served.
    """

    def __init__(self, size: int = 8):
        self.size = size
        self._entries: list[tuple[tuple, weakref.ref, _Plan]] = []

    def get(self, mask: Tensor, key: tuple) -> _Plan | None:
        want = (id(mask), mask._version, *key)
        return next((plan for k, ref, plan in self._entries if k == want and ref() is mask), None)

    def put(self, mask: Tensor, key: tuple, plan: _Plan) -> None:
        self._entries = [e for e in self._entries if e[1]() is not None][-(self.size - 1):]
        self._entries.append(((id(mask), mask._version, *key), weakref.ref(mask), plan))


_recent = _RecentMasks()


def _plan_for_mask(mask: Tensor, n_q: int, n_k: int, causal: bool,
                   window: tuple[int, int] | None) -> _Plan:
    """A 4-D mask from HF: run it as band + key padding when it is one, else as it is."""
    if mask.dim() != 4:
        raise ValueError(f"attention_mask must be 4-D (B, 1 or H, Nq, Nk), got shape "
                         f"{tuple(mask.shape)} for Nq={n_q}, Nk={n_k}")
    cacheable = not mask.requires_grad
    key = (causal, window, n_q, n_k)
    if cacheable and (plan := _recent.get(mask, key)) is not None:
        return plan
    m = _as_attn_mask(mask)
    plan = None
    if m.dtype == torch.bool and m.shape[-1] == n_k and m.shape[-2] in (1, n_q):
        band = make_band(n_q, n_k, causal=causal, window=window)
        padding = split_band_padding(m.expand(*m.shape[:2], n_q, n_k), band)
        if padding is not None:
            plan = _Plan(causal, window, None if bool(padding.all()) else padding)
    if plan is None:
        # Not causal + padding: the mask alone decides, as in HF's eager and SDPA paths. A
        # causal model's sliding window still applies on its left side (HF's own overlay).
        if window is not None and causal:
            window = (window[0], -1)
        plan = _Plan(False, window, m)
    if cacheable:
        _recent.put(mask, key, plan)
    return plan


def _packed_cu_seqlens(position_ids: object, n: int) -> Tensor | None:
    """Sequence boundaries of a padding-free batch (B = 1) whose position_ids restart, else None.

    A new sequence starts wherever the position does not go up by one (HF's own rule)."""
    if not isinstance(position_ids, Tensor) or position_ids.numel() != n or n < 2 or (
            position_ids.dim() == 2 and position_ids.shape[0] != 1):
        return None
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos.diff() != 1).reshape(-1) + 1
    if starts.numel() == 0:
        return None
    zero, end = pos.new_zeros(1, dtype=torch.int64), torch.full((1,), n, device=pos.device)
    return torch.cat([zero, starts.to(torch.int64), end])


def _packed_plan(plan: _Plan, n_q: int, n_k: int, batch: int, cu_seq_lens_q, cu_seq_lens_k,
                 position_ids, device: torch.device) -> _Plan:
    """Padding-free packed batches: attn's packed path (``varlen_attention``) when HF handed
    no mask; with a mask (HF has drawn something within the sequences), each sequence alone on
    its block of that mask (:func:`_per_sequence`).

    Explicit ``cu_seq_lens_q/k`` and restarting ``position_ids`` count alike, with a mask or
    without: cutting a mask that already keeps the sequences apart into their blocks changes
    nothing. Cached on the tensor HF passes to every layer, like the masks, when no mask is
    in play.
    """
    # one of the two given stands for both
    given = (cu_seq_lens_q if cu_seq_lens_q is not None else cu_seq_lens_k,
             cu_seq_lens_k if cu_seq_lens_k is not None else cu_seq_lens_q)
    explicit = given[0] is not None
    anchor = given[0] if explicit else position_ids
    cacheable = plan.attn_mask is None and isinstance(anchor, Tensor)
    key = ("packed", plan.causal, plan.window, n_q, n_k, id(cu_seq_lens_k))
    if cacheable and (hit := _recent.get(anchor, key)) is not None:
        return hit
    if explicit:
        if batch != 1:
            raise ValueError(f"cu_seq_lens_q/k describe a packed batch of one row, got batch "
                             f"size {batch}")
        # attn's one rule for packed offsets (attn.varlen.check_cu_form), read on the host
        cu_q, cu_k = (check_cu_values(name, check_cu_form(name, cu), n, "the packed length")
                      for name, cu, n in zip(("cu_seq_lens_q", "cu_seq_lens_k"), given, (n_q, n_k)))
    else:
        cu_q = cu_k = _packed_cu_seqlens(position_ids, n_q)
    packed = plan if cu_q is None else replace(  # None: one sequence, nothing to keep apart
        plan, cu_seqlens=(cu_q.to(device), cu_k.to(device)))
    if cacheable:
        _recent.put(anchor, key, packed)
    return packed


def _per_sequence(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, plan: _Plan,
                  **options) -> Tensor:
    """Packed sequences under a mask or bias over the packed grid: each sequence runs alone on
    its own block of the mask, with the band on its own bottom-right diagonal (varlen's
    convention). A document mask over the whole grid would put two sequences in one tile,
    where a NaN in one reaches the other's rows through 0·NaN in P·V.

    query (1, H, Nq, D), key/value (1, Hkv, Nk, D[v]), mask broadcastable to
    (1, H, Nq, Nk) → (1, H, Nq, Dv)."""
    Nq, Nk = query.shape[2], key.shape[2]
    cu_q, cu_k = (c.tolist() for c in plan.cu_seqlens)
    outs = []
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        if q1 == q0:
            continue
        m = mask[..., q0:q1, :] if mask.shape[-2] == Nq else mask
        m = m[..., k0:k1] if mask.shape[-1] == Nk else m
        outs.append(attn.attention(
            query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1], causal=plan.causal,
            window=plan.window, attn_mask=m, **options))
    return torch.cat(outs, dim=2)


# -- HF's paged cache (continuous batching) ---------------------------------------------------

@functools.lru_cache(maxsize=None)
def _update_takes_kwargs(cache_type: type) -> bool:
    """transformers 5.23's ``PagedAttentionCache.update(..., kwargs)`` picks the layer's
    entries out of the per-layer-type keywords itself; 5.17's takes the index lists."""
    return "kwargs" in inspect.signature(cache_type.update).parameters


def _paged_keys_values(module: torch.nn.Module, key: Tensor, value: Tensor, cache: object,
                       cu_seq_lens_k: object, kwargs: dict) -> tuple[Tensor, Tensor, Tensor]:
    """Write this step's keys and values into HF's paged cache as HF's own paged wrappers do
    (``cache.update``) and return what the cache reads back for attention: every request's
    keys, its cached ones then its new ones, packed one request after another.

    key/value (1, Hkv, new, D) → key/value (1, Hkv, total_k, D), cu_seq_lens_k (requests + 1,).
    A sliding layer's cache is a ring of its last window - 1 keys; update() returns them in
    position order, so the band on each request's own keys is still bottom-right.
    """
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise ValueError(f"HF's paged cache is indexed by layer: {type(module).__name__} has no "
                         f"integer layer_idx (got {layer!r})")
    if _update_takes_kwargs(type(cache)):
        paged = dict(kwargs, cu_seq_lens_k=cu_seq_lens_k)  # update() resolves it per layer type
        key, value = cache.update(key_states=key, value_states=value, layer_idx=layer,
                                  kwargs=paged)
        return key, value, paged["cu_seq_lens_k"]
    key, value = cache.update(key_states=key, value_states=value, layer_idx=layer,
                              read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    # (total_k, Hkv, D) -> (1, Hkv, total_k, D)
    key, value = (x.transpose(0, 1)[None] for x in (key, value))
    if isinstance(cu_seq_lens_k, dict):  # one entry per layer type; the cache knows this layer's
        kind = "full_attention" if cache.sliding_windows[layer] == 1 else "sliding_attention"
        cu_seq_lens_k = cu_seq_lens_k[kind] if len(cu_seq_lens_k) > 1 \
            else next(iter(cu_seq_lens_k.values()))
    return key, value, cu_seq_lens_k


def _paged_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     cache: object, cu_seq_lens_q: object, cu_seq_lens_k: object, kwargs: dict,
                     **options) -> Tensor:
    """One layer of a continuous-batching step: the scheduled requests' new tokens packed into
    one row, each request attending to its own cached and new keys only.

    query (1, H, total_q, D), key/value (1, Hkv, total_q, D[v]) → (1, total_q, H, Dv).
    """
    if kwargs.get("block_table") is not None:
        raise NotImplementedError(
            "attn does not run HF's continuous-batching decode fast path (a block_table into the "
            "pages, written by flash_attn_with_kvcache itself); HF enables it only for flash "
            "attention on CUDA / XPU. Use ContinuousBatchingConfig(max_blocks_per_request=0)")
    if query.shape[0] != 1:
        raise ValueError(f"HF's paged cache packs a step's requests into one row: query must be "
                         f"(1, H, total_q, D), got {tuple(query.shape)}")
    n_q = query.shape[2]
    if isinstance(cu_seq_lens_q, Tensor) and cu_seq_lens_q.dim() == 1 \
            and cu_seq_lens_q.numel() > 0 and int(cu_seq_lens_q[-1]) != n_q:
        raise NotImplementedError(
            f"attn does not run continuous batching on inputs padded to static shapes (CUDA "
            f"graphs or torch.compile): cu_seq_lens_q ends at {int(cu_seq_lens_q[-1])} of "
            f"{n_q} packed query tokens. Use ContinuousBatchingConfig(use_cuda_graph=False) "
            f"without compile configs")
    key, value, cu_k = _paged_keys_values(module, key, value, cache, cu_seq_lens_k, kwargs)
    return _varlen(query, key, value, cu_seq_lens_q, cu_k, **options)


def _varlen(query: Tensor, key: Tensor, value: Tensor, cu_q, cu_k, **options) -> Tensor:
    """``attn.varlen_attention`` on sequences packed into one row: query (1, H, total_q, D),
    key/value (1, Hkv, total_k, D[v]) → (1, total_q, H, Dv)."""
    # (1, H, total, D) -> the packed layout (total, H, D)
    out = attn.varlen_attention(query[0].transpose(0, 1), key[0].transpose(0, 1),
                                value[0].transpose(0, 1), cu_q, cu_k, **options)
    return out[None].contiguous()


def _let_continuous_batching_keep(name: str) -> None:
    """Let HF's continuous batching run with attn's implementation ``name``: its manager's
    switch to an implementation of HF's own, wrapped once, leaves the names attn registered
    as they are (docs/hf.md, "Continuous batching")."""
    _registered.add(name)
    try:
        from transformers.generation.continuous_batching.continuous_api import (
            ContinuousBatchingManager,
        )
    except ImportError:  # a transformers without continuous batching
        return
    switch = ContinuousBatchingManager.switch_to_cb_friendly_attn
    if getattr(switch, "_keeps_attn", False):
        return

    @functools.wraps(switch)
    def keep_attn(self, model, *args, **kwargs):
        if getattr(model.config, "_attn_implementation", None) in _registered:
            return None
        return switch(self, model, *args, **kwargs)

    keep_attn._keeps_attn = True
    ContinuousBatchingManager.switch_to_cb_friendly_attn = keep_attn


# -- attn's quantized cache for generate() ----------------------------------------------------

class _CachedKV(Tensor):
    """What :class:`AttnQuantizedCache` returns from ``update`` in place of the keys (or
    values): the shape, dtype and device of the cached states ``(B, Hkv, N, D)``, no storage.
    attn's attention function reads the layer's pages instead; any operation on it raises,
    so another attention fails loudly instead of attending over nothing (docs/hf.md)."""

    layer: "_QuantizedLayer"

    @staticmethod
    def __new__(cls, layer: "_QuantizedLayer", like: Tensor, n: int) -> "_CachedKV":
        shape = (*like.shape[:2], n, like.shape[3])
        t = Tensor._make_wrapper_subclass(cls, shape, dtype=like.dtype, device=like.device)
        t.layer = layer
        return t

    def __repr__(self) -> str:
        return f"AttnQuantizedCache keys/values of layer {self.layer.index} {tuple(self.shape)}"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            f"AttnQuantizedCache holds its keys and values quantized in pages that only attn's "
            f"attention function reads (attn.decode); something else ran {func} on them. Load "
            f"the model with attn_implementation='attn' (after attn.integrations.hf.register()) "
            f"or use one of HF's own caches")


class _QuantizedLayer(CacheLayerMixin):
    """One attention layer's keys and values in an :class:`attn.kvcache.PagedKVCache` of
    quantized pages (allocated at the first update, from the states' shapes)."""

    # every position stays addressed, sliding layers included: HF's masks are laid over all
    # of them (get_mask_sizes), attn's window does the sliding (docs/hf.md)
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, index: int, quant: KVQuant, page_size: int, max_tokens: int,
                 max_batch: int | None, fp8_scales, quantized_q: bool = False) -> None:
        super().__init__()
        self.index, self.quant, self.page_size = index, quant, page_size
        self.max_tokens, self.max_batch, self.fp8_scales = max_tokens, max_batch, fp8_scales
        self.quantized_q = quantized_q
        self.pages: PagedKVCache | None = None
        self.batch, self.length = 0, 0
        self.pad_starts: Tensor | None = None  # (batch,) first real key of each row

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        B, Hkv, _, D = key_states.shape
        rows = self.max_batch or B
        if B > rows:
            raise ValueError(f"AttnQuantizedCache(max_batch={rows}) got a batch of {B} "
                             f"sequences (key_states {tuple(key_states.shape)})")
        per_seq = -(-self.max_tokens // self.page_size)
        self.pages = PagedKVCache.allocate(
            rows * per_seq, self.page_size, Hkv, D, max_seqs=rows, max_pages=per_seq,
            head_dim_v=value_states.shape[-1], dtype=key_states.dtype,
            device=key_states.device, quant=self.quant, fp8_scales=self.fp8_scales)
        self.batch = B
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    @property
    def rows(self) -> list[int] | None:
        """The cache rows this batch uses (None: all of them)."""
        return None if self.batch == self.pages.batch else list(range(self.batch))

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs
               ) -> tuple[Tensor, Tensor]:
        """Quantize ``key_states`` / ``value_states`` ``(B, Hkv, Nnew, D)`` into the pages;
        return stand-ins for the layer's keys and values (:class:`_CachedKV`)."""
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            raise ValueError("AttnQuantizedCache is forward only (a quantized cache serves "
                             "inference): run the model under torch.no_grad() or "
                             "torch.inference_mode(), as generate() does")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        if key_states.shape[0] != self.batch:
            raise ValueError(f"AttnQuantizedCache layer {self.index} holds {self.batch} "
                             f"sequences, got key_states {tuple(key_states.shape)}")
        if self.length + n > self.max_tokens:
            raise ValueError(f"AttnQuantizedCache(max_tokens={self.max_tokens}) is full: "
                             f"{self.length} cached + {n} new tokens; pass a larger max_tokens "
                             f"(prompt length + max_new_tokens)")
        with torch.no_grad():
            self.pages.append(key_states, value_states, seq_ids=self.rows)
        self.length += n
        return _CachedKV(self, key_states, self.length), _CachedKV(self, value_states,
                                                                   self.length)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_tokens

    def reset(self) -> None:
        if self.pages is not None:
            self.pages.free(list(range(self.pages.batch)))
        self.length, self.pad_starts = 0, None

    def _unsupported(self, what: str):
        raise NotImplementedError(f"AttnQuantizedCache does not {what} (its pages are "
                                  f"quantized as written): use greedy or sampling generate() "
                                  f"without beams, assistants or several sequences per prompt")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("crop (assisted decoding)")

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self._unsupported("reorder sequences (beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("repeat sequences (num_return_sequences, beams)")

    def batch_select_indices(self, indices: Tensor) -> None:
        self._unsupported("select sequences")

    def offload(self):
        self._unsupported("offload")

    # -- the padding HF's masks describe, as per-row starts --

    def check_padding(self, mask: Tensor | None, n_q: int, causal: bool,
                      window: tuple[int, int] | None) -> None:
        """Left padding from HF's mask, as each row's first real key (set on the layer's
        first call, checked on every later one): the keys before it are read by no query.
        Any other mask raises NotImplementedError rather than being ignored."""
        n_k = self.length
        padding = None
        if mask is not None:
            plan = _plan_for_mask(mask, n_q, n_k, causal, window)
            if plan.causal != causal or (plan.attn_mask is not None
                                         and plan.attn_mask.shape[-2:] != (1, n_k)):
                raise NotImplementedError(
                    f"AttnQuantizedCache runs causal (and sliding-window) attention over "
                    f"left-padded rows; HF's mask {tuple(mask.shape)} for layer {self.index} "
                    f"is something else (a custom or bidirectional pattern)")
            if plan.attn_mask is not None:
                padding = plan.attn_mask.reshape(plan.attn_mask.shape[0], n_k).cpu()
        if padding is None:
            padding = torch.ones(self.batch, n_k, dtype=torch.bool)
        if padding.shape[0] != self.batch:
            raise ValueError(f"attention_mask covers {padding.shape[0]} rows, the cache "
                             f"{self.batch}")
        allowed = dense_keep(n_q, n_k, causal=causal, window=window)
        seen = torch.ones(n_k, dtype=torch.bool) if allowed is None else allowed.any(0)
        if self.pad_starts is None:  # the first call: every key is some query's own
            self.pad_starts = (~padding).long().cumprod(1).sum(1)
            starts = self.pages.starts.clone()
            starts[:self.batch] = self.pad_starts
            self.pages.starts = starts
        expected = torch.arange(n_k)[None, :] >= self.pad_starts[:, None]
        bad = ((padding != expected) & seen).any(1)
        if bool(bad.any()):
            b = int(bad.nonzero()[0])
            raise NotImplementedError(
                f"AttnQuantizedCache reads left-padded batches: each row's masked keys must be "
                f"the ones before its first real token. Row {b} of the mask for layer "
                f"{self.index} (keys {n_k}) masks {(~padding[b]).nonzero().flatten().tolist()[:16]}"
                f", its padding ends at {int(self.pad_starts[b])}")


class AttnQuantizedCache(Cache):
    """A KV cache for ``model.generate(cache=...)`` whose keys and values are stored quantized
    (:mod:`attn.kvquant`) in an :class:`attn.kvcache.PagedKVCache` and read tile by tile by
    :func:`attn.decode`, never dequantized whole. Needs ``register()``'s attention; forward
    only; equal or left-padded prompts. The arguments, an example and what raises
    NotImplementedError: docs/hf.md ("A quantized KV cache for generate()").
    """

    def __init__(self, config, quant: KVQuant | str = "int8", *, max_tokens: int,
                 page_size: int = 16, max_batch: int | None = None,
                 fp8_scales: tuple = (1.0, 1.0), quantized_q: bool = False) -> None:
        if isinstance(quant, str):
            quant = KVQuant(quant)
        if not isinstance(quant, KVQuant):
            raise TypeError(f"quant must be an attn.kvquant.KVQuant or a kind name, got "
                            f"{type(quant).__name__}")
        if quantized_q and not quant.int8_per_token:
            raise ValueError(f"quantized_q scores int8 keys with one scale per token "
                             f"(KVQuant('int8')), got quant={quant}")
        for name, x in (("max_tokens", max_tokens), ("page_size", page_size),
                        ("max_batch", max_batch or 1)):
            if not isinstance(x, int) or isinstance(x, bool) or x < 1:
                raise ValueError(f"{name} must be a positive int, got {x!r}")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        n_layers = getattr(text, "num_hidden_layers", None)
        if not isinstance(n_layers, int) or n_layers < 1:
            raise ValueError(f"config must be a decoder's config with num_hidden_layers, got "
                             f"{type(config).__name__} with num_hidden_layers={n_layers!r}")
        self.quant, self.quantized_q = quant, bool(quantized_q)
        super().__init__(layers=[_QuantizedLayer(i, quant, page_size, max_tokens, max_batch,
                                                 fp8_scales, self.quantized_q)
                                 for i in range(n_layers)])

    def bytes_per_token(self) -> float:
        """Bytes a cached token costs over all layers (keys and values, scales included)."""
        return sum(layer.pages.bytes_per_token() for layer in self.layers
                   if layer.pages is not None)


def _quantized_cache_attention(query: Tensor, key: _CachedKV, value: Tensor,
                               attention_mask: Tensor | None, causal: bool,
                               window: tuple[int, int] | None, scaling, softcap, s_aux,
                               dropout_p: float, refused: dict) -> Tensor:
    """One layer's attention over an :class:`AttnQuantizedCache`: ``attn.decode`` on its
    pages. query (B, H, Nq, D) → (B, Nq, H, Dv)."""
    layer = key.layer
    if not isinstance(value, _CachedKV) or value.layer is not layer:
        raise ValueError("key and value must both come from one AttnQuantizedCache layer")
    for name, x in refused.items():
        if x is not None:
            raise NotImplementedError(f"attn does not run {name} with an AttnQuantizedCache")
    if dropout_p:
        raise NotImplementedError("AttnQuantizedCache is for inference: no attention dropout")
    layer.check_padding(attention_mask, query.shape[2], causal, window)
    out = attn.decode(query, layer.pages, seq_ids=layer.rows, causal=causal, window=window,
                      scale=scaling, softcap=softcap, sinks=s_aux,
                      quantized_q=layer.quantized_q)
    if causal and window is not None and window[0] >= 0:
        # the next queries sit past every cached key: pages before their windows are done
        layer.pages.free_outside_window(window)
    return out.transpose(1, 2).contiguous()  # (B, H, Nq, Dv) -> (B, Nq, H, Dv)


# -- the attention function HF calls ----------------------------------------------------------

def _warn_unread(module: torch.nn.Module, kwargs: dict) -> None:
    """Warn once per keyword that attn reads none of: output_attentions, and any keyword
    outside _INERT that a model passes with a value."""
    if kwargs.get("output_attentions"):
        _warn_once("output_attentions", "attn never materializes attention weights: "
                   "output_attentions=True returns None for them (use attn_implementation="
                   "'eager' to inspect weights)")
    for k in sorted(k for k, v in kwargs.items() if v is not None and k not in _INERT):
        _warn_once(f"kw:{k}", f"attn's HF integration ignores the keyword {k!r} passed by "
                   f"{type(module).__name__}; check that this model does not need it")


def _with_bias(mask: Tensor | None, position_bias: Tensor | None, dtype: torch.dtype
               ) -> Tensor | None:
    """The plan's mask with a position_bias added (a bool mask's hidden keys -inf), a float
    mask in q's ``dtype``."""
    if position_bias is None:
        return mask.to(dtype) if mask is not None and mask.is_floating_point() else mask
    bias = position_bias.to(dtype)
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return bias + mask.to(dtype)


def _attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                       attention_mask: Tensor | None, *, backend: str, dropout: float = 0.0,
                       scaling: float | None = None, is_causal: bool | None = None,
                       sliding_window: int | None = None, softcap: float | None = None,
                       s_aux: Tensor | None = None, position_bias: Tensor | None = None,
                       cu_seq_lens_q: Tensor | None = None, cu_seq_lens_k: Tensor | None = None,
                       position_ids: Tensor | None = None, cache: object = None,
                       **kwargs) -> tuple[Tensor, None]:
    """HF's attention-function signature on top of ``attn.attention``.

    query (B, H, Nq, D), key/value (B, Hkv, Nk, D[v]) → ((B, Nq, H, Dv), None).

    HF's keywords are translated in turn (mask, window, packed offsets, sinks, a cache), in
    the order HF's own attention functions read them.
    """
    _warn_unread(module, kwargs)
    B, H, Nq, _ = query.shape
    Nk = key.shape[2]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    # HF's sliding_window W as (W - 1, 0); not causal (encoders such as ModernBERT), HF's
    # bidirectional windows are symmetric: (W - 1, W - 1)
    window = None if sliding_window is None else module_window(
        hf_sliding_window(sliding_window)[0], causal=causal)
    dropout_p = float(dropout) if module.training else 0.0
    if isinstance(key, _CachedKV):
        return _quantized_cache_attention(
            query, key, value, attention_mask, causal, window, scaling, softcap, s_aux,
            dropout_p, {"a position_bias": position_bias, "packed sequences (cu_seq_lens)":
                        cu_seq_lens_q if cu_seq_lens_q is not None else cu_seq_lens_k,
                        "HF's paged cache": cache}), None
    options = dict(scale=scaling, softcap=softcap, sinks=s_aux, dropout_p=dropout_p,
                   backend=backend)
    if cache is not None:
        if position_bias is not None:
            raise NotImplementedError("attn does not run HF's paged cache (continuous batching) "
                                      "with a position_bias")
        # HF's model drew its mask over the packed new tokens only, not knowing the cache: the
        # requests' borders come from cu_seq_lens, the band from causal and the window
        return _paged_attention(module, query, key, value, cache, cu_seq_lens_q, cu_seq_lens_k,
                                kwargs, causal=causal, window=window, **options), None

    plan = (_Plan(causal, window, None) if attention_mask is None
            else _plan_for_mask(attention_mask, Nq, Nk, causal, window))

    # Restarting position_ids count whether or not HF handed a mask: HF draws the sequences'
    # borders into its masks only when no cache is in play, while with one (use_cache=True) a
    # sliding layer still gets a plain sliding mask spanning them.
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None \
            or (B == 1 and Nq == Nk and position_ids is not None):
        plan = _packed_plan(plan, Nq, Nk, B, cu_seq_lens_q, cu_seq_lens_k, position_ids,
                            query.device)

    mask = _with_bias(plan.attn_mask, position_bias, query.dtype)
    if plan.cu_seqlens is not None and mask is None:
        return _varlen(query, key, value, *plan.cu_seqlens, causal=plan.causal,
                       window=plan.window, **options), None
    if plan.cu_seqlens is not None:
        out = _per_sequence(query, key, value, mask, plan, **options)
    else:
        out = attn.attention(query, key, value, causal=plan.causal, attn_mask=mask,
                             window=plan.window, **options)
    return out.transpose(1, 2).contiguous(), None  # (B, H, Nq, Dv) -> (B, Nq, H, Dv)


# -- the mask function HF calls once per forward ----------------------------------------------

def _bottom_right_suffices(q_length: int, kv_length: int, q_offset: object, kv_offset: object,
                           padding: Tensor | None, local_size: int | None) -> bool:
    """True when attn's own bottom-right causal (plus the sliding_window keyword) is exactly
    the mask HF asks for, so none need exist."""
    if isinstance(q_offset, Tensor) or isinstance(kv_offset, Tensor):
        return False  # a static cache's offsets: reading them would sync or break tracing
    # Queries must be the last kv_length positions' tail; a static cache's empty slots and a
    # sliding cache's ring break that alignment.
    if q_offset + q_length != kv_offset + kv_length:
        return False
    # HF's own rule for local patterns (windows, chunks): only when they cannot bite yet.
    if local_size is not None and kv_length >= local_size:
        return False
    if padding is None:
        return True
    if padding.shape[-1] > kv_length:
        padding = padding[:, kv_offset:kv_offset + kv_length]
    return bool(padding.all())


def _mask_function(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                   kv_offset: int = 0, mask_function=None, attention_mask: Tensor | None = None,
                   local_size: int | None = None, allow_is_causal_skip: bool = True,
                   allow_is_bidirectional_skip: bool = False, use_vmap: bool = False,
                   device: torch.device | str = "cpu", **kwargs) -> Tensor | None:
    """HF's mask-interface signature: None when attn's causal suffices, else HF's bool mask.

    HF sets ``allow_is_causal_skip`` only when the mask is plain causal or sliding-causal
    (no packing, no custom overlays); attn's causal is bottom-right, so it may stand in only
    when the queries are the keys' tail, a stricter test than HF's top-left SDPA skip.
    """
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if allow_is_causal_skip and _bottom_right_suffices(q_length, kv_length, q_offset, kv_offset,
                                                       padding, local_size):
        return None
    if mask_function is not None:
        kwargs["mask_function"] = mask_function
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=False,
                     allow_is_bidirectional_skip=allow_is_bidirectional_skip, use_vmap=use_vmap,
                     device=device, **kwargs)


def register(name: str = "attn", backend: str = "auto") -> str:
    """Register attn with transformers under ``name``; returns ``name``.

    Afterwards ``from_pretrained(..., attn_implementation=name)`` (or ``from_config``, or
    ``model.set_attn_implementation(name)``) runs every attention layer on attn with
    ``backend=backend``, ``model.generate_batch`` (continuous batching) too. Several names
    with different backends may be registered; registering one again replaces it.
    """
    if not isinstance(name, str) or not name or name in _RESERVED or "/" in name:
        raise ValueError(f"name must be a new implementation name (not one of HF's own "
                         f"{_RESERVED}, no '/'), got {name!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    def attention_forward(module, query, key, value, attention_mask, **kwargs):
        return _attention_forward(module, query, key, value, attention_mask, backend=backend,
                                  **kwargs)

    attention_forward.__name__ = f"attn_{backend}_attention_forward"
    attention_forward.__doc__ = _attention_forward.__doc__
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, _mask_function)
    _let_continuous_batching_keep(name)
    return name


__all__ = ["AttnQuantizedCache", "register"]
