#!/usr/bin/env bash
# Issue 38's speed and memory check for the 2026-12-07 line cuts (and issue 42's ALiBi change):
# the same command on the tree before (a checkout of 4db0f56) and after (main after the merges),
# in fresh processes, before then after, quiet and then with one core busy; then memory.
# usage: run.sh BEFORE_TREE AFTER_TREE [OUT_DIR (default: this folder)]
set -euo pipefail
before=$1 after=$2
out=${3:-$(cd "$(dirname "$0")" && pwd)}
common="--device cpu --paired --threads 2 --no-plots --no-progress --no-compiled --flex-max-n 0"
for load in quiet busy; do
  extra=""; [ "$load" = busy ] && extra="--busy-core"
  for side in before after; do
    tree=$before; [ "$side" = after ] && tree=$after
    ( cd "$tree" && PYTHONPATH=$tree python3 -m attn bench speed $common $extra \
        --n 2048 --dtype float32 bfloat16 --mode both --causal true \
        --out "$out/paired_${load}_${side}" )
  done
done
for side in before after; do
  tree=$before; [ "$side" = after ] && tree=$after
  ( cd "$tree" && PYTHONPATH=$tree python3 -m attn bench memory --device cpu --n 1024 4096 \
      --backends tiled fused sdpa --mode fwd+bwd --causal true --no-plots --no-progress \
      --out "$out/memory_${side}" )
done
