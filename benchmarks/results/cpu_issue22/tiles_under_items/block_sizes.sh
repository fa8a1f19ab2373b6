#!/bin/bash
B="python -m attn bench speed --paired --threads 2 --no-fused --flex-max-n 0 --no-progress $1"
for round in 1 2; do
for bs in 256x256 512x256 256x512 128x256; do
  echo "== round $round $bs"
  cd /tmp && XBM=${bs%x*} XBN=${bs#*x} PYTHONPATH=/work/main $B --n 1024 4096 --mode both --causal both --repeats 5 --out /tmp/ab/bs 2>&1 | grep -E "^\| square"
done
done
