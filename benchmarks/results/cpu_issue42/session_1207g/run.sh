#!/usr/bin/env bash
# Issue 42 on an AVX-512-BF16 CPU (AMD EPYC Zen 4: family 25 model 17, avx512_bf16, no AMX),
# 2 threads, torch 2.13.0+cpu, after fused's bool-mask change (0b26cea: the mask's 0/-inf by
# integer bits, 1024-2048-row blocks under a user mask without a band, rows without keys
# read only where the op's lse is 0): the `masked` cells of the `avx512-bf16` entry measured
# afresh (8 rounds a point, quiet and busy, the busier run kept per cell), then the targets
# quiet and busy on that entry. Run from the checkout's root; results land beside this script.
set -euo pipefail
source benchmarks/results/cpu_issue42/lib.sh
here=benchmarks/results/cpu_issue42/session_1207g
for dt in float32 bfloat16 float16; do forget "$dt" masked; done
mstep() {
  attn bench auto-table --dtype float32 bfloat16 float16 --classes masked --rounds 8 \
    "${busy[@]}" --out "$here/auto_table_masked_$mode" --write "$table"
}
each_mode mstep
step() { python $targets --rounds 5 "${busy[@]}" --out "$here/targets_$mode"; }
each_mode step
# That run (auto_table_masked_*, targets_first_*) had _added's three integer passes on torch's
# threads for a call that is one op call: each waited for the busy core, and the float32
# masked cell went to tiled (fused 54.6 ms busy against tiled 41.4). With them on the
# caller's thread below SMALL_PASS (workers.small_pass), the float32 cell measured again
# (auto_table_masked_fp32_fix_*: fused, 38.3 ms busy against SDPA 39.6), then the targets
# again on the final entry (targets_*)
forget float32 masked
m2() { attn bench auto-table --dtype float32 --classes masked --rounds 8 "${busy[@]}" \
  --out "$here/auto_table_masked_fp32_fix_$mode" --write "$table"; }
each_mode m2
each_mode step
# and the memory: attn bench memory (causal, unmasked: as the last session's) into memory/,
# and a bool-masked fwd+bwd peak, old tree against new (mem_masked.py -> mem_masked.txt)
attn bench memory --n 1024 4096 16384 --backends tiled fused sdpa --mode fwd+bwd \
  --causal true --out "$here/memory"
# after the backward's pooled zeros and casts (627b769, bwd_pool/): the targets once more
fstep() { python $targets --rounds 5 "${busy[@]}" --out "$here/targets_final_$mode"; }
each_mode fstep
