"""mlxcel_core/reasoning.py on strings: which templates teach reasoning, the `<think>` split (opened in the reply
or in the prompt, cut short, absent), the streamed split adding up to the whole one however the text is cut, and
which tokenizers need their special tokens kept. No model."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken

from mlxcel_core.reasoning import detect, keeps_special_tokens, opens_inside, split_think, think_stream
from mlxcel_core.tokenizer import Tokenizer


@pytest.mark.parametrize(
    ("template", "kind"),
    [
        ("{{ '<|start|>assistant<|channel|>final<|message|>' }}", "harmony"),
        ("{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}", "think"),
        ("{{ '<|im_start|>assistant\n' }}", None),
        (None, None),
    ],
)
def test_detect(template, kind):
    assert detect(template) == kind


@pytest.mark.parametrize(
    ("text", "inside", "want"),
    [
        ("<think>\nstep 1\n</think>\n\nThe answer.", False, ("step 1", "The answer.")),
        ("\n<think>a</think>b", False, ("a", "b")),
        ("The answer, no thinking.", False, (None, "The answer, no thinking.")),
        ("I said <think> later</think>x", False, (None, "I said <think> later</think>x")),  # only at the start
        ("<think>cut short", False, ("cut short", "")),
        ("step 1\n</think>\n\nThe answer.", True, ("step 1", "The answer.")),
        ("all reasoning, cut short", True, ("all reasoning, cut short", "")),
        ("<think></think>answer", False, ("", "answer")),
    ],
)
def test_split_think(text, inside, want):
    assert split_think(text, inside) == want


CASES = [
    ("<think>\nstep 1, then <b>2</b>\n</think>\n\nThe answer </thin is <think> here.", False),
    ("  \n<think>a  \n b</think>c", False),
    ("Plain <thi answer.", False),
    ("reasoning </think>answer", True),
    ("reasoning only", True),
    ("<think>no end", False),
]


@pytest.mark.parametrize(("text", "inside"), CASES)
@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_streamed_split_adds_up_to_the_whole(text, inside, step):
    stream = think_stream(inside)
    reasoning, answer = "", ""
    for i in range(0, len(text), step):
        r, a = stream.feed(text[i : i + step])
        reasoning, answer = reasoning + r, answer + a
    r, a = stream.finish()
    want = split_think(text, inside)
    assert (reasoning + r, answer + a) == (want[0] or "", want[1])


def test_a_streamed_answer_goes_out_before_the_end():
    stream = think_stream(False)
    assert stream.feed("<think>abc") == ("abc", "")
    assert stream.feed("</thi") == ("", "")  # maybe the end marker: held
    assert stream.feed("nk>\n\nHel") == ("", "Hel")
    assert stream.feed("lo") == ("", "lo")


def _tokenizer(special: bool) -> Tokenizer:
    from tiny_models import build_tokenizer

    backend = build_tokenizer()
    backend.add_tokens([AddedToken("<think>", special=special), AddedToken("</think>", special=special)])
    return Tokenizer(backend=backend)


@pytest.mark.parametrize("special", [False, True])
def test_opens_inside_and_special_tokens(special):
    tok = _tokenizer(special)
    assert opens_inside(tok, tok.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False))
    assert not opens_inside(tok, tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n"))
    assert not opens_inside(tok, tok.encode("<|im_start|>assistant\n"))
    assert keeps_special_tokens(tok, "think") == special
    assert keeps_special_tokens(tok, "harmony") and not keeps_special_tokens(tok, None)
