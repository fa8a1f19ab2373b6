#!/usr/bin/env bash
# The avx2 entry again with 8 rounds a point (run.sh's 4 rounds gave bf16 `dense` to tiled on
# one busy cell, 1.15, where the targets' bf16 forwards ran faster on fused; 8 rounds keep it:
# busy, tiled 68.6 ms against fused 91.9), then the float32 direct targets again, quiet and
# busy, on the entry it writes (the one committed).
set -euo pipefail
here=benchmarks/results/cpu_issue42/session_1206
table=attn/auto_table.json
python - <<'PY'
import json
from attn import choose
p = "attn/auto_table.json"
d = json.load(open(p))
d.pop(choose.cpu_kind(), None)
with open(p, "w") as f:
    json.dump(d, f, indent=2)
    f.write("\n")
PY
for mode in quiet busy; do
  busy=(); [ "$mode" = busy ] && busy=(--busy-core)
  attn bench auto-table --dtype float32 bfloat16 float16 --rounds 8 "${busy[@]}" \
    --out "$here/auto_table8_$mode" --write "$table"
done
# the targets on the new entry: the rows whose backend it changed from run.sh's (float32
# fwd+bwd: train went from fused to tiled), quiet, busy
for mode in quiet busy; do
  busy=(); [ "$mode" = busy ] && busy=(--busy-core)
  python benchmarks/experiments/issue42_targets.py --rounds 4 --dtype float32 --parts direct \
    "${busy[@]}" --out "$here/targets8_$mode"
done
# targets8_* ran float32 fwd+bwd on tiled (the 8-round busy `train` cell: fused/tiled 1.077,
# past the 1.05 margin) and lost to targets_* on fused in 9 of 10 rows, quiet and busy; the
# cell again with 16 rounds (whatever it said would be kept): busy 1.00, quiet 0.92 -> fused,
# the entry committed (targets_quiet / targets_busy measured that choice for every row)
python - <<'PY'
import json
p = "attn/auto_table.json"
d = json.load(open(p))
del d["avx2"]["entries"]["float32"]["train"]
with open(p, "w") as f:
    json.dump(d, f, indent=2)
    f.write("\n")
PY
for mode in quiet busy; do
  busy=(); [ "$mode" = busy ] && busy=(--busy-core)
  attn bench auto-table --dtype float32 --classes train --rounds 16 "${busy[@]}" \
    --out "$here/auto_table16_train_$mode" --write "$table"
done
