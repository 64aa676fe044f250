"""The server through the official `openai` client: completions, chat, streaming, usage, logprobs, n, stop."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from mlxcel_core.loading.hf import read_config  # noqa: E402
from mlxcel_core.tokenizer import load_hf_tokenizer  # noqa: E402

NO_EOS = {"2": -100}  # the tiny model's EOS (<|im_end|>) never wins: every row runs to max_tokens


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=30, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_hf_tokenizer(tiny_llama_dir, read_config(tiny_llama_dir))


def test_models_lists_the_served_model(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model_id]


def test_completion_text_usage_and_finish_reason(client, server):
    r = client.completions.create(
        model=server.model_id, prompt="The capital of France", max_tokens=6, temperature=0, logit_bias=NO_EOS
    )
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_completion_from_token_ids_equals_text_prompt(client, server, tokenizer):
    text = "Hello world"
    a = client.completions.create(model=server.model_id, prompt=text, max_tokens=5, temperature=0)
    b = client.completions.create(model=server.model_id, prompt=tokenizer.encode(text), max_tokens=5, temperature=0)
    assert a.choices[0].text == b.choices[0].text


def test_chat_uses_the_template_with_system_and_turns(client, server, tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "The capital of Italy?"},
    ]
    r = client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=5, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    assert r.choices[0].finish_reason in ("stop", "length")


def test_streamed_chat_equals_whole_chat_and_reports_usage(client, server):
    kw = dict(
        model=server.model_id,
        messages=[{"role": "user", "content": "Tell me"}],
        max_completion_tokens=8,
        temperature=0,
        logit_bias=NO_EOS,
    )
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_completion_equals_whole_completion(client, server):
    kw = dict(model=server.model_id, prompt="A quick brown fox", max_tokens=7, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_completion_logprobs(client, server):
    r = client.completions.create(
        model=server.model_id, prompt="The cat", max_tokens=5, temperature=0, logprobs=2, logit_bias=NO_EOS
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs_with_bytes_and_top_alternatives(client, server, tokenizer):
    r = client.chat.completions.create(
        model=server.model_id,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        logit_bias=NO_EOS,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob >= item.top_logprobs[2].logprob
    # the bytes of the tokens, joined, decode to the message (the tokenizer is byte-level BPE)
    raw = b"".join(bytes(item.bytes) for item in content)
    assert raw.decode("utf-8", errors="replace") == r.choices[0].message.content


def test_n_choices_are_independent_sequences(client, server):
    r = client.completions.create(
        model=server.model_id, prompt="Hello", max_tokens=6, n=2, temperature=1.0, seed=3, logit_bias=NO_EOS
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text != r.choices[1].text  # seeds differ per choice
    assert r.usage.completion_tokens == 12
    again = client.completions.create(
        model=server.model_id, prompt="Hello", max_tokens=6, n=2, temperature=1.0, seed=3, logit_bias=NO_EOS
    )
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible


def test_n_choices_stream(client, server):
    chunks = list(
        client.chat.completions.create(
            model=server.model_id,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            n=2,
            temperature=0,
            stream=True,
            logit_bias=NO_EOS,
        )
    )
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1]


def test_stop_string_truncates_and_finishes_with_stop(client, server):
    kw = dict(model=server.model_id, prompt="The capital", max_tokens=16, temperature=0, logit_bias=NO_EOS)
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 4
    stop = full[2:4]
    for stops in (stop, [stop, "never-appears"]):
        r = client.completions.create(**kw, stop=stops)
        assert r.choices[0].text == full[: full.index(stop)]
        assert r.choices[0].finish_reason == "stop"


def test_penalties_change_the_output(client, server):
    kw = dict(model=server.model_id, prompt="The capital", max_tokens=20, temperature=0, logit_bias=NO_EOS)
    plain = client.completions.create(**kw).choices[0].text
    penalized = (
        client.completions.create(
            **kw, frequency_penalty=2.0, presence_penalty=2.0, extra_body={"repetition_penalty": 1.5}
        )
        .choices[0]
        .text
    )
    assert penalized != plain


@pytest.mark.parametrize(
    "extra",
    [
        {"repeat_penalty": 1.5, "repeat_last_n": -1},
        {"dry_multiplier": 2.0, "dry_base": 2.0, "dry_allowed_length": 1, "dry_sequence_breakers": ["never"]},
    ],
)
def test_llama_cpp_penalties_change_the_output(client, server, extra):
    kw = dict(model=server.model_id, prompt="The capital", max_tokens=24, temperature=0, logit_bias=NO_EOS)
    plain = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw, extra_body=extra).choices[0].text != plain


def test_xtc_and_suppression_reach_the_sampler(client, server, tokenizer):
    kw = dict(model=server.model_id, prompt="The capital", max_tokens=8, temperature=0.7, seed=5, logit_bias=NO_EOS)
    plain = client.completions.create(**kw).choices[0].text
    xtc = {"xtc_probability": 1.0, "xtc_threshold": 0.01, "top_k": 40, "min_p": 0.0}
    assert client.completions.create(**kw, extra_body=xtc).choices[0].text != plain
    greedy = dict(kw, temperature=0)
    text = client.completions.create(**greedy).choices[0].text
    banned = sorted(set(tokenizer.encode(text)))
    other = client.completions.create(**greedy, extra_body={"suppress_tokens": banned}).choices[0].text
    assert other != text and not set(tokenizer.encode(other)) >= set(banned)


def test_logit_bias_forces_a_token(client, server, tokenizer):
    token = tokenizer.encode("Paris")[0]
    r = client.completions.create(
        model=server.model_id, prompt="x", max_tokens=3, temperature=0, logit_bias={str(token): 100}
    )
    assert r.choices[0].text == tokenizer.decode([token] * 3)


def test_prefix_cache_reports_cached_tokens(client, server):
    prompt = "The capital of France is Paris. " * 6  # over two 32-token blocks
    first = client.completions.create(model=server.model_id, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=server.model_id, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 32
    assert second.choices[0].text == first.choices[0].text
    assert server.metrics()["mlxcel_prefix_cache_hits_total"] >= 1


def test_model_aliases_are_accepted(client, server, tiny_llama_dir):
    for name in (server.model_id, tiny_llama_dir.name, str(tiny_llama_dir)):
        r = client.completions.create(model=name, prompt="Hi", max_tokens=1)
        assert r.model == name


def test_tokenize_detokenize_round_trip(server, tokenizer):
    with server.client() as http:
        tokens = http.post("/tokenize", json={"content": "Hello world"}).json()["tokens"]
        assert tokens == tokenizer.encode("Hello world")
        assert http.post("/detokenize", json={"tokens": tokens}).json() == {"content": "Hello world"}
