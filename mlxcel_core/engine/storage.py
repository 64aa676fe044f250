"""KV storage backends behind one interface, so the runner does not care where keys live.

- DenseStorage: each prefilling sequence has its own caches; when its prompt is done its rows join
  one left-padded decode batch (cache.KVCache). Best at batch 1.
- PagedStorage (engine/paged.py): fixed-size blocks in one pool with a prefix cache; best when batching.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from ..cache import KVCache, make_cache
from ..models.base import LayerCache


class KVStorage(Protocol):
    def add(self, seq_id: int, prompt_ids: list[int]) -> int:
        """Prepare a sequence; return how many leading prompt tokens are already cached."""

    def prefill_caches(self, seq_id: int, start: int, length: int) -> Sequence[LayerCache]:
        """Per-layer caches for computing prompt positions [start, start + length) of one sequence."""

    def finish_prefill(self, seq_id: int) -> None:
        """The prompt is in the cache: the sequence decodes from the next step on."""

    def decode_caches(self, seq_ids: Sequence[int]) -> Sequence[LayerCache]:
        """Per-layer caches for one decode step over these rows, in this order."""

    def free(self, seq_id: int, tokens: list[int]) -> None:
        """Release a sequence; `tokens` (prompt + output) lets a prefix cache keep what was computed."""

    def stats(self) -> dict[str, int]: ...


class DenseStorage:
    def __init__(self, num_layers: int, kv_bits: int | None = None):
        self.num_layers = num_layers
        self.kv_bits = kv_bits
        self._prefilling: dict[int, list[KVCache]] = {}
        self._batch: list[KVCache] = make_cache(num_layers, kv_bits=kv_bits)
        self._rows: list[int] = []  # seq id of each batch row

    def add(self, seq_id: int, prompt_ids: list[int]) -> int:
        self._prefilling[seq_id] = make_cache(self.num_layers, kv_bits=self.kv_bits)
        return 0

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

    def free(self, seq_id: int, tokens: list[int]) -> None:
        if self._prefilling.pop(seq_id, None) is not None or seq_id not in self._rows:
            return
        self._select_rows([i for i, s in enumerate(self._rows) if s != seq_id])

    def _select_rows(self, rows: list[int]) -> None:
        if not rows:
            self._batch = make_cache(self.num_layers, kv_bits=self.kv_bits)
            self._rows = []
            return
        for layer in self._batch:
            layer.keep_rows(rows)
        self._rows = [self._rows[i] for i in rows]

    def stats(self) -> dict[str, int]:
        caches = list(self._prefilling.values()) + [self._batch]
        return {"kv_bytes": sum(layer.nbytes for cache in caches for layer in cache), "rows": len(self._rows)}
