"""Peak memory of one call: the method and its documented error live in :mod:`attn.timing`
(below every module that may measure); this module keeps their old import path."""

from attn.timing import CPU_ERROR_BYTES, peak_bytes

__all__ = ["CPU_ERROR_BYTES", "peak_bytes"]
