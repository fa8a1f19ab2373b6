#!/bin/bash
# issue 22's table at the final code, quiet then with one core busy; run from the repo root
set -u
R=benchmarks/results/cpu_issue22/final
common="--paired --threads 2 --no-fused --flex-max-n 0 --no-progress"
for cond in quiet busy; do
  extra=""; [ $cond = busy ] && extra="--busy-core"
  attn bench speed $common $extra --n 1024 4096 16384 --mode both --causal both --out $R/square_$cond
  attn bench speed $common $extra --batch 8 --heads 12 --n 512 --mode fwd+bwd --causal true --dtype float32 bfloat16 --repeats 9 --out $R/train_$cond
  attn bench speed $common $extra --shape prefill --n 4096 16384 --mode fwd --repeats 9 --out $R/prefill_$cond
  attn bench speed $common $extra --shape decode --n 4096 16384 32768 --dtype float32 bfloat16 --mode fwd --repeats 9 --out $R/decode_$cond
  attn bench speed $common $extra --n 4096 --dtype bfloat16 --mode both --causal true --repeats 9 --out $R/bf16_$cond
done
