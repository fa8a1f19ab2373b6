"""Wall-clock timing: the primitives live in :mod:`attn.timing` (below every module that may
measure); this module keeps their old import path."""

from attn.timing import Timing, benchmark, median_ratio, paired, synchronize

__all__ = ["Timing", "benchmark", "median_ratio", "paired", "synchronize"]
