#!/usr/bin/env bash
# Issue 42's variants row (sinks, return_lse, ALiBi on causal N=4096, fwd) before (aca372b,
# this session's start) and after (main), back to back, quiet then with one core busy.
set -euo pipefail
out=/work/main/benchmarks/results/cpu_issue42/session_1128e
mkdir -p "$out"
for mode in quiet busy; do
  busy=(); [ "$mode" = busy ] && busy=(--busy-core)
  for tree in before after; do
    dir=/work/main; [ "$tree" = before ] && dir=/work/wt_before
    (cd "$dir" && PYTHONPATH="$dir" python3 benchmarks/experiments/issue42_targets.py \
       --parts variants --dtype float32 --rounds 7 "${busy[@]}" --out "$out/variants_${mode}_${tree}")
  done
done
