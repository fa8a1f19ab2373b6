#!/usr/bin/env bash
# Issue 42, AMD EPYC Zen 3 (avx2), torch 2.13.0+cpu, 2 threads: a float32/float64 sequence of
# one unmasked piece (plain, top-left causal; no mask, window, ALiBi, split-KV or block size
# asked for) as one op call of its own on torch's threads, not items cut per query block.
# "before" is main at 4a9ebdb in /work/main (PYTHONPATH), "after" a tree with solo.patch
# applied (not adopted: NOTE.md); the targets'
# direct rows in float32, quiet then busy.
set -euo pipefail
source benchmarks/results/cpu_issue42/lib.sh
here=benchmarks/results/cpu_issue42/session_1207b
each_mode ab_targets /work/main --rounds 5 --dtype float32 --parts direct
