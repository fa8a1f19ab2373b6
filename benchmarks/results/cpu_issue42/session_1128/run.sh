#!/usr/bin/env bash
# Issue 42's measurements after this session's fused changes (head groups, one-call dense
# forward, the chunk class), quiet then with one core kept busy (2 threads). Run from the
# checkout's root; results land beside this script. The CPU kind's table entry is measured
# afresh (the old one removed first), keeping the busier run per cell.
set -euo pipefail
here=benchmarks/results/cpu_issue42/session_1128
table=attn/auto_table.json
python - <<'PY'
import json
from attn import choose
p = "attn/auto_table.json"
d = json.load(open(p))
d.pop(choose.cpu_kind(), None)
json.dump(d, open(p, "w"), indent=2)
PY
for mode in quiet busy; do
  busy=(); [ "$mode" = busy ] && busy=(--busy-core)
  attn bench auto-table --dtype float32 bfloat16 float16 --rounds 4 "${busy[@]}" \
    --out "$here/auto_table_$mode" --write "$table"
  python benchmarks/experiments/issue42_targets.py --rounds 4 "${busy[@]}" --out "$here/targets_$mode"
done
attn bench memory --n 1024 4096 16384 --backends tiled fused sdpa --mode fwd+bwd --causal true \
  --out "$here/memory"
