#!/usr/bin/env bash
# The avx2 entry again with 8 rounds a point (run.sh's 4 rounds gave bf16 `dense` to tiled on
# one busy cell, 1.15, where the targets' bf16 forwards ran faster on fused; 8 rounds keep it:
# busy, tiled 68.6 ms against fused 91.9), then the float32 direct targets again, quiet and
# busy, on the entry it writes (the one committed).
set -euo pipefail
source benchmarks/results/cpu_issue42/lib.sh
here=benchmarks/results/cpu_issue42/session_1206
forget
each_mode table_step 8 auto_table8
# the targets on the new entry: the rows whose backend it changed from run.sh's (float32
# fwd+bwd: train went from fused to tiled), quiet, busy
step() {
  python $targets --rounds 4 --dtype float32 --parts direct "${busy[@]}" \
    --out "$here/targets8_$mode"
}
each_mode step
# targets8_* ran float32 fwd+bwd on tiled (the 8-round busy `train` cell: fused/tiled 1.077,
# past the 1.05 margin) and lost to targets_* on fused in 9 of 10 rows, quiet and busy; the
# cell again with 16 rounds (whatever it said would be kept): busy 1.00, quiet 0.92 -> fused,
# the entry committed (targets_quiet / targets_busy measured that choice for every row)
forget float32 train
step16() {
  attn bench auto-table --dtype float32 --classes train --rounds 16 "${busy[@]}" \
    --out "$here/auto_table16_train_$mode" --write "$table"
}
each_mode step16
