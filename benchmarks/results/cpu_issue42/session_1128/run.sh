#!/usr/bin/env bash
# Issue 42's measurements after this session's fused changes (head groups, one-call dense
# forward, the chunk class), quiet then with one core kept busy (2 threads). Run from the
# checkout's root; results land beside this script. The CPU kind's table entry is measured
# afresh (the old one removed first), keeping the busier run per cell.
set -euo pipefail
source benchmarks/results/cpu_issue42/lib.sh
here=benchmarks/results/cpu_issue42/session_1128
forget
step() {
  table_step 4 auto_table
  python $targets --rounds 4 "${busy[@]}" --out "$here/targets_$mode"
}
each_mode step
memory_and_rate
