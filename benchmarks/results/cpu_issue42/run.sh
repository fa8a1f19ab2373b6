#!/usr/bin/env bash
# Issue 42's measurements on this CPU, quiet then with one core kept busy (2 threads).
# Run from the checkout's root; results land beside this script.
set -euo pipefail
here=benchmarks/results/cpu_issue42
table=attn/auto_table.json
for mode in quiet busy; do
  busy=(); [ "$mode" = busy ] && busy=(--busy-core)
  # auto's table: fused against tiled per class and dtype (the busier run is kept per cell)
  attn bench auto-table --dtype float32 bfloat16 float16 --rounds 4 "${busy[@]}" \
    --out "$here/auto_table_$mode" --write "$table"
  # the issue's target rows
  python benchmarks/experiments/issue42_targets.py --rounds 4 "${busy[@]}" --out "$here/targets_$mode"
done
# fwd+bwd peak memory (profiler method), causal, fp32
attn bench memory --n 1024 4096 16384 --backends tiled fused sdpa --mode fwd+bwd --causal true \
  --out "$here/memory"
# fraction of the dense matmul rate at N = 4096 and 16384 (auto, fused, tiled), quiet
attn bench speed --paired --threads 2 --no-compiled --flex-max-n 0 --n 4096 16384 --mode fwd \
  --causal true --dtype float32 bfloat16 --repeats 3 --out "$here/matmul_fraction"
