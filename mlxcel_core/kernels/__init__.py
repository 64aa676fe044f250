"""Custom CUDA kernels (through ``mx.fast.cuda_kernel``), each with an MLX-ops fallback on other backends.

qmv: 4-bit quantized matrix-vector product for decode; fast_linear: the layer swap that puts it in a model;
fused_projections: q/k/v and gate/up of a decode step as one matmul each.
"""

from .fast_linear import (FastQuantizedEmbedding, FastQuantizedLinear, enabled, maybe_use_fast_quantized_linear,
                          restore_quantized_linear, use_fast_quantized_linear)
from .qmv import quantized_matvec, supports

__all__ = ["FastQuantizedEmbedding", "FastQuantizedLinear", "enabled", "maybe_use_fast_quantized_linear",
           "quantized_matvec", "restore_quantized_linear", "supports", "use_fast_quantized_linear"]


def prepare_model(model) -> None:
    """What load_model and build_random_model do to every built model: the 4-bit decode kernel's layer swap
    (MLXCEL_QMV), then the fused decode projections (MLXCEL_FUSE), each where its gate allows."""
    from .fused_projections import maybe_fuse_projections

    maybe_use_fast_quantized_linear(model)
    maybe_fuse_projections(model)


def describe_decode_kernels() -> str:
    """For benchmark headers: which decode kernels this process's models get."""
    from .fused_projections import fusion_enabled

    return (f"fused q/k/v, gate/up and residual adds {'on' if fusion_enabled() else 'off'} (MLXCEL_FUSE), "
            f"4-bit matvec kernel {'on' if enabled() else 'off'} (MLXCEL_QMV)")
