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

On by default where the backend says so (a GPU: compile_enabled; EngineConfig.compile_decode decides otherwise).
Not compiled: quantized KV caches (kv_bits; their dequantization reads only the used columns), and dense
caches where attention with an array mask leaves MLX's fused kernel (CUDA: see CompiledDecoder.supports), which
costs more than compiling saves; dense caches of models with recurrent layers (their rows' states are not among
the dense trace's inputs). Over paged storage, such a model's step takes the state pool's arrays and the rows' slots
as inputs and returns the updated arrays (engine/state_pool.py).
"""

from __future__ import annotations

import weakref
from typing import Sequence

import mlx.core as mx

from .. import backends
from ..cache import KVCache
from ..models.base import CausalLM, has_recurrent_layers, kv_layout, scaled_dot_product_attention
from .paged import PagedStorage
from .paged_views import DecodeView
from .state_pool import StateView


def compile_enabled(requested: bool | None = None) -> bool:
    """Whether an engine compiles its decode steps: `requested` (EngineConfig.compile_decode), else the backend's
    default (on a GPU)."""
    return requested if requested is not None else backends.current().compile_by_default()


def dense_mask_is_slow() -> bool:
    """Whether dense decode steps stay op by op (see CompiledDecoder.supports)."""
    return backends.current().dense_mask_is_slow()


def describe_decode_steps() -> str:
    """For benchmark headers: how this process's engines build decode steps by default."""
    graph = ", a lone greedy row's steps replayed as one recorded graph" if backends.current().name == "cuda" else ""
    return ("compiled where supported" if compile_enabled() else "op by op (the default on CPU)") + graph


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

    def attend(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: mx.array | None = None,
        values_in_keys: int | None = None,
        chunk: int | None = None,
    ) -> mx.array:
        """`values_in_keys` n: the values are keys[..., :n] (the value buffer has width 0), as KVCache.attend;
        `chunk`: only the keys of the row's own chunk of positions are visible (causal_mask)."""
        if keys.shape[2] != 1:
            raise ValueError("StepKV holds one new token per row")
        self.keys = mx.slice_update(self.keys, keys, self.column, axes=(2,))
        if values_in_keys is None:
            self.values = mx.slice_update(self.values, values, self.column, axes=(2,))
        columns = mx.arange(self.keys.shape[2])
        visible = mx.logical_and(columns <= self.column, columns[None] >= self.left_padding[:, None])
        if window is not None:  # as causal_mask: a query sees keys with q - k < window
            visible = mx.logical_and(visible, columns > self.column - window)
        if chunk is not None:  # the row's chunk starts at its first real column + a multiple of `chunk`
            start = self.left_padding + self.offset // chunk * chunk
            visible = mx.logical_and(visible, columns[None] >= start[:, None])
        mask = visible[:, None, None, :]
        values = self.values if values_in_keys is None else self.keys[..., :values_in_keys]
        return scaled_dot_product_attention(queries, self.keys, values, scale, mask, softcap, sinks)

    def attend_stored(
        self, queries: mx.array, scale: float, window: int | None = None, softcap: float | None = None
    ) -> mx.array:
        """LayerCache.attend_stored: the buffers as this step's `attend` left them, masked as it masks them."""
        columns = mx.arange(self.keys.shape[2])
        visible = mx.logical_and(columns <= self.column, columns[None] >= self.left_padding[:, None])
        if window is not None:
            visible = mx.logical_and(visible, columns > self.column - window)
        return scaled_dot_product_attention(queries, self.keys, self.values, scale, visible[:, None, None, :], softcap)


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
        self.paged_states = mx.compile(self._paged_states_forward)
        self.storage: PagedStorage | None = None  # the storage a paged trace runs against (set before each call)
        self.traced = 0  # how often a step function's Python body ran, i.e. traces made

    @property
    def model(self) -> CausalLM:
        return self._model()

    def _dense_forward(
        self, tokens: mx.array, column: mx.array, left_padding: mx.array, keys: list[mx.array], values: list[mx.array]
    ):
        """`keys` / `values`: each layer's buffers, None for a layer that stores nothing (a KV-shared layer)."""
        self.traced += 1
        caches = [None if k is None else StepKV(k, v, column, left_padding) for k, v in zip(keys, values)]
        logits = self.model(tokens[:, None], caches)[:, -1, :]
        return logits, [c and c.keys for c in caches], [c and c.values for c in caches]

    def _paged_forward(
        self,
        tokens: mx.array,
        slot_blocks: mx.array,
        slot_offsets: mx.array,
        block_tables: mx.array,
        positions: mx.array,
        context_lens: mx.array,
        pools: list[list[mx.array]],
    ):
        logits, pools, _ = self._paged_step(
            tokens, slot_blocks, slot_offsets, block_tables, positions, context_lens, pools
        )
        return logits, pools

    def _paged_states_forward(self, *inputs, state_slots: mx.array, states: list[list[mx.array] | None]):
        """A paged step of a model with recurrent layers: `states` are the state pool's arrays (None where a layer
        keeps none), `state_slots` [B] the rows' slots; returns the updated arrays too."""
        return self._paged_step(*inputs, state_slots=state_slots, states=states)

    def _paged_step(
        self,
        tokens: mx.array,
        slot_blocks: mx.array,
        slot_offsets: mx.array,
        block_tables: mx.array,
        positions: mx.array,
        context_lens: mx.array,
        pools: list[list[mx.array]],
        state_slots: mx.array | None = None,
        states: list[list[mx.array] | None] | None = None,
    ):
        self.traced += 1
        storage = self.storage
        state_pool = storage.states if states is not None else None
        # The views write into these (None: a layer that stores nothing, a KV-shared layer's).
        kept, storage.pools = storage.pools, [None if p is None else list(p) for p in pools]
        kept_writes, storage.written_in_place = storage.written_in_place, []  # the trace's are tracers: dropped
        if state_pool is not None:
            kept_states, state_pool.arrays = state_pool.arrays, [None if a is None else list(a) for a in states]
        try:
            views = [
                DecodeView(storage, layer, (slot_blocks, slot_offsets), block_tables, positions, context_lens)
                for layer in range(len(pools))
            ]
            if state_pool is not None:
                views = [
                    StateView(state_pool, layer, state_slots, False, None, positions) if recurrent else view
                    for layer, (view, recurrent) in enumerate(zip(views, state_pool.recurrent))
                ]
            logits = self.model(tokens[:, None], views)[:, -1, :]
            return logits, storage.pools, (state_pool.arrays if state_pool is not None else None)
        finally:
            storage.pools, storage.written_in_place = kept, kept_writes
            if state_pool is not None:
                state_pool.arrays = kept_states


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
        # Per layer, whether its cache stores keys (a KV-shared layer's stays empty: it reads another layer's).
        self.stores = [layout is not None for layout in kv_layout(model)]
        # A model with recurrent layers (base.state_layout): its dense steps run op by op (module docstring).
        self.recurrent = has_recurrent_layers(model)

    def supports(self, caches: Sequence[object]) -> bool:
        views = [c for c in caches if not isinstance(c, StateView)]
        if views and all(isinstance(c, DecodeView) for c in views):
            storage = views[0].storage
            states = storage.states
            ready = states is None or all(a is not None for a, r in zip(states.arrays, states.recurrent) if r)
            pools = all(p is not None for p, s in zip(storage.pools, self.stores) if s)
            return storage.kv_bits is None and ready and pools
        if self.recurrent:
            return False
        # Dense steps attend through a mask, and with an array mask MLX's CUDA attention leaves its fused
        # decode kernel: on the H200 that cost more than compiling saved on an 8B 4-bit model (0.86x).
        return not dense_mask_is_slow() and all(
            isinstance(c, KVCache) and c.kv_bits is None and (c.columns > 0 or not s)
            for c, s in zip(caches, self.stores)
        )

    def decode(self, tokens: mx.array, caches: Sequence[KVCache] | Sequence[DecodeView]) -> mx.array:
        """`tokens` [B] -> logits [B, V]; every row's cache gains its token."""
        logits = (
            self._decode_paged(tokens, caches)
            if isinstance(caches[0], (DecodeView, StateView))
            else self._decode_dense(tokens, caches)
        )
        self.steps += 1
        return logits

    def _decode_dense(self, tokens: mx.array, caches: Sequence[KVCache]) -> mx.array:
        stored = [cache if stores else None for cache, stores in zip(caches, self.stores)]  # None: stays empty
        for cache in filter(None, stored):
            cache.reserve(1)
        first = caches[0]
        rows = first.keys.shape[0]
        padding = mx.zeros((rows,), mx.int32) if first.left_padding is None else first.left_padding.astype(mx.int32)
        logits, keys, values = self.traces.dense(
            tokens,
            mx.array([first.columns], mx.int32),
            padding,
            [c and c.keys for c in stored],
            [c and c.values for c in stored],
        )
        for cache, k, v in zip(stored, keys, values):
            if cache is not None:
                cache.keys, cache.values = k, v  # the old buffers are only the graph's now: MLX updates them in place
                cache.columns += 1
        return logits

    def _decode_paged(self, tokens: mx.array, views: Sequence[DecodeView]) -> mx.array:
        view = next(v for v in views if isinstance(v, DecodeView))
        self.traces.storage = view.storage
        inputs = (tokens, *view.slots, view.block_tables, view.offset, view.context_lens)
        states = view.storage.states
        if states is None:
            logits, pools = self.traces.paged(*inputs, view.storage.pools)
        else:  # recurrent layers: the state pool's arrays in and out, the rows' slots in
            slots = next(v.slots for v in views if isinstance(v, StateView))
            logits, pools, states.arrays = self.traces.paged_states(
                *inputs, view.storage.pools, state_slots=slots, states=states.arrays
            )
            states.replaced()
        view.storage.pools = pools  # as in the dense case, the old pools are updated in place
        view.storage.pools_version += 1
        # Its attention kernels may have written the pools in place: later pool updates wait for it (paged.py).
        view.storage.written_in_place.append(logits)
        return logits
