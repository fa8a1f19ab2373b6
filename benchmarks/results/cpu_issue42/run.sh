#!/usr/bin/env bash
# Issue 42's measurements on this CPU, quiet then with one core kept busy (2 threads).
# Run from the checkout's root; results land beside this script.
set -euo pipefail
source benchmarks/results/cpu_issue42/lib.sh
here=benchmarks/results/cpu_issue42
step() {
  # auto's table: fused against tiled per class and dtype (the busier run is kept per cell)
  table_step 4 auto_table
  # the issue's target rows
  python $targets --rounds 4 "${busy[@]}" --out "$here/targets_$mode"
}
each_mode step
memory_and_rate rate
