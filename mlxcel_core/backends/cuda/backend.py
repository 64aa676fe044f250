"""CudaBackend: the backend seam (backends/base.py) as the CUDA wing fills it; backends.current() makes it.

Its kernels are imported with it, once: this module is imported only where the CUDA wing serves (and by its tests),
and the greedy readout and the paged attention are asked for every decode step."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import mlx.core as mx

from ..base import Backend
from . import kernels
from .graph_decode import GraphDecoder, module_arrays
from .kernels.greedy import greedy_tokens, masked_greedy_tokens
from .kernels.qmv import MAX_ROWS
from .paged_attention import COUNTERS, decode_attention_for, runner_for


class CudaBackend(Backend):
    name = "cuda"

    def prepare_model(self, model) -> None:
        kernels.prepare_model(model)

    def unprepare_model(self, model) -> None:
        kernels.unprepare_model(model)

    def greedy_tokens(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        return greedy_tokens(logits)

    def kernel_compiles(self) -> tuple[int, float]:
        from .kernels.cubin_cache import COMPILES

        return COMPILES.variants, COMPILES.seconds

    def compile_ahead(self, model=None):
        from ...paths import use_kernel_cache

        if not hasattr(mx.fast, "precompiled_cuda_kernel") or use_kernel_cache() is None:
            return None  # (the kernels are MLX's own, compiled in every process: nothing to compile ahead)
        return _dry_run(model)

    def mlx_modules_ahead(self, model):
        from ...paths import mlx_kernel_dir
        from . import mlx_jit_ahead

        directory = mlx_kernel_dir()
        if directory is None:
            return None
        return mlx_jit_ahead.start(directory, mlx_jit_ahead.modules_of(model))

    def mlx_modules_early(self, checkpoint) -> int:
        from ...paths import mlx_kernel_dir
        from . import mlx_jit_ahead

        directory = mlx_kernel_dir()
        if directory is None or not hasattr(mx.fast, "precompiled_cuda_kernel"):
            return 0  # (no warm-up ahead to adopt them: compile_ahead)
        return mlx_jit_ahead.start_early(directory, mlx_jit_ahead.checkpoint_modules(checkpoint))

    def in_dry_run(self) -> bool:
        from .kernels.compile_ahead import active

        return active()

    def masked_greedy_tokens(self, logits: mx.array, bitmask: mx.array) -> tuple[mx.array, mx.array]:
        return masked_greedy_tokens(logits, bitmask)

    def own_step_inputs(self, packed: mx.array) -> mx.array:
        # One copy made by the GPU, so every layer's kernels read memory the GPU wrote: reading the host-written
        # array itself, rope and the KV scatter ran slower per call.
        return packed + 0

    def paged_runner(self, head_dim: int) -> str:
        return runner_for(head_dim)

    def paged_attention(self, runner: str) -> Callable:
        return decode_attention_for(runner)

    @property
    def kv_written_in_kernel(self) -> bool:
        return True

    def combine_counters(self, num_layers: int) -> list[mx.array | None]:
        # Made outside any compiled trace, so a trace captures the same arrays for every step, and evaluated in one
        # call (one host sync, not one a layer inside the first prefill).
        counters = [mx.zeros((COUNTERS,), mx.int32) for _ in range(num_layers)]
        mx.eval(counters)
        return counters

    def graph_decoder(self, model, storage, open_rows: Callable[[int], bool]):
        return GraphDecoder(model, storage, open_rows=open_rows)

    def dense_mask_is_slow(self) -> bool:
        return True

    def warmup_rows(self) -> int:
        return MAX_ROWS

    def describe(self) -> str:
        return kernels.describe_decode_kernels()


@contextmanager
def _dry_run(model):
    """compile_ahead's context: collecting (kernels/compile_ahead.py) with the final norm as the graph recording runs
    it, and, after the dry run, a launch of each variant of the address kernel the recording reads arrays with (the
    model's dtypes and the steps' own): the warm-up proper records a graph, and would otherwise compile them one at
    a time on the serving thread (kernels/cuda_driver.py `address_variants`)."""
    from .kernels.compile_ahead import collecting
    from .kernels.cuda_driver import address_variants
    from .kernels.rms_norm import final_norm_as_kernel

    with collecting() as ahead, final_norm_as_kernel():
        yield ahead
        if mx.cuda.is_available():
            address_variants([a.dtype for a in module_arrays(model)] if model is not None else [])
