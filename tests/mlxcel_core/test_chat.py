"""ChatSession: turn 2 prefills exactly the new tokens, with the output of a fresh full prefill; context
overflow drops the oldest turns but keeps the system prompt; settings, /clear and interrupted replies."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest
from tiny_models import save_tiny_llama

from mlxcel_core.chat import ChatSession
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.errors import InputError
from mlxcel_core.loading import load_model
from mlxcel_core.sampling import SamplingParams


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    # head_dim 32 so that the quantized-KV case applies
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-chat"), num_attention_heads=2, num_key_value_heads=1)
    return load_model(str(path), log=lambda m: None)


def word_only(tokenizer):
    """A logits processor that allows only " word" tokens that survive decode -> encode unchanged.

    The random tiny model otherwise emits partial UTF-8 bytes, which no tokenizer gives back token for
    token from the text; real models' replies do round-trip, and that is what KV reuse relies on.
    """
    keep = [
        i
        for i in range(tokenizer.vocab_size)
        if re.fullmatch(r" [A-Za-z]+", tokenizer.decode([i]))
        and tokenizer.encode(tokenizer.decode([i]), add_special_tokens=False) == [i]
    ]
    assert len(keep) >= 5
    mask = mx.full((tokenizer.vocab_size,), float("-inf"))
    mask[mx.array(keep)] = 0.0

    def processor(tokens, logits):
        return logits + mask[: logits.shape[-1]]

    return processor


def greedy_tokens(loaded, prompt_ids, params):
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=1))
    seq = engine.open(prompt_ids, params)
    while engine.has_work():
        engine.step()
    return engine.sequence(seq).output_ids


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_second_turn_prefills_only_the_new_tokens(loaded, kv_bits):
    params = SamplingParams(max_tokens=6, logits_processors=(word_only(loaded.tokenizer),))
    chat = ChatSession(loaded, params, system="You are terse.", engine_config=EngineConfig(kv_bits=kv_bits))
    runner = chat.engine.runner

    first = chat.ask("The capital of France")
    turn1 = chat.last_turn
    assert turn1.cached_tokens == 0 and turn1.computed_tokens == turn1.prompt_tokens
    assert first == loaded.tokenizer.decode(turn1.reply_ids) and turn1.generated_tokens == 6

    before = runner.prefill_tokens
    second = chat.ask("The capital of Italy")
    turn2 = chat.last_turn
    history = turn1.prompt_ids + turn1.reply_ids
    # The re-rendered history is token for token what turn 1 had in its cache ...
    assert turn2.prompt_ids[: len(history)] == history
    new = turn2.prompt_ids[len(history) :]  # "<|im_end|>\n<|im_start|>user\n" + message + generation prompt
    assert loaded.tokenizer.decode(new) == "\nuser\nThe capital of Italy\nassistant\n"  # specials are skipped
    # ... so turn 2 computes exactly the new tokens plus the last reply token (sampled at the token limit,
    # never fed back).
    assert turn2.computed_tokens == len(new) + 1
    assert turn2.cached_tokens == len(history) - 1
    assert runner.prefill_tokens - before == turn2.computed_tokens
    # and generates what a fresh engine computing the whole prompt generates.
    assert turn2.reply_ids == greedy_tokens(loaded, turn2.prompt_ids, params)
    assert second == loaded.tokenizer.decode(turn2.reply_ids)
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]


def test_context_overflow_drops_the_oldest_turns_and_keeps_the_system_prompt(loaded):
    notices = []
    params = SamplingParams(max_tokens=40)
    chat = ChatSession(loaded, params, system="Be brief.", notify=notices.append)
    context = chat.max_context  # 512 for the tiny model
    question = "The capital of France is Paris. " * 4
    turns = 0
    while not notices:
        chat.ask(question)
        turns += 1
        assert turns < 20, "the context never filled up"
    turn = chat.last_turn
    assert turn.dropped_messages >= 2 and turn.dropped_messages % 2 == 0
    assert turn.prompt_tokens + params.max_tokens <= context
    assert "dropped the oldest" in notices[0] and "system prompt is kept" in notices[0]
    messages = chat.messages
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in messages[1:]] == ["user", "assistant"] * ((len(messages) - 1) // 2)
    assert len(messages) - 1 == 2 * turns - turn.dropped_messages
    # what was kept is the newest turns, and the prompt is exactly their rendering
    plain = [{"role": m["role"], "content": m["content"]} for m in messages[:-1]]
    assert turn.prompt_ids == loaded.tokenizer.apply_chat_template(plain)


def test_a_message_longer_than_the_context_is_refused_and_the_chat_goes_on(loaded):
    chat = ChatSession(loaded, SamplingParams(max_tokens=3))
    with pytest.raises(InputError, match="does not fit"):
        chat.ask("Paris " * 600)
    assert chat.messages == []
    assert chat.ask("Hello") is not None and len(chat.messages) == 2


def test_interrupted_reply_is_kept_and_marked(loaded):
    chat = ChatSession(loaded, SamplingParams(max_tokens=50, logits_processors=(word_only(loaded.tokenizer),)))
    pieces = []
    for piece in chat.send("Hello world"):
        pieces.append(piece)
        if len(pieces) == 3:
            chat.cancel()
    turn = chat.last_turn
    assert turn.interrupted and 3 <= turn.generated_tokens < 50
    reply = chat.messages[-1]
    assert reply == {"role": "assistant", "content": "".join(pieces), "interrupted": True}
    chat.ask("Hello again")
    assert chat.last_turn.cached_tokens > turn.prompt_tokens  # the partial reply stayed in the KV cache

    # closing the stream early interrupts the same way
    stream = chat.send("One more")
    next(stream)
    stream.close()
    assert chat.last_turn.interrupted and chat.messages[-1]["interrupted"]


def test_clear_system_and_settings(loaded):
    chat = ChatSession(loaded, SamplingParams(max_tokens=3), system="One.")
    chat.ask("Hello")
    chat.clear()
    assert chat.messages == [{"role": "system", "content": "One."}] and chat.conversation.tokens == []
    chat.system = "Two."
    assert chat.messages == [{"role": "system", "content": "Two."}]
    chat.system = None
    assert chat.messages == []

    assert chat.set("temp", "0.7").temperature == 0.7
    assert chat.set("top_k", "5").top_k == 5
    assert chat.set("seed", "none").seed is None
    for name, value, message in [
        ("temp", "-1", "temperature must be"),
        ("top-p", "0", "top-p must be"),
        ("top-k", "1.5", "top-k must be an integer"),
        ("max-tokens", "0", "max-tokens must be"),
        ("min-p", "x", "min-p must be a number"),
        ("colour", "1", "unknown setting"),
    ]:
        with pytest.raises(InputError, match=message):
            chat.set(name, value)
    assert chat.params.temperature == 0.7  # a rejected value changes nothing


def test_a_model_without_chat_template_is_refused(tiny_llama_dir):
    lm = load_model(str(tiny_llama_dir), log=lambda m: None)
    lm.tokenizer.chat_template = None
    with pytest.raises(InputError, match="no chat template"):
        ChatSession(lm)


@pytest.mark.real_model
def test_smollm2_second_turn_reuses_the_first(smollm2_gguf):
    lm = load_model(str(smollm2_gguf), log=lambda m: None)
    chat = ChatSession(lm, SamplingParams(max_tokens=12))
    assert "Paris" in chat.ask("What is the capital of France?")
    turn1 = chat.last_turn
    assert turn1.finish_reason == "stop" and turn1.reply_ids[-1] in lm.tokenizer.eos_token_ids
    in_cache = list(chat.conversation.tokens)
    chat.ask("And of Italy?")
    turn2 = chat.last_turn
    history = turn1.prompt_ids + turn1.reply_ids
    assert turn2.prompt_ids[: len(history)] == history  # a real model's reply round-trips through the template
    # The final EOS (<|im_end|>, also the template's end of turn) is in the cache when the lookahead step
    # already fed it; otherwise it is computed with the new tokens.
    assert in_cache == history[: len(in_cache)] and len(in_cache) in (len(history) - 1, len(history))
    assert turn2.cached_tokens == len(in_cache)
    assert turn2.computed_tokens == len(turn2.prompt_ids) - len(in_cache)
