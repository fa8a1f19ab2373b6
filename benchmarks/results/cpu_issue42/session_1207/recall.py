"""The toy GPT's recall preset (scripts/train.py's defaults for task=recall, stopping at 99 %
accuracy as tests/test_train.py does) on each backend named: steps, accuracy, tokens/s.
Run from the checkout's root: python benchmarks/results/cpu_issue42/session_1207/recall.py
tiled fused auto"""
import sys
import tempfile
import time
from pathlib import Path

from attn.models.train import TrainConfig, train

for backend in sys.argv[1:]:
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        m = train(TrainConfig(task="recall", seed=0, stop_accuracy=0.99, steps=1500,
                              backend=backend), Path(d), progress=False)
    print(backend, "steps", m.get("steps"), "acc", m["accuracy"], "tok/s",
          round(m["tokens_per_s"]), "wall", round(time.perf_counter() - t, 1), flush=True)
