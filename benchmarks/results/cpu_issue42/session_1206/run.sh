#!/usr/bin/env bash
# Issue 42 on an AVX2-only CPU (AMD EPYC, Zen 3: family 25 model 1, no AVX-512), 2 threads,
# torch 2.13.0+cpu: the first measurement of the table's `avx2` entry. "before" is main with no
# avx2 entry (choose.FALLBACK decides); then auto-table quiet and busy fill the entry (the
# busier run is kept per cell) and the targets run again, quiet then busy.
# Run from the checkout's root; results land beside this script.
set -euo pipefail
source benchmarks/results/cpu_issue42/lib.sh
here=benchmarks/results/cpu_issue42/session_1206
python $targets --rounds 4 --out "$here/targets_quiet_before"
each_mode table_step 4 auto_table
step() { python $targets --rounds 4 "${busy[@]}" --out "$here/targets_$mode"; }
each_mode step
memory_and_rate rate
