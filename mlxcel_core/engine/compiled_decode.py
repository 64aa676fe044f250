"""Decode steps as one compiled MLX graph (mx.compile), over dense or paged KV storage.

Building a step's graph in Python costs ~90 µs per transformer layer (every module call and op goes through
Python), which at batch 1 on a fast GPU is as long as the GPU's own work. Compiled, the whole step (every
layer, its KV writes and attention, the LM head) is one call: MLX replays the traced graph in C++ and fuses
its elementwise ops.

A compiled function needs fixed shapes, so inside it the caches are the whole preallocated buffers
(cache.KVCache's capacity, grown in steps outside the compiled call) and the position is an array:
`StepKV` writes the new keys/values at column `column` with a dynamic slice update and attends over the
whole buffer with a mask (columns <= `column`, minus each row's left padding and what is outside a
sliding window). Each new capacity or batch size traces once; the traces are kept per model
(StepTraces), so a new engine on the same model does not trace again.

Paged storage (engine/paged.py) already passes positions, slots and block tables as arrays and attends with
its own kernel, so its decode views run inside the compiled step as they are; the storage pads block
tables to a power-of-two width so one trace serves many steps.

On by default only where MLX runs on a GPU (compile_enabled; MLXCEL_COMPILE=1 forces it, =0 turns it off).
Not compiled: quantized KV caches (kv_bits; their dequantization reads only the used columns), and dense
caches when MLX runs on CUDA (see CompiledDecoder.supports). Measured on the H200 (benchmarks/RESULTS.md),
engine decode at batch 8 on paged storage: Llama-3.2-1B shape 1.24x, 8B 4-bit shape unchanged; dense on CUDA
was 0.86x on the 8B 4-bit shape, hence not compiled there.
"""

from __future__ import annotations

import os
import weakref
from typing import Sequence

import mlx.core as mx

from ..cache import KVCache
from ..kv.cuda_paged_attention import cuda_kernel_available
from ..models.base import CausalLM, scaled_dot_product_attention
from .launcher import ENV as LAUNCH_ENV, launch_thread_requested
from .paged import DecodeView, PagedStorage

ENV = "MLXCEL_COMPILE"  # "1": compile decode steps, "0": build them op by op; unset: EngineConfig decides
DENSE_MASK_IS_SLOW = cuda_kernel_available  # MLX runs on CUDA (see CompiledDecoder.supports)


def compile_enabled(requested: bool | None = None) -> bool:
    """Whether an engine compiles its decode steps: MLXCEL_COMPILE=1/0 decides; else `requested`
    (EngineConfig.compile_decode); None: only when MLX runs on a GPU. On CPU it gained nothing on real models
    (compute-bound) and a machine's first run JIT-compiles the fused kernels (~10 s for SmolLM2)."""
    env = os.environ.get(ENV, "").strip()
    if env in ("0", "1"):
        return env == "1"
    if requested is not None:
        return requested
    return mx.default_device().type == mx.DeviceType.gpu


def describe_decode_steps() -> str:
    """For benchmark headers: how this process's engines build decode steps by default."""
    from ..kv.cuda_paged_attention import cuda_kernel_available
    from .graph_decode import ENV as GRAPH_ENV
    from .graph_decode import asked_for as graph_asked_for
    from .graph_decode import enabled as graph_enabled

    graph = ""
    if graph_enabled() and cuda_kernel_available():
        graph = f", a lone greedy row's steps replayed as one CUDA graph ({GRAPH_ENV}=0 turns it off)"
    elif graph_asked_for():
        graph = f" ({GRAPH_ENV}=1 applies on CUDA only)"
    if compile_enabled():
        threaded = launch_thread_requested()
        launcher = f", paged steps handed to MLX on a launcher thread ({LAUNCH_ENV}=1)" if threaded else ""
        return "compiled where supported" + launcher + graph
    env = os.environ.get(ENV, "").strip()
    return (f"op by op ({ENV}={env})" if env == "0" else f"op by op (the default on CPU; {ENV}=1 compiles)") + graph


class StepKV:
    """The LayerCache a layer sees inside the compiled step: one whole [B, H, capacity, D] buffer pair."""

    def __init__(self, keys: mx.array, values: mx.array, column: mx.array, left_padding: mx.array):
        self.keys, self.values = keys, values
        self.column = column  # int32 [1]: the column this token is written at (shared by every row)
        self.left_padding = left_padding  # int32 [B]

    @property
    def offset(self) -> mx.array:
        """Each row's position: its column minus its left padding, as cache.KVCache.offset."""
        return self.column - self.left_padding

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float,
               window: int | None = None, softcap: float | None = None) -> mx.array:
        if keys.shape[2] != 1:
            raise ValueError("StepKV holds one new token per row")
        self.keys = mx.slice_update(self.keys, keys, self.column, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.column, axes=(2,))
        columns = mx.arange(self.keys.shape[2])
        visible = mx.logical_and(columns <= self.column, columns[None] >= self.left_padding[:, None])
        if window is not None:  # as causal_mask: a query sees keys with q - k < window
            visible = mx.logical_and(visible, columns > self.column - window)
        return scaled_dot_product_attention(queries, self.keys, self.values, scale, visible[:, None, None, :],
                                            softcap)


class StepTraces:
    """The compiled decode-step functions of one model, shared by every engine on it (`step_traces`).

    mx.compile traces a function once per input shapes and keeps the traces with the function object, so an
    engine with functions of its own would trace again, inside its first request's time to first token. The model
    is held weakly (the traces must not keep it alive). What changes the model's computation without changing its
    inputs (fusing projections, swapping layer classes) calls `forget_traces`."""

    def __init__(self, model: CausalLM):
        self._model = weakref.ref(model)
        self.dense = mx.compile(self._dense_forward)
        self.paged = mx.compile(self._paged_forward)
        self.storage: PagedStorage | None = None  # the storage a paged trace runs against (set before each call)
        self.traced = 0  # how often a step function's Python body ran, i.e. traces made
        self.paged_shapes: set[tuple] = set()  # the paged inputs' shapes and dtypes traced so far (replays)

    @property
    def model(self) -> CausalLM:
        return self._model()

    def _dense_forward(self, tokens: mx.array, column: mx.array, left_padding: mx.array,
                       keys: list[mx.array], values: list[mx.array]):
        self.traced += 1
        caches = [StepKV(k, v, column, left_padding) for k, v in zip(keys, values)]
        logits = self.model(tokens[:, None], caches)[:, -1, :]
        return logits, [c.keys for c in caches], [c.values for c in caches]

    def _paged_forward(self, tokens: mx.array, slot_blocks: mx.array, slot_offsets: mx.array, block_tables: mx.array,
                       positions: mx.array, context_lens: mx.array, pools: list[list[mx.array]]):
        self.traced += 1
        storage = self.storage
        kept, storage.pools = storage.pools, [list(p) for p in pools]  # the views write into these
        kept_writes, storage.written_in_place = storage.written_in_place, []  # the trace's are tracers: dropped
        try:
            views = [DecodeView(storage, layer, (slot_blocks, slot_offsets), block_tables, positions, context_lens)
                     for layer in range(len(pools))]
            logits = self.model(tokens[:, None], views)[:, -1, :]
            return logits, storage.pools
        finally:
            storage.pools, storage.written_in_place = kept, kept_writes


_TRACES: dict[int, StepTraces] = {}  # id(model) -> its StepTraces; an entry goes when its model does


def step_traces(model: CausalLM) -> StepTraces:
    """The model's shared StepTraces (made on first use)."""
    traces = _TRACES.get(id(model))
    if traces is None or traces.model is not model:
        traces = _TRACES[id(model)] = StepTraces(model)
        weakref.finalize(model, _TRACES.pop, id(model), None)
    return traces


def forget_traces(model) -> None:
    """Drop the model's traces: the next compiled step traces what the model computes now."""
    _TRACES.pop(id(model), None)


class CompiledDecoder:
    """`decode(tokens, caches)`: one decode step of `model` through one compiled graph, over dense caches
    (cache.KVCache) or a PagedStorage's decode views (whose positions, slots and block tables are already
    arrays; the storage pads block tables to a power-of-two width so a trace serves many steps). One per engine;
    the traces are the model's (`step_traces`) unless `traces` is given."""

    def __init__(self, model: CausalLM, traces: StepTraces | None = None):
        self.model = model
        self.traces = traces or step_traces(model)
        self.steps = 0  # decode steps this engine ran compiled

    @staticmethod
    def supports(caches: Sequence[object]) -> bool:
        if all(isinstance(c, DecodeView) for c in caches):
            storage = caches[0].storage
            return storage.kv_bits is None and all(p is not None for p in storage.pools)
        # Dense steps attend through a mask, and with an array mask MLX's CUDA attention leaves its fused
        # decode kernel: on the H200 that cost more than compiling saved on an 8B 4-bit model (0.86x).
        return not DENSE_MASK_IS_SLOW() and all(
            isinstance(c, KVCache) and c.kv_bits is None and c.columns > 0 for c in caches)

    def decode(self, tokens: mx.array, caches: Sequence[KVCache] | Sequence[DecodeView],
               before_trace=None) -> mx.array:
        """`tokens` [B] -> logits [B, V]; every row's cache gains its token. `before_trace`: called first when
        this call will trace (run the model's Python, which may evaluate) rather than replay a paged trace."""
        logits = self._decode_paged(tokens, caches, before_trace) if isinstance(caches[0], DecodeView) else \
            self._decode_dense(tokens, caches, before_trace)
        self.steps += 1
        return logits

    def _decode_dense(self, tokens: mx.array, caches: Sequence[KVCache], before_trace=None) -> mx.array:
        if before_trace is not None:  # (replays are not told apart here: threaded engines decode paged only)
            before_trace()
        for cache in caches:
            cache.reserve(1)
        first = caches[0]
        rows = first.keys.shape[0]
        padding = mx.zeros((rows,), mx.int32) if first.left_padding is None else first.left_padding.astype(mx.int32)
        logits, keys, values = self.traces.dense(tokens, mx.array([first.columns], mx.int32), padding,
                                                 [c.keys for c in caches], [c.values for c in caches])
        for cache, k, v in zip(caches, keys, values):
            cache.keys, cache.values = k, v  # the old buffers are only the graph's now: MLX updates them in place
            cache.columns += 1
        return logits

    def _decode_paged(self, tokens: mx.array, views: Sequence[DecodeView], before_trace=None) -> mx.array:
        view = views[0]
        self.traces.storage = view.storage
        inputs = (tokens, *view.slots, view.block_tables, view.offset, view.context_lens)
        if before_trace is not None:
            # What mx.compile keys its traces on: the inputs' shapes and dtypes (the pools grow by doubling), and
            # the stream the step is built on (a threaded engine's is its launcher's). Recorded for these calls only
            # (tens of microseconds at 1B that an inline step need not spend): a shape first seen elsewhere just
            # waits once more.
            shapes = (str(mx.default_stream(mx.default_device())),
                      *((a.shape, a.dtype) for a in (*inputs, *(p for layer in view.storage.pools for p in layer))))
            if shapes not in self.traces.paged_shapes:
                before_trace()
                self.traces.paged_shapes.add(shapes)
        logits, pools = self.traces.paged(*inputs, view.storage.pools)
        view.storage.pools = pools  # as in the dense case, the old pools are updated in place
        view.storage.pools_version += 1
        # Its attention kernels may have written the pools in place: later pool updates wait for it (paged.py).
        view.storage.written_in_place.append(logits)
        return logits
