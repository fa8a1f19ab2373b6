#!/usr/bin/env bash
# Issue 42, AMD EPYC Zen 3 (avx2), torch 2.13.0+cpu, 2 threads: the float32/float64 backward
# as one op call of torch's kernel where the forward is one (a user mask; small dense calls),
# and neither below 32 query rows. "before" is main at 35594f6 in /work/main (PYTHONPATH),
# "after" this tree; the targets' direct rows in float32 and the auto-table's small, masked
# and train classes, quiet then busy.
set -euo pipefail
here=benchmarks/results/cpu_issue42/session_1207
script=benchmarks/experiments/issue42_targets.py
for mode in quiet busy; do
  busy=(); [ "$mode" = busy ] && busy=(--busy-core)
  PYTHONPATH=/work/main python $script --rounds 5 --dtype float32 --parts direct "${busy[@]}" \
    --out "$here/targets_before_$mode"
  PYTHONPATH=$PWD python $script --rounds 5 --dtype float32 --parts direct "${busy[@]}" \
    --out "$here/targets_$mode"
  (cd /work/main && python -m attn bench auto-table --dtype float32 --classes small masked \
    --rounds 8 "${busy[@]}" --out "$OLDPWD/$here/auto_table_before_$mode")
  python -m attn bench auto-table --dtype float32 --classes small masked train --rounds 8 \
    "${busy[@]}" --out "$here/auto_table_$mode"
done
# the committed entry's small float32 cell measured anew (it was tiled, ratio 1.271, from
# before the small call's backward was one op call), 16 rounds, quiet and busy, written
python - <<'PY'
import json
p = "attn/auto_table.json"
d = json.load(open(p))
del d["avx2"]["entries"]["float32"]["small"]
open(p, "w").write(json.dumps(d, indent=1, sort_keys=True) + "\n")
PY
for mode in quiet busy; do
  busy=(); [ "$mode" = busy ] && busy=(--busy-core)
  python -m attn bench auto-table --dtype float32 --classes small --rounds 16 "${busy[@]}" \
    --out "$here/auto_table16_$mode" --write attn/auto_table.json
done
