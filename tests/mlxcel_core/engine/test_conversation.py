"""Multi-turn chat keeps its KV state: turn 2 prefills only what is new, with unchanged output."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny_llama

from mlxcel_core.engine import Conversation, Engine, EngineConfig
from mlxcel_core.loading import load_model
from mlxcel_core.sampling import SamplingParams

# A Conversation rides on dense storage, as ChatSession pins it: "auto" is paged on a GPU, and paged storage
# reuses earlier turns through prefix-cached whole blocks instead.
DENSE = EngineConfig(storage="dense")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    # head_dim 32 so the quantized-KV case applies
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-chat"), num_attention_heads=2, num_key_value_heads=1)
    lm = load_model(str(path), log=lambda m: None)
    lm.tokenizer.eos_token_ids = set()
    return lm


def turn(engine, prompt, conversation=None, max_tokens=6):
    seq = engine.open(prompt, SamplingParams(max_tokens=max_tokens), conversation)
    tokens = []
    while engine.has_work():
        for o in engine.step():
            assert o.error is None, o.error
            tokens += [o.token] if o.token is not None else []
    return tokens, engine.sequence(seq).cached_tokens


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_second_turn_prefills_only_new_tokens(loaded, kv_bits):
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(storage="dense", kv_bits=kv_bits))
    chat = Conversation()
    first_prompt = [5, 17, 42, 99, 3, 250, 7]
    reply, cached = turn(engine, first_prompt, chat)
    assert cached == 0
    new = [2, 198, 1, 77, 88, 198]  # template glue + the next user message
    second_prompt = first_prompt + reply + new
    before = engine.runner.prefill_tokens
    reply2, cached = turn(engine, second_prompt, chat)
    # The last reply token was sampled but never fed back, so it is computed with the new tokens.
    assert cached == len(first_prompt) + len(reply) - 1
    assert engine.runner.prefill_tokens - before == len(new) + 1

    fresh_engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(storage="dense", kv_bits=kv_bits))
    assert turn(fresh_engine, second_prompt)[0] == reply2


def test_edited_history_reuses_only_the_common_prefix(loaded):
    engine = Engine(loaded.model, loaded.tokenizer, DENSE)
    chat = Conversation()
    reply, _ = turn(engine, [5, 17, 42, 99, 3, 250, 7], chat)
    edited = [5, 17, 42, 11, 12, 13]
    tokens, cached = turn(engine, edited, chat)
    assert cached == 3
    assert tokens == turn(Engine(loaded.model, loaded.tokenizer, DENSE), edited)[0]


def test_cancelled_reply_stays_in_the_conversation(loaded):
    engine = Engine(loaded.model, loaded.tokenizer, DENSE)
    chat = Conversation()
    seq = engine.open([5, 17, 42, 99], SamplingParams(max_tokens=50), chat)
    got = []
    for _ in range(4):
        got += [o.token for o in engine.step() if o.token is not None]
    engine.close(seq)
    while engine.has_work():
        engine.step()
    assert chat.tokens[:4] == [5, 17, 42, 99]
    assert chat.tokens[4:] == got[: len(chat.tokens) - 4]
