"""IncrementalDetokenizer against a real byte-level BPE and hand-made decoders; StopMatcher streaming."""

from __future__ import annotations

import pytest

from mlxcel_core.detokenizer import IncrementalDetokenizer, StopMatcher

FFFD = "\ufffd"
CORPUS = [
    "héllo wörld 日本語 🙂 and some more plain text here",
    "the quick brown fox 🙂🙂 jumps over the lazy dog",
    "naïve café 日本 語 über straße — «quotes»",
]


@pytest.fixture(scope="module")
def bpe():
    """A tiny byte-level BPE (vocab 300) trained in-process: multi-byte characters span tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    assert tok.get_vocab_size() == 300
    return tok


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str]:
    return [detok.add(i) for i in ids], detok.flush()


@pytest.mark.parametrize(
    "text",
    [
        "héllo wörld 日本語 🙂!",
        "zebra 🦓 ÿ 中文 🙂🙂 x",  # characters unseen in training: one byte per token
        "über café naïve 日本語🙂end",
        "plain ascii only",
    ],
)
def test_bpe_stream_equals_full_decode_without_replacement_chars(bpe, text):
    ids = bpe.encode(text).ids
    pieces, tail = stream(IncrementalDetokenizer(bpe.decode), ids)
    assert "".join(pieces) + tail == bpe.decode(ids) == text
    assert tail == ""
    assert not any(FFFD in piece for piece in pieces), pieces
    if not text.isascii():
        # the case is meaningful: some token on its own decodes to a partial character
        assert any(FFFD in bpe.decode([i]) for i in ids)
        assert "" in pieces  # ...and its text was held back


def test_bpe_holds_partial_character_then_emits_it_whole(bpe):
    ids = bpe.encode("a 🦓 b").ids  # unseen emoji: bytes F0 9F | A6 | 93 as three tokens
    assert [bpe.decode([i]) for i in ids] == ["a", " ", FFFD, FFFD, FFFD, " ", "b"]
    pieces, tail = stream(IncrementalDetokenizer(bpe.decode), ids)
    assert pieces == ["a", " ", "", "", "🦓", " ", "b"]
    assert tail == ""


def test_bpe_prompt_context_keeps_first_word_leading_space(bpe):
    prompt = bpe.encode("Question: héllo").ids
    gen = bpe.encode(" 日本語 wörld 🙂").ids
    assert bpe.decode(gen[:1]) == " 日本"  # a merged token that carries the leading space
    detok = IncrementalDetokenizer(bpe.decode, prompt_tail=prompt[-4:])
    pieces, tail = stream(detok, gen)
    assert pieces[0] == " 日本"
    assert "".join(pieces) + tail == " 日本語 wörld 🙂" == bpe.decode(gen)
    assert not any(FFFD in piece for piece in pieces)


# ---------------------------------------------------------------- hand-made decoders

BYTE_VOCAB = {0: b"a", 1: b" ", 2: b"\xf0", 3: b"\x9f", 4: b"\x99", 5: b"\x82", 6: b"\xf0\x9f", 7: b"\x99\x82b"}


def byte_decode(ids: list[int]) -> str:
    return b"".join(BYTE_VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def test_handmade_emoji_over_four_tokens_is_held_until_complete():
    pieces, tail = stream(IncrementalDetokenizer(byte_decode), [0, 1, 2, 3, 4, 5, 0])
    assert pieces == ["a", " ", "", "", "", "🙂", "a"]
    assert tail == ""


def test_handmade_emoji_over_two_tokens_with_trailing_text():
    pieces, tail = stream(IncrementalDetokenizer(byte_decode), [0, 6, 7, 1])
    assert pieces == ["a", "", "🙂b", " "]
    assert tail == ""


def test_handmade_flush_releases_dangling_partial_character():
    detok = IncrementalDetokenizer(byte_decode)
    pieces, tail = stream(detok, [0, 2, 3])
    assert pieces == ["a", "", ""]
    assert tail == byte_decode([2, 3]) == FFFD
    assert "".join(pieces) + tail == byte_decode([0, 2, 3])
    assert detok.flush() == ""


SP_VOCAB = {0: "▁Hello", 1: "▁world", 2: "!", 3: "▁again"}


def sp_decode(ids: list[int]) -> str:
    """SentencePiece-style: '▁' is a space and the leading space of the text is stripped."""
    text = "".join(SP_VOCAB[i] for i in ids).replace("▁", " ")
    return text[1:] if text.startswith(" ") else text


def test_sentencepiece_style_needs_prompt_context_for_leading_space():
    assert stream(IncrementalDetokenizer(sp_decode), [1, 2, 3])[0] == ["world", "!", " again"]
    with_ctx = stream(IncrementalDetokenizer(sp_decode, prompt_tail=[0]), [1, 2, 3])
    assert with_ctx == ([" world", "!", " again"], "")


# ---------------------------------------------------------------- StopMatcher


def feed_all(matcher: StopMatcher, chunks: list[str]) -> list[tuple[str, bool]]:
    return [matcher.feed(c) for c in chunks]


def test_stop_split_across_feeds_is_never_emitted():
    m = StopMatcher(("</s>",))
    assert feed_all(m, ["Hello <", "/", "s"]) == [("Hello ", False), ("", False), ("", False)]
    assert m.feed("> trailing") == ("", True)
    assert m.flush() == ""


def test_stop_inside_one_chunk_emits_text_before_it():
    m = StopMatcher(("STOP",))
    assert m.feed("abc STOP def") == ("abc ", True)


def test_false_stop_prefix_is_released_later():
    m = StopMatcher(("STOP",))
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("O") == ("", False)
    assert m.feed("RM") == ("STORM", False)
    assert m.feed(" S") == (" ", False)
    assert m.feed("x") == ("Sx", False)
    assert m.flush() == ""


def test_self_overlapping_stop_prefix():
    m = StopMatcher(("aab",))
    assert m.feed("aaa") == ("a", False)  # "aa" could still start "aab"
    assert m.feed("b") == ("", True)


def test_longest_held_prefix_over_several_stops():
    m = StopMatcher(("abcd", "cx"))
    assert m.feed("zabc") == ("z", False)  # "abc" (prefix of abcd) beats "c" (prefix of cx)
    assert m.feed("x") == ("ab", True)  # "cx" completes at position 2


@pytest.mark.parametrize(
    "chunks, expected",
    [
        (["hello world"], [("hel", True)]),  # "lo" (pos 3) before "world" (pos 6)
        (["xab", "cd"], [("x", False), ("", True)]),  # "abc" (pos 0) before "cd" (pos 2)
        (["say wo", "rld lo"], [("say ", False), ("", True)]),
    ],
)
def test_several_stops_earliest_match_wins(chunks, expected):
    m = StopMatcher(("world", "lo", "abc", "cd"))
    assert feed_all(m, chunks) == expected


def test_no_stops_is_passthrough():
    m = StopMatcher(())
    assert feed_all(m, ["abc", "", "</s>", " S"]) == [("abc", False), ("", False), ("</s>", False), (" S", False)]
    assert m.flush() == ""


def test_flush_releases_held_text():
    m = StopMatcher(("<|im_end|>",))
    assert m.feed("answer<|im_") == ("answer", False)
    assert m.flush() == "<|im_"
    assert m.flush() == ""
