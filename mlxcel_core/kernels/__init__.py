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
    """What load_model and build_random_model do to every built model: on CUDA, quantized layers MLX computes wrong
    routed around (mlx_workarounds.py); the decode kernels' layer swaps (MLXCEL_QMV, MLXCEL_HMV), then the fused
    decode projections (MLXCEL_FUSE), each where its gate allows."""
    from . import qmv
    from .fused_projections import maybe_fuse_projections
    from .mlx_workarounds import route_around_qmm_fault

    if qmv.cuda_kernel_available():
        route_around_qmm_fault(model)
    maybe_use_fast_quantized_linear(model)
    maybe_fuse_projections(model)


def describe_decode_kernels() -> str:
    """For benchmark headers: which decode kernels this process's models get."""
    from ..kv.cuda_paged_attention import describe_kv_writes
    from .fused_projections import fusion_enabled, norm_fusion_enabled, rope_fusion_enabled

    def on(flag: bool) -> str:
        return "on" if flag else "off"

    # A fold happens inside a fused projection's kernel launch: asked for without one, it does not happen.
    foldable = fusion_enabled() and (enabled() or half_kernel_state() != "off")

    def fold(what: str, asked: bool, env: str) -> str:
        if asked and not foldable:
            return f"{what} off ({env} on, but no fused projection on a CUDA matvec kernel to fold into)"
        return f"{what} {on(asked)} ({env})"

    return (f"fused q/k/v, gate/up and residual adds {on(fusion_enabled())} (MLXCEL_FUSE), "
            f"{fold('norms folded', norm_fusion_enabled(), 'MLXCEL_FUSE_NORM')}, "
            f"{fold('rope folded', rope_fusion_enabled(), 'MLXCEL_FUSE_ROPE')}, "
            f"4-bit matvec kernel {on(enabled())} (MLXCEL_QMV), "
            f"16-bit matvec kernel {half_kernel_state()} (MLXCEL_HMV), {describe_kv_writes()}")


def describe_decode_batches() -> str:
    """For benchmark headers: how decode batches and waiting prompts are computed."""
    from ..engine.types import prefill_batch_setting
    from . import fast_linear, hmv, qmm

    parts = []
    if enabled():  # (the 4-bit kernel's batch modes; without it MLX computes every batch)
        mode = fast_linear.BATCH_MODE + (f" ({'wide' if qmm.WIDE else 'narrow'} loads, MLXCEL_QMM_WIDE)"
                                         if fast_linear.BATCH_MODE == "mma" else "")
        parts.append(f"4-bit decode batches of 9+ rows: {mode} (MLXCEL_QMM_BATCH)")
    if half_kernel_state() != "off":
        rows = (f"up to {fast_linear.HALF_MAX_ROWS}" if fast_linear.HALF_MAX_ROWS else
                f"up to {hmv.MAX_ROWS} in models up to {fast_linear.HALF_ROWS_MAX_HIDDEN} wide, else 2")
        parts.append(f"16-bit kernel rows {rows} (MLXCEL_HMV_MAX_ROWS)")
    parts.append(f"waiting prompts prefilled together: up to {prefill_batch_setting()} (MLXCEL_PREFILL_BATCH)")
    return ", ".join(parts)


def half_kernel_state() -> str:
    """hmv.enabled in words: decided by MLXCEL_HMV, or by each model's hidden size where it is unset."""
    from . import hmv

    if hmv.enabled(0) == hmv.enabled(1 << 30):
        return "on" if hmv.enabled(0) else "off"
    return f"on for models up to {hmv.DEFAULT_MAX_HIDDEN} wide"
