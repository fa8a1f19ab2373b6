#!/usr/bin/env bash
# Issue 42 on an AVX2-only CPU (AMD EPYC, Zen 3: family 25 model 1, no AVX-512), 2 threads,
# torch 2.13.0+cpu: the first measurement of the table's `avx2` entry. "before" is main with no
# avx2 entry (choose.FALLBACK decides); then auto-table quiet and busy fill the entry (the
# busier run is kept per cell) and the targets run again, quiet then busy.
# Run from the checkout's root; results land beside this script.
set -euo pipefail
here=benchmarks/results/cpu_issue42/session_1206
table=attn/auto_table.json
python benchmarks/experiments/issue42_targets.py --rounds 4 --out "$here/targets_quiet_before"
for mode in quiet busy; do
  busy=(); [ "$mode" = busy ] && busy=(--busy-core)
  attn bench auto-table --dtype float32 bfloat16 float16 --rounds 4 "${busy[@]}" \
    --out "$here/auto_table_$mode" --write "$table"
done
for mode in quiet busy; do
  busy=(); [ "$mode" = busy ] && busy=(--busy-core)
  python benchmarks/experiments/issue42_targets.py --rounds 4 "${busy[@]}" --out "$here/targets_$mode"
done
attn bench memory --n 1024 4096 16384 --backends tiled fused sdpa --mode fwd+bwd --causal true \
  --out "$here/memory"
attn bench speed --paired --threads 2 --no-compiled --flex-max-n 0 --n 4096 16384 --mode fwd \
  --causal true --dtype float32 bfloat16 --repeats 3 --out "$here/matmul_fraction"
