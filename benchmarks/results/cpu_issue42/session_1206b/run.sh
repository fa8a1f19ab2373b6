#!/usr/bin/env bash
# Issue 42, AMD EPYC Zen 3 (avx2), torch 2.13.0+cpu, 2 threads: a float32/float64 forward with
# a user mask as one op call of torch's kernel (before: items of 256 rows on attn's pool).
# "before" is main at bc58512 checked out in /tmp/base (PYTHONPATH), "after" this tree; the
# targets' direct rows (the random bool mask row is new) in float32, quiet then busy, and the
# auto-table's masked class in float32.
set -euo pipefail
source benchmarks/results/cpu_issue42/lib.sh
here=benchmarks/results/cpu_issue42/session_1206b
step() {
  ab_targets /tmp/base --rounds 5 --dtype float32 --parts direct
  table_in /tmp/base auto_table_before --dtype float32 --classes masked --rounds 8
  table_in "$PWD" auto_table --dtype float32 --classes masked --rounds 8
}
each_mode step
# the committed entry's masked float32 cell again, 16 rounds, quiet and busy, written
forget float32 masked
step16() { table_in "$PWD" auto_table16 --dtype float32 --classes masked --rounds 16 --write "$table"; }
each_mode step16
