"""Recurrent state beside the paged KV pools: one slot per admitted sequence in every recurrent layer's state arrays.

A recurrent layer (gated delta-net, short convolution, Mamba: models.base.RecurrentCache) keeps a fixed-size state per
sequence instead of keys and values. `StatePool` holds, per such layer, one array per state part, [slots, ...]; an
admitted sequence takes a slot at its first forward (its first prompt chunk: by then the engine has freed the rows
that ended or were cancelled in the step that admitted it) and gives it back when it ends or is cancelled
(`release`).
The paged storage hands each recurrent layer a `StateView` over the rows' slots instead of a KV view: it reads the
rows' state (or None, zeros, on a sequence's first tokens) and writes the new state back into the slots, so a prompt
prefilled in chunks carries its state from chunk to chunk, and a decode step serves rows of any lengths.

A backend's decode kernel may instead read and update the rows' slots in the pool's arrays themselves
(`StateView.in_place`), as the CUDA paged attention writes keys and values: no gather, no scatter, and no copy of a
whole array when MLX cannot reuse its buffer. MLX sees those arrays as the launch's inputs only, so the launch's
output goes to the storage's in-place writes (`wrote_in_place`), which it submits before any later update of the
pools (engine/paged.py); an update of the arrays (`write`) is a new array, so an array kept earlier (a speculative
checkpoint's) is changed in place only in the slots of rows that decode meanwhile, never in its own row's.

A state holds exactly the tokens it has seen: it cannot be cut back. So a model with recurrent layers reuses a cached
prefix only where a copy of the state at its end was kept (`copy` and `load`; engine/state_snapshots.py), and
speculative decoding takes rejected draft tokens back by going back to a checkpoint of the slot
(engine/recurrent_rollback.py).
"""

from __future__ import annotations

import mlx.core as mx

from .step_inputs import int_views


class StatePool:
    def __init__(self, recurrent: list[bool], slots: int, wrote_in_place=None):
        """`recurrent`: per layer, whether it keeps a state; `slots`: sequences held at once (the batch limit);
        `wrote_in_place(array)`: the storage's record of a launch that updated the arrays in place."""
        self.recurrent = recurrent
        self.wrote_in_place = wrote_in_place or (lambda array: None)
        self.num_slots = slots
        self.arrays: list[list[mx.array] | None] = [None] * len(recurrent)  # made at a layer's first write
        self.versions = [0] * len(recurrent)  # per layer, counts the forwards that changed its state
        self._free = list(range(slots))
        self.slot_of: dict[int, int] = {}

    def slot(self, seq_id: int) -> int:
        """The sequence's slot, taken from the free ones at its first call."""
        if seq_id not in self.slot_of:
            if not self._free:
                raise RuntimeError(f"no recurrent state slot left ({self.num_slots} sequences hold them)")
            self.slot_of[seq_id] = self._free.pop(0)
        return self.slot_of[seq_id]

    def release(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)
            self._free.sort()

    @property
    def in_use(self) -> int:
        return len(self.slot_of)

    def copy(self, seq_id: int) -> list[list[mx.array] | None]:
        """A copy of the sequence's state (per layer, its parts [1, ...]; None where a layer keeps none), submitted
        for evaluation: it holds no reference to the pool's arrays."""
        rows = mx.array([self.slot_of[seq_id]], mx.int32)
        copied = [None if parts is None else [mx.take(a, rows, axis=0) for a in parts] for parts in self.arrays]
        mx.async_eval([a for parts in copied if parts for a in parts])
        return copied

    def load(self, seq_id: int, state: list[list[mx.array] | None]) -> None:
        """The sequence's slot (taken now if it has none) set to `state`, a `copy`."""
        rows = mx.array([self.slot(seq_id)], mx.int32)
        for layer, parts in enumerate(state):
            if parts is not None:
                self.write(layer, rows, parts)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for parts in self.arrays if parts for a in parts)

    def views(self, caches: list, seq_ids, fresh: bool, padding: mx.array | None = None) -> list:
        """`caches` (the storage's per-layer views for these rows) with each recurrent layer's replaced by a
        StateView over the rows' slots; `fresh`: the rows start from zeros (their prompts' first tokens); `padding`:
        the rows' left padding in this forward's inputs (prompts prefilled together)."""
        (slots,) = int_views([self.slot(s) for s in seq_ids])  # (a kernel may read it: not a tiny array)
        return [
            StateView(self, layer, slots, fresh, padding, getattr(cache, "offset", 0)) if recurrent else cache
            for layer, (cache, recurrent) in enumerate(zip(caches, self.recurrent))
        ]

    def replaced(self) -> None:
        """Every recurrent layer's state changed (a compiled step's arrays came back)."""
        self.versions = [v + 1 for v in self.versions]

    def write(self, layer: int, slots: mx.array, state: list[mx.array]) -> None:
        self.versions[layer] += 1
        if self.arrays[layer] is None:
            self.arrays[layer] = [mx.zeros((self.num_slots, *part.shape[1:]), part.dtype) for part in state]
        updated = []
        for array, part in zip(self.arrays[layer], state):
            array = array[...]  # a new array: the assignment leaves arrays an earlier step read untouched
            array[slots] = part.astype(array.dtype)
            updated.append(array)
        self.arrays[layer] = updated


class StateView:
    """models.base.RecurrentCache over some rows' slots of one recurrent layer."""

    def __init__(self, pool: StatePool, layer: int, slots: mx.array, fresh: bool, padding: mx.array | None, offset=0):
        self.pool, self.layer, self.slots, self.fresh = pool, layer, slots, fresh
        self._padding = padding
        self.offset = offset  # the rows' positions, as the storage's KV views give them (recurrent layers read none)

    @property
    def state(self) -> list[mx.array]:
        return self.pool.arrays[self.layer] or []

    def recurrent_state(self) -> list[mx.array] | None:
        if self.fresh or self.pool.arrays[self.layer] is None:
            return None
        return [array[self.slots] for array in self.pool.arrays[self.layer]]

    def update_state(self, state: list[mx.array], length: int) -> None:
        self.pool.write(self.layer, self.slots, state)

    def in_place(self) -> tuple[list[mx.array], mx.array] | None:
        """(the layer's state arrays [slots, ...], the rows' slots [B]) for a kernel that reads and updates the rows'
        state in those arrays itself, then hands its output to `wrote_in_place`: where the rows have a state and no
        padding (decode steps); None otherwise."""
        parts = self.pool.arrays[self.layer]
        if self.fresh or parts is None or self._padding is not None:
            return None
        return parts, self.slots

    def wrote_in_place(self, array: mx.array) -> None:
        self.pool.versions[self.layer] += 1
        self.pool.wrote_in_place(array)

    @property
    def state_padding(self) -> mx.array | None:
        return self._padding

    def attend(self, *args, **kwargs):
        raise TypeError(f"layer {self.layer} keeps a recurrent state: it has no keys and values to attend over")

    attend_stored = attend
