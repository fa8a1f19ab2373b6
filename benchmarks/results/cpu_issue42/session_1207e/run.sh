#!/usr/bin/env bash
# Issue 42 on an AVX-512-BF16 CPU (AMD EPYC Zen 4: family 25 model 17, avx512_bf16, no AMX),
# 2 threads, torch 2.13.0+cpu, on the final code (GQA decoding folded, the caller's own work
# off torch's threads): the `avx512-bf16` entry measured afresh (8 rounds a point, quiet and
# busy, the busier run kept per cell), the targets quiet then busy on that entry, memory and
# the matmul fraction. session_1207c has the targets before any entry (choose.FALLBACK).
# Run from the checkout's root; results land beside this script.
set -euo pipefail
source benchmarks/results/cpu_issue42/lib.sh
here=benchmarks/results/cpu_issue42/session_1207e
forget
each_mode table_step 8 auto_table
step() { python $targets --rounds 5 "${busy[@]}" --out "$here/targets_$mode"; }
each_mode step
memory_and_rate rate
# then auto-table's order changed (each backend right after SDPA in half the rounds, since
# the one after an OpenMP op pays for OpenMP's spinning team): the entry measured again that
# way, replacing the one above (auto_table_fair_*)
forget
each_mode table_step 8 auto_table_fair
# that entry changed one targets row's backend (float32 decode: tiled -> fused); the decode
# rows again on it (targets_decode_*)
dstep() { python $targets --rounds 5 --parts decode "${busy[@]}" --out "$here/targets_decode_$mode"; }
each_mode dstep
