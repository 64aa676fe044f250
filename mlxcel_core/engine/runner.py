"""ModelRunner: owns the model (and so MLX); turns scheduled work into next-token logits."""

from __future__ import annotations

import mlx.core as mx

from ..models.base import CausalLM
from .storage import KVStorage


class ModelRunner:
    def __init__(self, model: CausalLM, storage: KVStorage):
        self.model = model
        self.storage = storage

    def prefill(self, seq_id: int, tokens: list[int], start: int, last: bool) -> mx.array | None:
        """Compute prompt positions [start, start + len(tokens)); return [1, V] logits if this ends the prompt."""
        caches = self.storage.prefill_caches(seq_id, start, len(tokens))
        inputs = mx.array([tokens])
        if not last:
            # Only the cache is evaluated, so the LM head never runs on the prompt body.
            self.model(inputs, caches)
            mx.eval([c.state for c in caches])
            return None
        if len(tokens) > 1:
            self.model(inputs[:, :-1], caches)
            mx.eval([c.state for c in caches])
        logits = self.model(inputs[:, -1:], caches)[:, -1, :]
        self.storage.finish_prefill(seq_id)
        return logits

    def decode(self, seq_ids: tuple[int, ...], tokens: mx.array) -> mx.array:
        """One step for every row: `tokens` [B] -> logits [B, V]."""
        caches = self.storage.decode_caches(seq_ids)
        return self.model(tokens[:, None], caches)[:, -1, :]
