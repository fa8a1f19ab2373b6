#!/bin/bash
B="python -m attn bench speed --paired --threads 2 --no-fused --flex-max-n 0 --no-progress --busy-core"
for round in 1 2 3; do
  for tree in old new; do
    if [ $tree = old ]; then PP=/tmp/old; else PP=/work/main; fi
    cd /tmp; echo "== round $round $tree"
    PYTHONPATH=$PP $B --shape decode --n 4096 16384 32768 --dtype float32 --mode fwd --repeats 9 --out /tmp/ab/dec 2>&1 | grep -E "^\| decode"
    PYTHONPATH=$PP $B --n 16384 --mode fwd --causal true --repeats 3 --out /tmp/ab/sq 2>&1 | grep -E "^\| square"
  done
done
