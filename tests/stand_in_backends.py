"""A stand-in for a backend with its own paged decode kernel (as CUDA has), runnable on the CPU: tests swap it in by
monkeypatching `backends._current` and see which decode calls take the kernel and which the portable path.

Imported by tests as `from stand_in_backends import with_kernel` (a plain module, as tiny_models)."""

from __future__ import annotations

from mlxcel_core.backends.base import Backend
from mlxcel_core.backends.cuda.backend import CudaBackend
from mlxcel_core.kv.paged_attention import RUNNER_OPS, paged_decode_attention


def with_kernel(calls: list):
    """A backend with a decode kernel of its own (as CUDA has), writing the step's keys and values in place; the kernel
    and the portable path record their calls."""

    def kernel(q, k_pool, v_pool, tables, lens, num_splits=1, scale=None, new_kv=None, counters=None, **limits):
        """`limits`: window, chunk and sinks, as the CUDA kernel takes them (recorded where given)."""
        calls.append(("kernel", {name: value for name, value in limits.items() if value is not None}))
        if new_kv is not None:
            k, v, blocks, offsets = new_kv
            k_pool[blocks, offsets] = k
            v_pool[blocks, offsets] = v
        return paged_decode_attention(q, k_pool, v_pool, tables, lens, num_splits=num_splits, scale=scale, **limits)

    def portable(*args, **kwargs):
        calls.append(("ops", kwargs))
        return paged_decode_attention(*args, **kwargs)

    class StandIn(Backend):  # as the CUDA backend's paged decode is, with a kernel that runs here
        kv_written_in_kernel = True
        combine_counters = CudaBackend.combine_counters

        def paged_runner(self, head_dim):
            return "cuda-kernel-stand-in"

        def paged_attention(self, runner):
            return portable if runner == RUNNER_OPS else kernel

    return StandIn()
