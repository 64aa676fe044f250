"""Custom CUDA kernels (through ``mx.fast.cuda_kernel``), each with an MLX-ops fallback on other backends.

qmv: 4-bit quantized matrix-vector product for decode; fast_linear: the layer swap that puts it in a model.
"""

from .fast_linear import (FastQuantizedEmbedding, FastQuantizedLinear, enabled, maybe_use_fast_quantized_linear,
                          restore_quantized_linear, use_fast_quantized_linear)
from .qmv import quantized_matvec, supports

__all__ = ["FastQuantizedEmbedding", "FastQuantizedLinear", "enabled", "maybe_use_fast_quantized_linear",
           "quantized_matvec", "restore_quantized_linear", "supports", "use_fast_quantized_linear"]
