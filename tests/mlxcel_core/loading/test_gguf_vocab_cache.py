"""loading/gguf_vocab_cache.py: a large SentencePiece vocabulary is built once and read back from the cache dir;
the cached tokenizer encodes and decodes as the built one; a damaged file is rebuilt; any change to the
vocabulary names another file; small vocabularies are not kept."""

from __future__ import annotations

import pytest
from test_gguf_vocab import TEXTS, _spm_vocab

from mlxcel_core.loading import gguf_vocab, gguf_vocab_cache
from mlxcel_core.loading.gguf import gguf_tokenizer


def _meta(tokens, types, scores) -> dict:
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """Every vocabulary kept, under a fresh cache dir; the count of builds."""
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gguf_vocab_cache, "MIN_PIECES", 0)
    builds = []
    build = gguf_vocab._backend
    monkeypatch.setattr(gguf_vocab, "_backend", lambda *a: builds.append(1) or build(*a))
    return tmp_path / "tokenizers", builds


def _codes(tokenizer) -> list:
    texts = [t for t in TEXTS if "<|" not in t] + ["<s>hi</s> there", "🦀"]
    return [(tokenizer.encode(t), tokenizer.decode(tokenizer.encode(t))) for t in texts]


def test_built_once_then_read_back_the_same(kept):
    folder, builds = kept
    tokens, types, scores, _ = _spm_vocab()
    first = gguf_tokenizer(_meta(tokens, types, scores))
    assert len(builds) == 1 and len(list(folder.glob("*.json"))) == 1
    again = gguf_tokenizer(_meta(tokens, types, scores))
    assert len(builds) == 1
    assert _codes(again) == _codes(first)
    assert (again.bos_token, again.eos_token_ids) == (first.bos_token, first.eos_token_ids)


def test_a_damaged_file_is_rebuilt(kept):
    folder, builds = kept
    tokens, types, scores, _ = _spm_vocab()
    first = gguf_tokenizer(_meta(tokens, types, scores))
    (kept_file,) = folder.glob("*.json")
    kept_file.write_text(kept_file.read_text()[:1000])
    assert _codes(gguf_tokenizer(_meta(tokens, types, scores))) == _codes(first)
    assert len(builds) == 2
    gguf_tokenizer(_meta(tokens, types, scores))
    assert len(builds) == 2  # (written whole again)


def test_another_vocabulary_is_another_file(kept):
    folder, builds = kept
    tokens, types, scores, _ = _spm_vocab()
    gguf_tokenizer(_meta(tokens, types, scores))
    changed = [*scores[:-1], scores[-1] - 1.0]
    gguf_tokenizer(_meta(tokens, types, changed))
    gguf_tokenizer({**_meta(tokens, types, scores), "tokenizer.ggml.add_bos_token": False})
    assert len(builds) == 3 and len(list(folder.glob("*.json"))) == 3


def test_small_vocabularies_are_not_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path))
    tokens, types, scores, _ = _spm_vocab()
    assert len(tokens) < gguf_vocab_cache.MIN_PIECES
    gguf_tokenizer(_meta(tokens, types, scores))
    assert not (tmp_path / "tokenizers").exists()
