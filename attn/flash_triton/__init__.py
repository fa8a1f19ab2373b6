"""Fused attention in Triton: the tiled algorithm as GPU kernels (forward, FlashAttention-2
backward, a forward-mode pass), split-KV decoding and paged decoding. How the kernels work and
what each module of the package holds: docs/gpu.md, "How the kernels work".

Runs on CUDA; on CPU only under the Triton interpreter (``TRITON_INTERPRET=1`` set before
this module is imported), which is how the default test suite checks the kernels.
"""

# the outer kernels by name for attn gpu-check's tune stage (gpu_stages: getattr on this module)
from attn.flash_triton.outer import _attn_bwd_dkdv, _attn_bwd_dq, _attn_fwd
from attn.flash_triton.kernels import _INTERPRET, _stages
from attn.flash_triton.launch import (_bwd, _fwd, paged_attention, triton_attention,
                                      unsupported_reason, value_offset_args)
from attn.flash_triton.split import SplitPlan, split_kv_plan, split_kv_reason
from attn.flash_triton.tune import prune_for, smem_estimate

__all__ = ["triton_attention", "paged_attention", "unsupported_reason", "prune_for",
           "smem_estimate", "value_offset_args", "split_kv_plan", "SplitPlan", "split_kv_reason"]
