#!/usr/bin/env bash
# AMD EPYC Zen 4 (family 25 model 17), 2 threads, torch 2.13.0+cpu: a float32/float64 batch of
# equal rows, each one unmasked piece (plain, top-left causal), from 32 query rows as one op
# call on torch's threads (as SDPA) rather than items on the pool. before = the checkout
# given as $1 (main without the change), after = this checkout; the targets' float32 rows
# SDPA computes directly, quiet then busy. Run from the checkout's root.
set -euo pipefail
source benchmarks/results/cpu_issue42/lib.sh
here=benchmarks/results/cpu_issue42/session_1207d
each_mode ab_targets "$1" --rounds 5 --dtype float32 --parts direct
