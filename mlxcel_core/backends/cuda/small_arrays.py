"""Arrays a CUDA kernel reads must not be tiny: what every decode kernel's inputs follow.

MLX 0.32's CUDA allocator keeps arrays of <= 8 bytes in the shared managed-memory pages of one small-block pool
(mlx/backend/cuda/allocator.cpp), into which the host writes for every small array it makes. A kernel reading such
an array stalls: the paged-decode kernel and the 4-bit q/k/v launch took about twice as long a call while they read a
4-byte context length, scale, epsilon or position (benchmarks/archive/RESULTS-history.md). So:
- a per-step int or float array a kernel reads is made at least MIN_ELEMENTS 4-byte elements long (16 bytes), and
  the kernel reads a view of it (engine/step_inputs.py, kernels/rope_fold.py's fold_positions);
- a constant (a softmax scale, a norm's epsilon) is a template int of the kernel: its float32 bits (float32_bits).
"""

from __future__ import annotations

import struct

MIN_ELEMENTS = 4  # 4-byte elements: 16 bytes, more than the allocator's 8-byte small blocks


def float32_bits(value: float) -> int:
    """A float's float32 bits as an int, for a kernel's template constant (read back with __int_as_float)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]
