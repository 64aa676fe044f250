"""engine/dry_cache.py: tokenized DRY breakers are what processors.dry_sequence_breakers computes, reused, bounded
(least recently used dropped first) and safe to fill from several threads."""

from __future__ import annotations

import threading

from tiny_models import build_tokenizer

from mlxcel_core.engine.dry_cache import DryBreakerCache
from mlxcel_core.processors import dry_sequence_breakers
from mlxcel_core.tokenizer import Tokenizer


def make_cache(maxsize: int) -> DryBreakerCache:
    return DryBreakerCache(Tokenizer(build_tokenizer()), maxsize=maxsize)


def test_values_are_the_processors_and_reused():
    cache = make_cache(4)
    tokenizer = cache.tokenizer
    texts = tokenizer.backend.decode_batch([[i] for i in range(tokenizer.vocab_size)], skip_special_tokens=False)
    want = dry_sequence_breakers(texts, lambda t: tokenizer.encode(t, add_special_tokens=False), ("\n", "ca"))
    got = cache.get(("\n", "ca"))
    assert got == want and got
    assert cache.get(("\n", "ca")) is got  # computed once


def test_least_recently_used_sets_are_dropped():
    cache = make_cache(2)
    first = cache.get(("a",))
    cache.get(("b",))
    assert cache.get(("a",)) is first  # "a" is now the most recent
    cache.get(("c",))  # drops "b"
    assert len(cache) == 2
    assert cache.get(("a",)) is first
    assert set(cache._sets) == {("a",), ("c",)}


def test_threads_fill_it_together():
    cache = make_cache(8)
    results: dict = {}

    def fill(i: int) -> None:
        results[i] = cache.get((f"x{i % 3}",))

    threads = [threading.Thread(target=fill, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) == 3 and all(results[i] == results[i % 3] for i in range(12))
