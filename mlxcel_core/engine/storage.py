"""KV storage backends behind one interface, so the runner does not care where keys live.

- DenseStorage: each prefilling sequence has its own caches; when its prompt is done its rows join
  one left-padded decode batch (cache.KVCache). Best at batch 1.
- PagedStorage (engine/paged.py): fixed-size blocks in one pool with a prefix cache; best when batching.

`make_storage` picks one for an EngineConfig and checks up front that quantized KV can group the model's heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from ..cache import KVCache, kv_group_size, make_cache
from ..errors import InputError
from ..models.base import CausalLM, LayerCache, has_recurrent_layers, kv_layout, state_layout
from .budget import state_tokens_per_sequence
from .recurrent_rollback import CacheCheckpoint, checkpoint, restore
from .types import EngineConfig

# A recurrent model's prefix cache (state_snapshots.py): state snapshots held at most, per batch row.
SNAPSHOTS_PER_ROW = 4


@dataclass
class Conversation:
    """KV state carried from one chat turn to the next, so a turn prefills only what is new.

    `tokens` are the tokens whose keys/values `caches` hold. The next turn's prompt is matched
    against them token by token: the common prefix is reused, the cache is trimmed after it.
    """

    tokens: list[int] = field(default_factory=list)
    caches: list[KVCache] | None = None

    def reusable(self, prompt_ids: list[int]) -> int:
        """Leading prompt tokens already in the cache (never the whole prompt: its last token is computed)."""
        n = 0
        for a, b in zip(self.tokens, prompt_ids[:-1]):
            if a != b:
                break
            n += 1
        return n

    def reused(self, prompt_ids: list[int]) -> int:
        """Leading prompt tokens a turn takes from this conversation's KV cache: `reusable()`, or none where nothing
        is cached or a layer cannot be cut back to them (a recurrent state that has seen more)."""
        if self.caches is None:
            return 0
        n = self.reusable(prompt_ids)
        return n if all(layer.trimmable(n) for layer in self.caches) else 0


class KVStorage(Protocol):
    def add(self, seq_id: int, prompt_ids: list[int], conversation: Conversation | None = None) -> int:
        """Prepare a sequence; return how many leading prompt tokens are already cached."""

    def prefill_caches(self, seq_id: int, start: int, length: int) -> Sequence[LayerCache]:
        """Per-layer caches for computing prompt positions [start, start + length) of one sequence."""

    def finish_prefill(self, seq_id: int) -> None:
        """The prompt is in the cache: the sequence decodes from the next step on."""

    def decode_caches(self, seq_ids: Sequence[int]) -> Sequence[LayerCache]:
        """Per-layer caches for one decode step over these rows, in this order."""

    def extend_caches(self, seq_id: int, length: int) -> Sequence[LayerCache]:
        """Per-layer caches for `length` new tokens of one decoding sequence in one forward (speculative
        verification: the current token plus the draft). The sequence must be the only one decoding."""

    def rollback(self, seq_id: int, count: int) -> None:
        """Forget the sequence's last `count` tokens (rejected draft tokens)."""

    def checkpoint(self, seq_id: int) -> object:
        """The decoding sequence's KV length and recurrent state as they are now, for `restore`."""

    def restore(self, seq_id: int, saved: object) -> None:
        """The sequence back to `checkpoint`'s moment (speculative decoding with recurrent layers:
        engine/recurrent_rollback.py)."""

    def free(self, seq_id: int, tokens: list[int]) -> None:
        """Release a sequence; `tokens` (prompt + output) lets a prefix cache keep what was computed."""

    def prefill_stops(self, seq_id: int) -> tuple[int, ...]:
        """Prompt positions an added sequence's prefill chunks must end at (paged storage of a model with recurrent
        layers: where it keeps states for its prefix cache, state_snapshots.py)."""

    def stats(self) -> dict[str, int]: ...

    def forget_cached(self) -> None:
        """Drop every cached prefix no sequence holds (nothing where the storage keeps none)."""


class DenseStorage:
    def __init__(self, num_layers: int, kv_bits: int | None = None):
        self.num_layers = num_layers
        self.kv_bits = kv_bits
        self._prefilling: dict[int, list[KVCache]] = {}
        self._batch: list[KVCache] = make_cache(num_layers, kv_bits=kv_bits)
        self._rows: list[int] = []  # seq id of each batch row
        self._conversations: dict[int, Conversation] = {}

    def add(self, seq_id: int, prompt_ids: list[int], conversation: Conversation | None = None) -> int:
        reused = 0
        caches = None
        if conversation is not None:
            self._conversations[seq_id] = conversation
            if conversation.caches is not None:
                reused, caches, conversation.caches = conversation.reused(prompt_ids), conversation.caches, None
                if not all(layer.trimmable(reused) for layer in caches):
                    caches = None  # a recurrent state holds more than the reused prefix: start afresh
                for layer in caches or []:
                    layer.trim(reused)
        self._prefilling[seq_id] = caches or make_cache(self.num_layers, kv_bits=self.kv_bits)
        return reused

    def prefill_caches(self, seq_id: int, start: int, length: int) -> list[KVCache]:
        return self._prefilling[seq_id]

    def finish_prefill(self, seq_id: int) -> None:
        for batch_layer, seq_layer in zip(self._batch, self._prefilling.pop(seq_id)):
            batch_layer.append_rows(seq_layer)
        self._rows.append(seq_id)

    def decode_caches(self, seq_ids: Sequence[int]) -> list[KVCache]:
        if list(seq_ids) != self._rows:
            self._select_rows([self._rows.index(s) for s in seq_ids])
        return self._batch

    def extend_caches(self, seq_id: int, length: int) -> list[KVCache]:
        caches = self.decode_caches([seq_id])  # a batch of this row alone: KVCache.attend takes any length
        if self._rows != [seq_id]:
            raise RuntimeError("extend_caches needs the sequence to decode alone")
        return caches

    def rollback(self, seq_id: int, count: int) -> None:
        if count > 0:
            for layer in self._batch:
                layer.trim(layer.columns - count)

    def checkpoint(self, seq_id: int) -> CacheCheckpoint:
        return checkpoint(self.extend_caches(seq_id, 0))

    def restore(self, seq_id: int, saved: CacheCheckpoint) -> None:
        restore(self.extend_caches(seq_id, 0), saved)

    def free(self, seq_id: int, tokens: list[int]) -> None:
        conversation = self._conversations.pop(seq_id, None)
        caches = self._prefilling.pop(seq_id, None)
        if caches is None and seq_id in self._rows:
            row = self._rows.index(seq_id)
            caches = [layer.row(row) for layer in self._batch] if conversation is not None else None
            self._select_rows([i for i in range(len(self._rows)) if i != row])
        if conversation is not None and caches is not None:
            conversation.caches = caches
            conversation.tokens = tokens[: caches[0].columns]

    def _select_rows(self, rows: list[int]) -> None:
        if not rows:
            self._batch = make_cache(self.num_layers, kv_bits=self.kv_bits)
            self._rows = []
            return
        for layer in self._batch:
            layer.keep_rows(rows)
        self._rows = [self._rows[i] for i in rows]

    def forget_cached(self) -> None:
        """Dense storage keeps no prefix cache."""

    def prefill_stops(self, seq_id: int) -> tuple[int, ...]:
        return ()

    def stats(self) -> dict[str, int]:
        caches = list(self._prefilling.values()) + [self._batch]
        return {"kv_bytes": sum(layer.nbytes for cache in caches for layer in cache), "rows": len(self._rows)}


def make_storage(model: CausalLM, config: EngineConfig, compiled: bool = False) -> KVStorage:
    """`compiled`: decode steps will run compiled (compiled_decode.py), so paged block tables are padded. A model
    with recurrent layers gets paged storage with a state pool, and a prefix cache that keeps snapshots of the state
    (state_snapshots.py): SNAPSHOTS_PER_ROW per batch row at most, in the KV budget that sequences do not use."""
    if config.kv_bits is not None:
        _check_kv_quantizable(model)
    if config.resolved_storage == "paged":
        from .paged import PagedStorage

        budget = config.kv_budget_for(model.max_context_length)
        recurrent = has_recurrent_layers(model)
        return PagedStorage(
            len(model.layers),
            block_size=config.block_size,
            kv_budget_tokens=budget,
            kv_bits=config.kv_bits,
            prefix_cache=config.prefix_cache,
            num_splits=config.num_splits,
            max_batch_size=config.max_batch_size,
            pad_block_tables=compiled,
            state_layers=[layout is not None for layout in state_layout(model)] if recurrent else None,
            state_snapshots=SNAPSHOTS_PER_ROW * config.max_batch_size if recurrent else 0,
            snapshot_tokens=state_tokens_per_sequence(model, config.kv_bits),
            cache_generated=not getattr(model, "decode_differs_from_prompt", False),
        )
    return DenseStorage(len(model.layers), kv_bits=config.kv_bits)


def _check_kv_quantizable(model: CausalLM) -> None:
    """Refuse quantized KV up front when the heads cannot be grouped (rather than failing the first step)."""
    # Every stored layer's head size (Gemma 4's sliding and full layers differ; its KV-shared layers store nothing).
    head_dims = sorted({layout[1] for layout in kv_layout(model) if layout is not None})
    try:
        for head_dim in head_dims:
            kv_group_size(head_dim)
    except ValueError as exc:
        raise InputError(f"--kv-bits: {exc}") from None
