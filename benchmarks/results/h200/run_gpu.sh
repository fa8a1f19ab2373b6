#!/bin/bash
# one GPU call (issue 41/42/39 measurements); outputs under $OUT (<= 8 files)
set -x
python3 -m pip install -q -e . --no-deps --no-build-isolation 2>&1 | grep -v WARNING
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda)"
mkdir -p "$OUT/gc"
timeout 400 python3 -m attn gpu-check --out "$OUT/gc" --stages env fused-cuda speed varlen-decode --budget-min 6
rm -f "$OUT/gc/memory.png" "$OUT/gc/decode.png"
X="$OUT/extra.txt"
echo "== triton_jvp.py --n 4096 8192 16384 --reference-up-to 4096" >> "$X"
timeout 110 python3 benchmarks/experiments/triton_jvp.py --n 4096 8192 16384 --reference-up-to 4096 >> "$X" 2>&1
echo "== triton_jvp.py --per-sample 1024" >> "$X"
timeout 45 python3 benchmarks/experiments/triton_jvp.py --per-sample 1024 >> "$X" 2>&1
echo "== pytest tests/test_triton_transforms.py (compiled, CUDA)" >> "$X"
timeout 70 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_transforms.py >> "$X" 2>&1
cat "$X"
ls -la "$OUT" "$OUT/gc"
