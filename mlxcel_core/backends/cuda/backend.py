"""CudaBackend: the backend seam (backends/base.py) as the CUDA wing fills it; backends.current() makes it.

Its kernels are imported with it, once: this module is imported only where the CUDA wing serves (and by its tests),
and the greedy readout and the paged attention are asked for every decode step."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from ..base import Backend
from . import kernels
from .graph_decode import GraphDecoder
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

    def compile_ahead(self):
        from ...paths import use_kernel_cache
        from .kernels.compile_ahead import collecting

        if not hasattr(mx.fast, "precompiled_cuda_kernel") or use_kernel_cache() is None:
            return None  # (the kernels are MLX's own, compiled in every process: nothing to compile ahead)
        return collecting()

    def mlx_modules_ahead(self, model):
        from ...paths import use_kernel_cache
        from . import mlx_jit_ahead

        directory = use_kernel_cache()
        if directory is None:
            return None
        return mlx_jit_ahead.start(directory, mlx_jit_ahead.modules_of(model))

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
