"""Fused attention in Triton: the tiled algorithm of ``tiled.py`` as GPU kernels.

Forward: one program per (query block, batch·head). The q tile stays in registers while the
program walks the key blocks its band allows, keeping the online-softmax state per row —
running max ``m_i``, running denominator ``l_i``, rescaled accumulator ``acc`` — and stores
the log-sum-exp for the backward. Backward (FlashAttention-2): ``Δ = rowsum(dO ∘ O) − dlse``
(preprocess kernel; query blocks holding a saturated softmax row take Δ = Σ P·dP / Σ P
from a Δ pass of the dQ kernel instead, see ``_dq_inner``), then dK/dV with the key block resident, looping over the query blocks
and over the heads of its GQA group (so dK/dV are summed over the group without atomics),
and dQ with the query block resident, looping over key blocks. Every program writes its own
output tile once: the backward is deterministic, there is no ``deterministic`` switch to get
wrong. Forward-mode AD (``_attn_jvp``, under ``torch.func`` transforms and dual tensors):
one query-resident pass from the saved out and lse, ȯ = Σ P∘ṡ·V + P·V̇ − (Σ P∘ṡ)·o and
lsė = Σ P∘ṡ, O(N) memory.

Each band (causal, window) splits a block's walk into at most three stages: masked tiles at
the start, full tiles in the middle (no mask arithmetic at all), masked tiles at the end;
tiles outside the band are never visited.

The package: ``kernels`` (jit helpers and inner loops), ``outer`` (the outer kernels, dense
or packed by the ``VARLEN`` constexpr: one sequence-info helper is all that differs),
``tune`` (autotune configs, pruning, shared-memory model) and ``launch`` (the ``_fwd`` /
``_bwd`` / ``_jvp`` launchers, registered as ``torch.library`` custom ops with fake
implementations so ``torch.compile`` traces through them, one ``torch.autograd.Function``
(and its subclass with the forward-mode rule, taken under torch.func), and the public
:func:`triton_attention`; packed sequences are the same launchers with
``Operands(cu_seqlens_q=..., cu_seqlens_k=...)``).

Decoding calls (Nq <= 16, forward only) may run split-KV instead (``split``: the keys cut
into chunks per :func:`split_kv_plan`, partials merged by a combine kernel). A paged KV cache
is read through its block table inside a sibling of that kernel (``paged``,
:func:`paged_attention`, what ``attn.decode`` runs on CUDA).

Runs on CUDA; on CPU only under the Triton interpreter (``TRITON_INTERPRET=1`` set before
this module is imported), which is how the default test suite checks the kernels.
"""

from attn.flash_triton.outer import (_attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_preprocess,
                                     _attn_fwd, _attn_jvp)
from attn.flash_triton.kernels import _INTERPRET, _stages
from attn.flash_triton.launch import (_bwd, _bwd_op, _FlashAttention, _FlashAttentionJvp, _fwd,
                                      _fwd_op, _jvp, _jvp_op, _op_args, Tangents,
                                      paged_attention, triton_attention, unsupported_reason,
                                      value_offset_args)
from attn.flash_triton.split import SplitPlan, split_kv_plan, split_kv_reason
from attn.flash_triton.tune import _configs, _prune, prune_for, smem_estimate

__all__ = ["triton_attention", "paged_attention", "unsupported_reason", "prune_for",
           "smem_estimate", "value_offset_args", "split_kv_plan", "SplitPlan", "split_kv_reason"]
