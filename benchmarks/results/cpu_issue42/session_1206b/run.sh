#!/usr/bin/env bash
# Issue 42, AMD EPYC Zen 3 (avx2), torch 2.13.0+cpu, 2 threads: a float32/float64 forward with
# a user mask as one op call of torch's kernel (before: items of 256 rows on attn's pool).
# "before" is main at bc58512 checked out in /tmp/base (PYTHONPATH), "after" this tree; the
# targets' direct rows (the random bool mask row is new) in float32, quiet then busy, and the
# auto-table's masked class in float32.
set -euo pipefail
here=benchmarks/results/cpu_issue42/session_1206b
script=benchmarks/experiments/issue42_targets.py
for mode in quiet busy; do
  busy=(); [ "$mode" = busy ] && busy=(--busy-core)
  PYTHONPATH=/tmp/base python $script --rounds 5 --dtype float32 --parts direct "${busy[@]}" \
    --out "$here/targets_before_$mode"
  python $script --rounds 5 --dtype float32 --parts direct "${busy[@]}" --out "$here/targets_$mode"
  # (python -m puts the working folder first on sys.path: run "before" from /tmp/base)
  (cd /tmp/base && python -m attn bench auto-table --dtype float32 --classes masked \
    --rounds 8 "${busy[@]}" --out "$OLDPWD/$here/auto_table_before_$mode")
  python -m attn bench auto-table --dtype float32 --classes masked --rounds 8 "${busy[@]}" \
    --out "$here/auto_table_$mode"
done
# the committed entry's masked float32 cell again, 16 rounds, quiet and busy, written
python - <<'PY'
import json
p = "attn/auto_table.json"
d = json.load(open(p))
del d["avx2"]["entries"]["float32"]["masked"]
open(p, "w").write(json.dumps(d, indent=1, sort_keys=True) + "\n")
PY
for mode in quiet busy; do
  busy=(); [ "$mode" = busy ] && busy=(--busy-core)
  python -m attn bench auto-table --dtype float32 --classes masked --rounds 16 "${busy[@]}" \
    --out "$here/auto_table16_$mode" --write attn/auto_table.json
done
