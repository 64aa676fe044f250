"""ModelRunner: owns the model (and so MLX); turns scheduled work into next-token logits."""

from __future__ import annotations

import logging

import mlx.core as mx

from ..models.base import CausalLM, has_recurrent_layers
from .compiled_decode import CompiledDecoder
from .recurrent_rollback import decode_tokens, prompt_tokens, rerun
from .storage import KVStorage

log = logging.getLogger("mlxcel.engine")


class ModelRunner:
    def __init__(self, model: CausalLM, storage: KVStorage, compile_decode: bool = False):
        self.model = model
        self.storage = storage
        self.prefill_tokens = 0  # prompt tokens actually computed (prefix-cache hits are not)
        # Decode steps as one compiled graph where the caches allow (compiled_decode.py); None: op by op.
        self.compiled = CompiledDecoder(model) if compile_decode else None
        self.recurrent = has_recurrent_layers(model)
        self._scored: tuple[list[int], object] | None = None  # the last score's tokens and checkpoint

    def prefill(self, seq_id: int, tokens: list[int], start: int, last: bool) -> mx.array | None:
        """Compute prompt positions [start, start + len(tokens)); return [1, V] logits if this ends the prompt.

        One forward per chunk. The last chunk's forward runs its last layer past the attention (and the LM head) on
        the last position only (last_only); a chunk that does not end the prompt evaluates only its caches."""
        self.prefill_tokens += len(tokens)
        caches = self._prompt(self.storage.prefill_caches(seq_id, start, len(tokens)))
        if not last:
            self.model(mx.array([tokens]), caches)
            mx.eval([c.state for c in caches])
            return None
        logits = self.model(mx.array([tokens]), caches, last_only=True)[:, -1, :]
        self.storage.finish_prefill(seq_id)
        return logits

    def prefill_together(self, seq_ids: tuple[int, ...], chunks: list[list[int]], lasts=None, start: int = 0):
        """Prompt chunks of several sequences in one forward: from position 0 (`start` 0), left-padded to the longest
        (the storage hides the padding from attention and gives each row its true positions), or all of one length
        from position `start`, unpadded; `lasts`: per row, whether its chunk ends its prompt (None: every row's does).
        Returns [n, V] logits of the last token of the rows that end their prompts, in order (None where none does)."""
        lasts = [True] * len(seq_ids) if lasts is None else list(lasts)
        self.prefill_tokens += sum(len(c) for c in chunks)
        if start == 0:
            longest = max(len(c) for c in chunks)
            caches = self._prompt(self.storage.prefill_together_caches(seq_ids, [len(c) for c in chunks]))
            tokens = mx.array([[0] * (longest - len(c)) + c for c in chunks])
        else:
            if any(len(c) != len(chunks[0]) for c in chunks):
                raise ValueError("prompt chunks prefilled together past position 0 must have one length")
            caches = self._prompt(self.storage.prefill_rows_caches(seq_ids, start, len(chunks[0])))
            tokens = mx.array(chunks)
        logits = self.model(tokens, caches, last_only=True)[:, -1, :]
        rows = [i for i, last in enumerate(lasts) if last]
        if not rows:
            mx.eval([c.state for c in caches])
            return None
        for i in rows:
            self.storage.finish_prefill(seq_ids[i])
        return logits if len(rows) == len(lasts) else logits[mx.array(rows)]

    def _prompt(self, caches):
        """A prefill's caches, marked as prompt tokens' where the model has recurrent layers (a 1-token chunk is not
        a decode step: recurrent_rollback.PromptTokens)."""
        return prompt_tokens(caches) if self.recurrent else caches

    def score(self, seq_id: int, tokens: list[int]) -> mx.array:
        """One decoding sequence, several tokens in one forward (speculative verification): logits [n, V],
        row i predicting the token after tokens[i]. With recurrent layers the sequence is checkpointed first, for
        `take_back`, and the forward is one over generated tokens (recurrent_rollback.py)."""
        self._scored = (tokens, self.storage.checkpoint(seq_id) if self.recurrent else None)
        caches = self.storage.extend_caches(seq_id, len(tokens))
        logits = self.model(mx.array([tokens]), decode_tokens(caches) if self.recurrent else caches)
        return logits.squeeze(0)  # (a view: MLX makes logits[0] a gather of the n x V rows)

    def take_back(self, seq_id: int, count: int) -> None:
        """Forget the last `count` tokens of the last `score` (rejected draft tokens): KV caches are cut back; a
        recurrent state goes back to the checkpoint and the kept tokens run again (recurrent_rollback.py)."""
        tokens, saved = self._scored
        self._scored = None
        if count > 0 and saved is not None:
            rerun(self.model, self.storage, seq_id, tokens[:-count], saved)
        elif count > 0:
            self.storage.rollback(seq_id, count)

    def decode(self, seq_ids: tuple[int, ...], tokens: mx.array) -> mx.array:
        """One step for every row: `tokens` [B] -> logits [B, V]."""
        caches = self.storage.decode_caches(seq_ids)
        if self.compiled is not None and self.compiled.supports(caches):
            try:
                return self.compiled.decode(tokens, caches)
            except Exception as exc:  # noqa: BLE001 - the model cannot be traced: decode op by op from now on
                # Nothing was committed: a failed call leaves the caches as they were (grown at most).
                log.warning(
                    "mlxcel: compiled decode steps are not possible for this model (%s: %s); decoding op by op",
                    type(exc).__name__,
                    exc,
                )
                self.compiled = None
        return self.model(tokens[:, None], caches)[:, -1, :]
