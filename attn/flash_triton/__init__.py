"""Fused attention in Triton: the tiled algorithm as GPU kernels (forward, FlashAttention-2
backward, a forward-mode pass), split-KV decoding and paged decoding. How the kernels work and
what each module of the package holds: docs/gpu.md, "How the kernels work".

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
