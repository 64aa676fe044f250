"""GGUF tokenizers: vocabularies written into GGUF metadata the way llama.cpp's converter writes them, read back by
our loader, must encode and decode tricky text exactly like the original Hugging Face tokenizer and like
transformers' own GGUF tokenizer."""

from __future__ import annotations

import json

import pytest
from tiny_models import TRAINING_TEXT
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from mlxcel_core.errors import UnsupportedModelError
from mlxcel_core.loading.gguf import gguf_tokenizer, read_gguf

gguf = pytest.importorskip("gguf")

TEXTS = [
    "Hello world",
    " leading space",
    "two  spaces   three    four",
    "tabs\tand\nnewlines\n\n\nend",
    "héllo wörld ÀÉÎÕÜ",
    "日本語のテキスト",
    "emoji 🙂👍🏽 done",
    "digits 1234567 3.14159 and 42",
    "don't I'll we've THEY'RE",
    "<|im_start|>user\nhi there<|im_end|>",
    "a-b_c/d\\e (f) [g] {h}",
    "",
    " ",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = TRAINING_TEXT * 4 + ["don't I'll we've THEY'RE 1234567 3.14159", "tabs\tand\nnewlines\n\n\nend  spaces   "]


def _split(regex: str):
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _reference_pre_tokenizers() -> dict:
    """Each llama.cpp pre-tokenizer name -> the pre-tokenizer its models' own tokenizer.json uses, from transformers
    (an implementation independent of ours)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    return {
        "default": pre_tokenizers.ByteLevel(add_prefix_space=False),
        "smollm": pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        ),
        "qwen2": _split(PRETOKENIZE_REGEX),
        "llama-bpe": _split(GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"]),
        "gpt-4o": _split(GGUF_PRE_TOKENIZER_SPLITS["gpt-4o"]),
        "tekken": _split(GGUF_PRE_TOKENIZER_SPLITS["tekken"]),
    }


def _train_bpe(pre) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _write(path, arch: str, fill) -> None:
    """A GGUF file with tokenizer metadata only (`fill(writer)`), plus the few keys transformers asks for."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _ours(path):
    _, meta = read_gguf(path)
    return gguf_tokenizer(meta)


def _transformers(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _assert_same(ours, reference, texts, add_special_tokens=False, decode=None):
    """Same ids as `reference`; decoding gives the text back (or `decode(ids)`, where given, for texts with special
    tokens: SentencePiece decodes the space it prefixed after one)."""
    for text in texts:
        ids = ours.encode(text, add_special_tokens=add_special_tokens)
        assert ids == reference(text), repr(text)
        expected = decode(ids) if decode is not None and "</s>" in text else text
        assert ours.backend.decode(ids, skip_special_tokens=False) == expected, repr(text)


@pytest.mark.parametrize("pre", ["default", "smollm", "qwen2", "llama-bpe", "gpt-4o", "tekken"])
def test_byte_level_bpe_per_pre_tokenizer(tmp_path, pre):
    original = _train_bpe(_reference_pre_tokenizers()[pre])
    data = json.loads(original.to_str())
    vocab = original.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]

    def fill(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]])
        w.add_bos_token_id(vocab["<|endoftext|>"])
        w.add_eos_token_id(vocab["<|im_end|>"])
        w.add_add_bos_token(False)
        w.add_chat_template("{{ messages[0]['content'] }}")

    path = tmp_path / f"{pre}.gguf"
    _write(path, "llama", fill)
    ours = _ours(path)
    _assert_same(ours, lambda t: original.encode(t).ids, TEXTS)
    if pre != "tekken":  # transformers' GGUF reader: its own build of the same vocabulary
        theirs = _transformers(path)
        _assert_same(ours, lambda t: theirs.encode(t, add_special_tokens=False), TEXTS)
    assert ours.eos_token == "<|im_end|>" and ours.chat_template == "{{ messages[0]['content'] }}"
    assert ours.eos_token_ids == {vocab["<|im_end|>"], vocab["<|endoftext|>"]}  # <|endoftext|>: llama.cpp's EOG


def _spm_vocab(tokens_extra: int = 300, space_prefix: bool = True):
    """A SentencePiece-style BPE vocabulary trained here (pieces with U+2581 for spaces, byte fallback), laid out as
    llama.cpp's converter writes a tokenizer.model: <unk>, <s>, </s>, the 256 byte pieces, then pieces by rank,
    each scored minus its rank. Also returns the trained tokenizer, shaped like Llama 2's tokenizer.json (a U+2581
    prefixed to each text run when `space_prefix`, as SentencePiece's add_dummy_prefix does)."""
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    escape = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), escape]) if space_prefix else escape
    trainer = trainers.BpeTrainer(
        vocab_size=3 + 256 + tokens_extra,
        special_tokens=["<unk>", "<s>", "</s>", *byte_pieces],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(["<s>", "</s>"])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if space_prefix else steps)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t in byte_pieces else 1 for t in tokens]
    scores = [0.0 if ty != 1 else -float(i) for i, ty in enumerate(types)]
    return tokens, types, scores, tok


@pytest.mark.parametrize("arch,space_prefix", [("llama", True), ("gemma2", False)])
def test_sentencepiece_vocabulary(tmp_path, arch, space_prefix):
    tokens, types, scores, original = _spm_vocab(space_prefix=space_prefix)

    def fill(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_space_prefix(space_prefix)

    path = tmp_path / f"{arch}.gguf"
    _write(path, arch, fill)
    ours = _ours(path)
    texts = [t for t in TEXTS if "<|" not in t] + ["<s>hi</s> there", "  two leading", "x</s>y"]
    _assert_same(
        ours,
        lambda t: original.encode(t, add_special_tokens=False).ids,
        texts,
        decode=lambda ids: original.decode(ids, skip_special_tokens=False),
    )
    # transformers' GGUF reader prefixes no U+2581 to text that already starts with a space, nor after a special
    # token (llama.cpp and SentencePiece do): compared on the other texts.
    theirs = _transformers(path)
    plain = [t for t in texts if not t.startswith(" ") and "</s>" not in t]
    _assert_same(ours, lambda t: theirs.encode(t, add_special_tokens=False), plain)
    # Byte fallback really runs: a character outside the vocabulary is its UTF-8 bytes.
    assert ours.encode("🦀", add_special_tokens=False)[-4:] == [3 + b for b in "🦀".encode()]
    # llama.cpp's default for a SentencePiece vocabulary without add_bos_token: BOS first.
    assert ours.encode("hi")[0] == 1 and ours.encode("hi", add_special_tokens=False)[0] != 1
    assert ours.encode("hi") == theirs.encode("hi")
    assert ours.bos_token == "<s>" and ours.eos_token_ids == {2}


def test_sentencepiece_add_eos_and_no_bos(tmp_path):
    tokens, types, scores, _ = _spm_vocab(50)

    def fill(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
        w.add_add_eos_token(True)

    path = tmp_path / "eos.gguf"
    _write(path, "llama", fill)
    ids = _ours(path).encode("hello")
    assert ids[0] != 1 and ids[-1] == 2


def test_unsupported_tokenizer_model_and_pre_tokenizer_are_named(tmp_path):
    with pytest.raises(UnsupportedModelError, match=r"GGUF tokenizer model 'rwkv' is not supported \(supported: "):
        gguf_tokenizer({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.pre": "chatglm-bpe"}
    with pytest.raises(UnsupportedModelError, match=r"pre-tokenizer 'chatglm-bpe' is not supported.*llama-bpe"):
        gguf_tokenizer(meta)


@pytest.mark.real_model
def test_smollm2_gguf_tokenizer_matches_transformers(smollm2_gguf):
    """The real SmolLM2 Q4_1 GGUF (smollm pre-tokenizer, ChatML specials): our tokenizer against transformers'."""
    from transformers import AutoTokenizer

    ours = _ours(smollm2_gguf)
    theirs = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    _assert_same(ours, lambda t: theirs.encode(t, add_special_tokens=False), TEXTS)
    assert ours.eos_token == "<|im_end|>" and ours.chat_template
