"""Speculative decoding with recurrent layers (engine/recurrent_rollback.py): for tiny qwen3_5, lfm2 and nemotron_h
targets saved by transformers, greedy output with a draft model is the plain output token for token, on dense and
paged storage, with a draft that disagrees often (the target with noise on its matrices: rounds reject draft tokens,
so the target's state goes back to a checkpoint and the draft's too) and with the target itself as the draft (every
draft token accepted); prompt lookup too; and through `mlxcel generate --draft-model --json`."""

from __future__ import annotations

import json
import shutil

import pytest
from parity import load_quiet, prompt_ids
from recurrent_tiny import FAMILIES, save_tiny_recurrent

from mlxcel_core.engine import Engine, EngineConfig, SpeculativeConfig
from mlxcel_core.sampling import SamplingParams

PROMPTS = [prompt_ids(9, seed=1), prompt_ids(30, seed=2)]


def noisy_copy(src, dst, scale: float):
    """The checkpoint with noise on every matrix (`scale` of its spread): the same tokenizer, a model that agrees
    with the original on part of the tokens."""
    import mlx.core as mx

    shutil.copytree(src, dst)
    weights = mx.load(str(dst / "model.safetensors"))
    noisy = {
        name: w + scale * mx.std(w) * mx.random.normal(w.shape, key=mx.random.key(i)) if w.ndim == 2 else w
        for i, (name, w) in enumerate(sorted(weights.items()))
    }
    mx.save_safetensors(str(dst / "model.safetensors"), noisy, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(target dir, noisy draft dir) of one family (recurrent_tiny.py's checkpoints)."""
    root = tmp_path_factory.mktemp(request.param)
    target = save_tiny_recurrent(root / "target", request.param)
    return target, noisy_copy(target, root / "draft", 0.05)


def generate(loaded, prompt, config: EngineConfig, draft=None, max_tokens: int = 40):
    engine = Engine(loaded.model, loaded.tokenizer, config, draft=draft)
    seq_id = engine.open(prompt, SamplingParams(max_tokens=max_tokens))
    while engine.has_work():
        engine.step()
    seq = engine.sequence(seq_id)
    assert seq.error is None, seq.error
    return seq


def spec_config(storage: str, **drafter) -> EngineConfig:
    return EngineConfig(
        storage=storage,
        block_size=8,
        compile_decode=False,
        speculative=SpeculativeConfig(num_draft_tokens=4, **drafter),
    )


@pytest.mark.parametrize("storage", ["dense", "paged"])
def test_greedy_output_is_the_plain_output(family, storage):
    target_dir, draft_dir = family
    target = load_quiet(target_dir)
    target.tokenizer.eos_token_ids = set()
    drafts = {"noisy": load_quiet(draft_dir), "itself": load_quiet(target_dir)}
    plain_config = EngineConfig(storage=storage, block_size=8, compile_decode=False)
    for prompt in PROMPTS:
        plain = generate(target, prompt, plain_config).output_ids
        assert len(plain) == 40
        noisy = generate(target, prompt, spec_config(storage, draft_model="noisy"), drafts["noisy"])
        assert noisy.output_ids == plain
        assert 0 < noisy.spec.accepted < noisy.spec.proposed  # rounds both accept and reject draft tokens
        itself = generate(target, prompt, spec_config(storage, draft_model="itself"), drafts["itself"])
        assert itself.output_ids == plain
        assert itself.spec.accepted > itself.spec.proposed // 2  # (a prompt's last token is computed as a prompt's)
        lookup = generate(target, prompt, spec_config(storage, ngram=2))
        assert lookup.output_ids == plain


def test_generate_with_a_draft_model_through_the_cli(family, capsys):
    from mlxcel_cli.main import main

    target_dir, draft_dir = family
    base = ["generate", "-m", str(target_dir), "-p", "The capital of France", "-n", "40", "--no-chat-template"]
    assert main(base + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--draft-model", str(draft_dir), "--num-draft-tokens", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["token_ids"] == plain["token_ids"] and result["text"] == plain["text"]
    spec = result["speculative"]
    assert 0 < spec["accepted"] < spec["proposed"]


def test_verified_tokens_get_the_decode_steps_maths(tmp_path):
    """Nemotron-H clamps a prompt's dt and not a decode step's: a forward over several generated tokens whose caches
    say `decode_tokens` gives the logits and state of decoding them one at a time, and without it would not (the
    steps are made small, below time_step_limit's floor, so that the clamp matters)."""
    import mlx.core as mx
    import numpy as np

    from mlxcel_core.cache import make_cache
    from mlxcel_core.engine.recurrent_rollback import decode_tokens

    path = save_tiny_recurrent(tmp_path / "nemotron_h", "nemotron_h")
    model = load_quiet(path).model
    for layer in model.model.layers:
        if hasattr(layer.mixer, "dt_bias"):
            layer.mixer.dt_bias = mx.full(layer.mixer.dt_bias.shape, -6.0)
    prompt, generated = prompt_ids(12, seed=3), prompt_ids(5, seed=4)

    def prefilled():
        caches = make_cache(len(model.layers))
        model(mx.array([prompt]), caches)
        return caches

    stepped = prefilled()
    one_at_a_time = np.concatenate([np.array(model(mx.array([[t]]), stepped)[0]) for t in generated])
    together = prefilled()
    verified = np.array(model(mx.array([generated]), decode_tokens(together))[0])
    np.testing.assert_allclose(verified, one_at_a_time, atol=1e-4)
    for mine, theirs in zip(together, stepped):
        for a, b in zip(mine.recurrent or [], theirs.recurrent or []):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)
    as_prompt = np.array(model(mx.array([generated]), prefilled())[0])
    assert np.abs(as_prompt - one_at_a_time).max() > 1e-3  # ten times the bound above


def test_server_with_a_draft_model(family):
    """`mlxcel serve --draft-model` (paged storage, batch 4): a request decoding alone speculates, rounds reject draft
    tokens, and the answer is the plain server's."""
    from servers import start_server

    target_dir, draft_dir = family
    body = {"prompt": "The capital of France", "max_tokens": 32, "temperature": 0}

    def answer(**speculative) -> tuple[str, dict]:
        config = EngineConfig(max_batch_size=4, speculative=SpeculativeConfig(**speculative) if speculative else None)
        server = start_server(target_dir, engine=config)
        try:
            with server.client() as http:
                response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"], server.metrics()
        finally:
            server.stop()

    plain, _ = answer()
    text, metrics = answer(draft_model=str(draft_dir), num_draft_tokens=3)
    assert text == plain
    assert 0 < metrics["mlxcel_spec_accepted_tokens_total"] < metrics["mlxcel_spec_draft_tokens_total"]
