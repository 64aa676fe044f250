"""gguf_header.read_header against the `gguf` package's own reader, on files its writer wrote."""

from __future__ import annotations

import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter

from mlxcel_core.loading.gguf_header import SkippedStrings, Truncated, read_header, read_metadata


def _write(path, alignment=None, vocab=8):
    w = GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_string("general.name", "tiny")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_token_list([f"tok{i}" if i else "é ▁x" for i in range(vocab)])
    w.add_token_scores([float(-i) for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_array("llama.per_layer", [3, 4])
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((2, 7)).astype(np.float16))
    w.add_tensor("c.weight", rng.integers(0, 255, (4, 34), dtype=np.uint8), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_header_matches_the_gguf_package_reader(tmp_path, alignment):
    path = _write(tmp_path / "m.gguf", alignment)
    meta, tensors = read_header(path)
    reader = GGUFReader(path)
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        ours, theirs = meta[name], field.contents()
        if isinstance(ours, np.ndarray):
            np.testing.assert_array_equal(ours, theirs)
        else:
            assert ours == theirs, name
    assert meta["tokenizer.ggml.tokens"][0] == "é ▁x" and isinstance(meta["general.name"], str)
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type and ours.n_elements == theirs.n_elements
        assert ours.shape.tolist() == theirs.shape.tolist()
        np.testing.assert_array_equal(ours.data, np.asarray(theirs.data).reshape(-1))


def test_a_large_vocabulary_parses_quickly(tmp_path):
    path = _write(tmp_path / "big.gguf", vocab=262144)  # Gemma 3's size: GGUFReader takes minutes on it
    start = time.perf_counter()
    meta, _ = read_header(path)
    assert len(meta["tokenizer.ggml.tokens"]) == 262144
    assert time.perf_counter() - start < 10


def test_truncation_and_foreign_files_are_told_apart(tmp_path):
    data = _write(tmp_path / "m.gguf").read_bytes()
    for end in (0, 3, 30, len(data) // 2, len(data) - 40):  # the last 24 bytes are padding after the last tensor
        (tmp_path / "cut.gguf").write_bytes(data[:end])
        with pytest.raises(Truncated):
            read_header(tmp_path / "cut.gguf")
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(ValueError, match="no GGUF magic"):
        read_header(tmp_path / "x.gguf")


def test_metadata_alone_is_the_headers_with_strings_skipped_on_request(tmp_path):
    path = _write(tmp_path / "m.gguf", vocab=300)
    meta, _ = read_header(path)
    assert read_metadata(path).keys() == meta.keys()
    assert read_metadata(path)["tokenizer.ggml.tokens"] == meta["tokenizer.ggml.tokens"]
    skipped = read_metadata(path, strings=False)
    tokens = skipped["tokenizer.ggml.tokens"]
    assert isinstance(tokens, SkippedStrings) and tokens == 300
    assert skipped["general.name"] == "tiny" and skipped["llama.per_layer"].tolist() == [3, 4]
    np.testing.assert_array_equal(skipped["tokenizer.ggml.scores"], meta["tokenizer.ggml.scores"])
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:200])  # inside the vocabulary
    with pytest.raises(Truncated):
        read_metadata(tmp_path / "cut.gguf", strings=False)
