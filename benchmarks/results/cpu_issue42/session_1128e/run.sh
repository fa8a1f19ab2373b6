#!/usr/bin/env bash
# Issue 42's variants row (sinks, return_lse, ALiBi on causal N=4096, fp32 fwd) before (aca372b,
# this session's start, a worktree at ../wt_before) and after (main), back to back, quiet then
# with one core kept busy. Cascade Lake Xeon (2 cores), torch 2.13.0+cpu. Run from the root.
set -euo pipefail
out=$PWD/benchmarks/results/cpu_issue42/session_1128e
for mode in quiet busy; do
  busy=(); [ "$mode" = busy ] && busy=(--busy-core)
  for tree in before after; do
    dir=.; [ "$tree" = before ] && dir=../wt_before
    (cd "$dir" && PYTHONPATH="$PWD" python3 benchmarks/experiments/issue42_targets.py \
       --parts variants --dtype float32 --rounds 7 "${busy[@]}" --out "$out/variants_${mode}_${tree}")
  done
done
