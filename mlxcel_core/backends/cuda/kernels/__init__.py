"""The CUDA wing's kernels (through ``mx.fast.cuda_kernel`` and the kernel cache), each with an MLX-ops fallback.

qmv / qmm / hmv: 4-bit and 16-bit matrix-vector (and small-batch matrix) products for decode; fast_linear: the layer
swaps that put them in a model; fused_projections: q/k/v and gate/up of a decode step as one launch each, with the
block's norm and RoPE folded in; greedy: a step's argmax and NaN readout; qembedding: the embedding lookup;
delta_net: a gated delta-net layer's decode step, its state updated in place; rms_norm: the final norm while a step
is recorded; mlx_workarounds: layers MLX's CUDA kernels compute wrong, routed around; cubin_cache / cuda_driver:
compiled kernels kept on disk and launched by the driver (graph replay).
"""

from __future__ import annotations


def prepare_model(model) -> None:
    """What the CUDA backend does to every built model, in order: the layers MLX's CUDA kernels compute wrong
    (quantized_matmul at K == group size) or unreliably (float experts' sorted gather_mm) routed around; the decode
    kernels' layer swaps (gated delta-nets' decode steps: delta_net.py); then, where MLX computes on the GPU, the
    fused decode projections; and the final norm made recordable for the decode-step graph."""
    from mlxcel_core.backends.base import on_gpu

    from . import qmv
    from .delta_net import use_delta_net_kernels
    from .fast_linear import maybe_use_fast_quantized_linear
    from .fused_projections import fuse_projections
    from .mlx_workarounds import route_around_qmm_fault, route_around_sorted_gather_race
    from .rms_norm import make_final_norm_recordable

    if qmv.cuda_kernel_available():  # (the fault is CUDA's; tests prepare through this backend on any machine)
        route_around_qmm_fault(model)
        route_around_sorted_gather_race(model)
        use_delta_net_kernels(model)
    maybe_use_fast_quantized_linear(model)
    if on_gpu():  # (a matmul's launch is what fusing saves: nothing worth a copy of the weights on the CPU)
        fuse_projections(model)
    make_final_norm_recordable(model)


def unprepare_model(model) -> None:
    """Undo what prepare_model did that changes parameters' layout or classes a requantization must see plainly:
    the fused projections (their fused arrays would keep serving decode inputs) and the decode kernels' swaps."""
    from .delta_net import restore_delta_net
    from .fast_linear import restore_quantized_linear
    from .fused_projections import unfuse_projections

    unfuse_projections(model)
    restore_quantized_linear(model)
    restore_delta_net(model)


def describe_decode_kernels() -> str:
    """For benchmark headers: what the CUDA wing runs."""
    from . import hmv, qmv

    return (
        f"CUDA kernels: 4-bit matvecs up to {qmv.MAX_ROWS} rows (tensor-core matmul beyond; a prompt's as 16-bit "
        "GEMMs), 16-bit matvecs in "
        f"models up to {hmv.DEFAULT_MAX_HIDDEN} wide, fused q/k/v and gate/up with the norm and RoPE folded in, "
        "paged attention writing the step's KV in place"
    )
