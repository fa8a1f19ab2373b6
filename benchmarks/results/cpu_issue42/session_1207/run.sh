#!/usr/bin/env bash
# Issue 42, AMD EPYC Zen 3 (avx2), torch 2.13.0+cpu, 2 threads: the float32/float64 backward
# as one op call of torch's kernel where the forward is one (a user mask; small dense calls),
# and neither below 32 query rows. "before" is main at 35594f6 in /work/main (PYTHONPATH),
# "after" this tree; the targets' direct rows in float32 and the auto-table's small, masked
# and train classes, quiet then busy.
set -euo pipefail
source benchmarks/results/cpu_issue42/lib.sh
here=benchmarks/results/cpu_issue42/session_1207
step() {
  ab_targets /work/main --rounds 5 --dtype float32 --parts direct
  table_in /work/main auto_table_before --dtype float32 --classes small masked --rounds 8
  table_in "$PWD" auto_table --dtype float32 --classes small masked train --rounds 8
}
each_mode step
# the committed entry's small float32 cell measured anew (it was tiled, ratio 1.271, from
# before the small call's backward was one op call), 16 rounds, quiet and busy, written
forget float32 small
step16() { table_in "$PWD" auto_table16 --dtype float32 --classes small --rounds 16 --write "$table"; }
each_mode step16
# the small cell's fused choice sent the toy GPT's recall steps (B=64 H=4 N=12: below fused's
# 32-row floor for one op call, so 64 items a direction) to fused: the class `tiny` (small,
# fewer than 32 query rows) measured on its own, quiet and busy, written: fused/tiled 3.69
# quiet, 2.15 busy (auto_table_tiny_*). Then such calls, small enough for their items to run
# in order on the caller, became one op call on the caller's thread alone, and a plan is
# made once per distinct sequence length: tiny and small again, 16 rounds, written
forget float32 tiny
step_tiny() {
  table_in "$PWD" auto_table_tiny_one_call --dtype float32 --classes tiny small --rounds 16 \
    --write "$table"
}
each_mode step_tiny
