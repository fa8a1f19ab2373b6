#!/usr/bin/env bash
# Issue 42 on an AVX-512-BF16 CPU (AMD EPYC Zen 4: family 25 model 17, avx512_bf16, no AMX),
# 2 threads, torch 2.13.0+cpu: the first measurement of the table's `avx512-bf16` entry.
# "before" is the targets with no such entry (choose.FALLBACK decides), on the code with GQA
# decoding folded (f6a3b4f); then auto-table quiet and busy fill the entry (the busier run is
# kept per cell), the targets run again quiet then busy, and memory and the matmul fraction.
# Run from the checkout's root; results land beside this script.
set -euo pipefail
source benchmarks/results/cpu_issue42/lib.sh
here=benchmarks/results/cpu_issue42/session_1207c
python $targets --rounds 4 --out "$here/targets_quiet_before"
each_mode table_step 5 auto_table
step() { python $targets --rounds 4 "${busy[@]}" --out "$here/targets_$mode"; }
each_mode step
memory_and_rate rate
