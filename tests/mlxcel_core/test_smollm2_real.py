"""The real SmolLM2-135M-Instruct Q4_1 GGUF against transformers (dequantized GGUF, fp32)."""

from __future__ import annotations

import pytest

from mlxcel_core.api import generate, prepare_prompt, stream_generate
from mlxcel_core.loading import load_model
from mlxcel_core.sampling import SamplingParams

pytestmark = pytest.mark.real_model

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in one sentence what a CPU does.",
    "List three primary colors.",
]
STEPS = 24


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return load_model(str(smollm2_gguf), log=lambda m: None)


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": smollm2_gguf.name}
    tok = AutoTokenizer.from_pretrained(smollm2_gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, dtype=torch.float32, **kwargs).eval()
    out = {}
    for prompt in PROMPTS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False)
        out[prompt] = (ids, gen[0, len(ids) :].tolist())
    return out


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_tokens_and_greedy_continuation_match_transformers(ours, reference, prompt):
    ref_ids, ref_tokens = reference[prompt]
    ids = prepare_prompt(ours.tokenizer, prompt)
    assert ids == ref_ids
    tokens = [c.token for c in stream_generate(ours, ids, SamplingParams(max_tokens=STEPS)) if c.token is not None]
    # transformers keeps going past EOS only if it never generated it; we stop at EOS.
    assert tokens == ref_tokens[: len(tokens)]
    assert len(tokens) == STEPS or tokens[-1] in ours.tokenizer.eos_token_ids


def test_france_answer_names_paris(ours):
    result = generate(ours, "What is the capital of France?")
    assert result.text == "The capital of France is Paris."
    assert result.finish_reason == "stop"
