#!/bin/bash
B="python -m attn bench speed --paired --threads 2 --no-fused --flex-max-n 0 --no-progress $1"
for round in 1 2; do
for hs in 0 4 2; do
  echo "== round $round XHS=$hs"
  cd /tmp && XHS=$hs PYTHONPATH=/work/main $B --n 1024 4096 --mode both --causal both --repeats 5 --out /tmp/ab/hs 2>&1 | grep -E "^\| square"
done
done
