"""A server with a drafter: a request decoding alone speculates (stats on /metrics), concurrent requests fall
back to plain batched decoding, and every answer equals the plain server's."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from mlxcel_core.engine import EngineConfig, SpeculativeConfig

COMPLETIONS = "/v1/completions"
NO_EOS = {"2": -100}
PROMPTS = ["The capital of France is Paris. The capital of France is", "Hello world! Hello", "A quick brown fox"]


def complete(server, prompt: str) -> str:
    with server.client() as http:
        response = http.post(
            COMPLETIONS, json={"prompt": prompt, "max_tokens": 24, "temperature": 0, "logit_bias": NO_EOS}
        )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.mark.parametrize("storage", ["dense", "paged"])
def test_speculating_server_answers_like_the_plain_one(make_server, storage):
    plain = make_server(engine=EngineConfig(max_batch_size=4, storage=storage))
    expected = [complete(plain, p) for p in PROMPTS]
    spec = make_server(
        engine=EngineConfig(
            max_batch_size=4, storage=storage, speculative=SpeculativeConfig(ngram=3, num_draft_tokens=4)
        )
    )
    assert [complete(spec, p) for p in PROMPTS] == expected  # one at a time: each speculates
    m = spec.metrics()
    rounds, proposed, accepted = (
        m["mlxcel_spec_rounds_total"],
        m["mlxcel_spec_draft_tokens_total"],
        m["mlxcel_spec_accepted_tokens_total"],
    )
    assert rounds > 0 and 0 < accepted <= proposed <= 4 * rounds
    with ThreadPoolExecutor(3) as pool:  # together: batched rows decode plainly, same answers
        assert list(pool.map(lambda p: complete(spec, p), PROMPTS * 2)) == expected * 2
    assert "mlxcel_spec_rounds_total" not in plain.metrics() or plain.metrics()["mlxcel_spec_rounds_total"] == 0
