"""Speculative decoding on the real SmolLM2-135M-Instruct Q4_1 GGUF: greedy output unchanged, token for token.

There is no smaller model with SmolLM2's tokenizer at hand, so the draft-model case drafts with the model
itself (every draft is accepted: it checks the plumbing, not the speed)."""

from __future__ import annotations

import pytest

from mlxcel_core.api import prepare_prompt
from mlxcel_core.engine import Engine, EngineConfig, SpeculativeConfig
from mlxcel_core.loading import load_model
from mlxcel_core.sampling import SamplingParams

pytestmark = pytest.mark.real_model

CODE = """def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
"""
PROMPT = "Rename `width` to `w` in this code and print the whole code again:\n\n" + CODE


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return load_model(str(smollm2_gguf), log=lambda m: None)


def run(smol, config, params, draft=None):
    engine = Engine(smol.model, smol.tokenizer, config, draft=draft)
    seq_id = engine.open(prepare_prompt(smol.tokenizer, PROMPT), params)
    while engine.has_work():
        engine.step()
    return engine.sequence(seq_id)


def test_greedy_identical_on_smollm2(smol):
    params = SamplingParams(max_tokens=24)
    plain = run(smol, EngineConfig(), params)
    assert "def area" in smol.tokenizer.decode(plain.output_ids)
    for storage, spec, draft in (
        ("dense", SpeculativeConfig(ngram=3, num_draft_tokens=3), None),
        ("paged", SpeculativeConfig(ngram=2, num_draft_tokens=8), None),
        ("dense", SpeculativeConfig(draft_model="self", num_draft_tokens=4), smol),
    ):
        seq = run(smol, EngineConfig(storage=storage, speculative=spec), params, draft)
        assert seq.output_ids == plain.output_ids, (storage, spec)
        assert 0 < seq.spec.accepted <= seq.spec.proposed
        if draft is not None:
            assert seq.spec.accepted == seq.spec.proposed  # the model agrees with itself


def test_stop_string_mid_draft_on_smollm2(smol):
    params = SamplingParams(max_tokens=32, stop=("width *",))
    plain = run(smol, EngineConfig(), params)
    seq = run(smol, EngineConfig(speculative=SpeculativeConfig(ngram=3, num_draft_tokens=6)), params)
    assert seq.output_ids == plain.output_ids and seq.finish_reason == plain.finish_reason == "stop"
