# What this folder's session scripts share; each sources it from the checkout's root, where
# it runs. Every measurement runs twice, quiet and with one core kept busy.
targets=benchmarks/experiments/issue42_targets.py
table=attn/auto_table.json

# each_mode FN [ARGS...]: FN once quiet, then once with one core busy; FN reads $mode (quiet
# or busy, for its --out) and "${busy[@]}" (nothing, or --busy-core)
each_mode() {
  local fn=$1 mode busy
  shift
  for mode in quiet busy; do
    busy=(); [ "$mode" = busy ] && busy=(--busy-core)
    "$fn" "$@"
  done
}

# targets_in TREE NAME ARGS...: this checkout's targets script on the attn of the checkout
# TREE (PYTHONPATH), into $here/NAME_$mode
targets_in() {
  local tree=$1 name=$2
  shift 2
  PYTHONPATH=$tree python $targets "$@" "${busy[@]}" --out "$here/${name}_$mode"
}

# ab_targets BEFORE ARGS...: the targets on the attn of the checkout BEFORE (targets_before)
# and on this checkout's (targets)
ab_targets() {
  local before=$1
  shift
  targets_in "$before" targets_before "$@"
  targets_in "$PWD" targets "$@"
}

# table_in TREE NAME ARGS...: TREE's attn bench auto-table, into $here/NAME_$mode (python -m
# puts the working folder first on sys.path: it runs from TREE)
table_in() {
  local tree=$1 name=$2 from=$PWD
  shift 2
  (cd "$tree" && python -m attn bench auto-table "$@" "${busy[@]}" --out "$from/$here/${name}_$mode")
}

# table_step ROUNDS NAME: float32, bfloat16 and float16 into $here/NAME_$mode, merged into the
# table (a --write keeps the busier run per cell)
table_step() {
  attn bench auto-table --dtype float32 bfloat16 float16 --rounds "$1" "${busy[@]}" \
    --out "$here/$2_$mode" --write "$table"
}

# forget [DTYPE CLASS]: this CPU kind's entry in the table, or one cell of it, so that the
# next --write measures it afresh
forget() {
  python - "$@" <<'PY'
import json, sys
from attn import choose
d = json.load(open("attn/auto_table.json"))
if len(sys.argv) == 1:
    d.pop(choose.cpu_kind(), None)
else:
    d[choose.cpu_kind()]["entries"][sys.argv[1]].pop(sys.argv[2], None)
open("attn/auto_table.json", "w").write(json.dumps(d, indent=1, sort_keys=True) + "\n")
PY
}

# memory_and_rate: fwd+bwd peak memory (profiler method, causal, float32) into $here/memory;
# with "rate", also the fraction of the dense matmul rate at N = 4096 and 16384 (auto, fused,
# tiled), quiet, into $here/matmul_fraction
memory_and_rate() {
  attn bench memory --n 1024 4096 16384 --backends tiled fused sdpa --mode fwd+bwd \
    --causal true --out "$here/memory"
  [ "${1:-}" = rate ] || return 0
  attn bench speed --paired --threads 2 --no-compiled --flex-max-n 0 --n 4096 16384 \
    --mode fwd --causal true --dtype float32 bfloat16 --repeats 3 --out "$here/matmul_fraction"
}
