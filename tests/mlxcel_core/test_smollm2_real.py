"""The real SmolLM2-135M-Instruct Q4_1 GGUF against transformers (dequantized GGUF, fp32)."""

from __future__ import annotations

import hashlib
import json

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
    """Per prompt: transformers' chat-template ids and greedy tokens, cached beside the file (a minute to compute),
    keyed by the file's bytes, the transformers version, the prompts and the steps."""
    import transformers

    digest = hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest()
    key = hashlib.sha256(json.dumps([digest, transformers.__version__, PROMPTS, STEPS]).encode()).hexdigest()[:16]
    cached = smollm2_gguf.with_name(f"transformers-chat-reference-{key}.json")
    if cached.is_file():
        return {prompt: tuple(value) for prompt, value in json.loads(cached.read_text()).items()}
    out = _transformers_reference(smollm2_gguf)
    cached.write_text(json.dumps(out))
    return out


def _transformers_reference(path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": path.name}
    tok = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs).eval()
    out = {}
    for prompt in PROMPTS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False)
        out[prompt] = (list(ids), gen[0, len(ids) :].tolist())
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
