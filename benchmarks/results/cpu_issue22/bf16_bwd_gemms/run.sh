#!/bin/bash
# alternate old (HEAD) and new (working tree): bf16 fwd+bwd shapes. $1: extra flags (--busy-core)
B="python -m attn bench speed --paired --threads 2 --no-fused --flex-max-n 0 $1"
for round in 1 2 3; do
  for tree in old new; do
    if [ $tree = old ]; then PP=/tmp/old; else PP=/work/main; fi
    cd /tmp
    echo "== round $round $tree"
    PYTHONPATH=$PP $B --n 4096 --mode fwd+bwd --causal true --dtype bfloat16 --repeats 5 --out /tmp/ab/o 2>&1 | grep -E "^\| square"
    PYTHONPATH=$PP $B --batch 8 --heads 12 --n 512 --mode fwd+bwd --causal true --dtype bfloat16 --repeats 5 --out /tmp/ab/o 2>&1 | grep -E "^\| square"
  done
done
