"""DRY sequence breakers tokenized once per set of breakers, for one tokenizer: a bounded, thread-safe LRU cache.

Tokenizing a set of breakers scans the whole vocabulary once per breaker (processors.dry_sequence_breakers): tens
of milliseconds each on a large vocabulary. The engine reads the cache when it opens a row; the server fills it on
a worker thread before it submits a request, so a new set never stalls the engine thread that decodes for everyone.
The cache holds at most `maxsize` sets (each up to a few hundred KB), least recently used dropped first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..processors import DryBreakers, dry_sequence_breakers

DEFAULT_MAXSIZE = 32


class DryBreakerCache:
    def __init__(self, tokenizer, maxsize: int = DEFAULT_MAXSIZE):
        self.tokenizer, self.maxsize = tokenizer, maxsize
        self._lock = threading.Lock()
        self._token_texts: list[str] | None = None  # each token's text
        self._sets: OrderedDict[tuple[str, ...], DryBreakers] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sets)

    def get(self, breakers: tuple[str, ...]) -> DryBreakers:
        """The breakers as head token -> token tails (computed on a miss, outside the lock)."""
        key = tuple(breakers)
        with self._lock:
            if key in self._sets:
                self._sets.move_to_end(key)
                return self._sets[key]
        value = dry_sequence_breakers(
            self._texts(), lambda text: self.tokenizer.encode(text, add_special_tokens=False), key
        )
        with self._lock:
            self._sets[key] = value
            self._sets.move_to_end(key)
            while len(self._sets) > self.maxsize:
                self._sets.popitem(last=False)
        return value

    def _texts(self) -> list[str]:
        with self._lock:
            if self._token_texts is None:
                backend = self.tokenizer.backend
                self._token_texts = backend.decode_batch(
                    [[i] for i in range(self.tokenizer.vocab_size)], skip_special_tokens=False
                )
            return self._token_texts
