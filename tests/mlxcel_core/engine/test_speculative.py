"""Speculative decoding through the engine (issue 9): with either drafter and any k, the output is the output
without speculation, token for token (greedy; seeded sampling too), including stops and token limits that
land mid-draft, on dense and paged storage; stats add up; a draft model with another vocabulary is refused."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from tiny_models import build_tokenizer, save_tiny_llama

from mlxcel_core.chat import ChatSession
from mlxcel_core.engine import Engine, EngineConfig, SpeculativeConfig
from mlxcel_core.engine.speculative import ngram_proposal
from mlxcel_core.errors import InputError
from mlxcel_core.loading import load_model
from mlxcel_core.sampling import SamplingParams

rng = np.random.default_rng(5)
_motif = rng.integers(3, 300, size=12).tolist()
PROMPTS = [
    rng.integers(3, 300, size=6).tolist(),
    _motif + rng.integers(3, 300, size=5).tolist() + _motif[:6],  # prompt lookup finds the motif again
    rng.integers(3, 300, size=40).tolist(),
]
DRAFTERS = {"ngram1": dict(ngram=1), "ngram3": dict(ngram=3), "model": dict(draft_model="draft")}


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    lm = load_model(str(tiny_llama_dir), log=lambda m: None)
    lm.tokenizer.eos_token_ids = set()
    return lm


@pytest.fixture(scope="module")
def draft_dir(tiny_llama_dir, tmp_path_factory):
    """The target with noise on every matrix (10% of its spread): same tokenizer, agrees with the target
    on a good part of the tokens but not all (so drafts are both accepted and rejected)."""
    import mlx.core as mx

    path = tmp_path_factory.mktemp("tiny-draft") / "draft"
    shutil.copytree(tiny_llama_dir, path)
    weights = mx.load(str(path / "model.safetensors"))
    noisy = {
        name: w + 0.1 * mx.std(w) * mx.random.normal(w.shape, key=mx.random.key(i)) if w.ndim == 2 else w
        for i, (name, w) in enumerate(sorted(weights.items()))
    }
    mx.save_safetensors(str(path / "model.safetensors"), noisy, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def draft(draft_dir):
    return load_model(str(draft_dir), log=lambda m: None)


def generate(lm, prompt, params, config=None, draft=None, eos=None):
    config = config or EngineConfig()
    saved = lm.tokenizer.eos_token_ids
    if eos is not None:
        lm.tokenizer.eos_token_ids = eos
    try:
        engine = Engine(lm.model, lm.tokenizer, config, draft=draft)
        seq_id = engine.open(prompt, params)
        outputs = []
        while engine.has_work():
            outputs += [o for o in engine.step() if o.seq_id == seq_id]
    finally:
        lm.tokenizer.eos_token_ids = saved
    seq = engine.sequence(seq_id)
    assert seq.error is None, seq.error
    text = "".join(o.text for o in outputs)
    return seq, text, engine


def speculative(storage="dense", k=4, **drafter):
    return EngineConfig(storage=storage, block_size=8, speculative=SpeculativeConfig(num_draft_tokens=k, **drafter))


def check_stats(seq, k):
    s = seq.spec
    assert s.rounds >= 1
    assert 0 <= s.accepted <= s.proposed <= k * s.rounds
    assert s.acceptance_rate == pytest.approx(s.accepted / s.proposed)
    assert s.mean_accepted == pytest.approx(s.accepted / s.rounds)
    # every round emits at most accepted + 1 tokens, and speculation saved decode steps
    assert len(seq.output_ids) <= 1 + s.accepted + s.rounds + (len(seq.output_ids) - 1)


# ---------------------------------------------------------------- prompt lookup proposals


@pytest.mark.parametrize(
    "tokens, max_ngram, k, expected",
    [
        ([1, 2, 3, 4, 1, 2], 2, 2, [3, 4]),  # "1 2" occurred: what followed it
        ([1, 2, 3, 4, 1, 2], 2, 5, [3, 4, 1, 2]),  # fewer than k follow: all of them
        ([5, 1, 2, 9, 1, 2, 7, 7, 1, 2], 2, 2, [7, 7]),  # the latest occurrence with k tokens after it
        ([5, 1, 2, 9, 1, 2, 7, 1, 2], 2, 3, [7, 1, 2]),  # (the match just before the end has 1 after it)
        ([1, 2, 9, 1, 2, 7, 1, 2], 2, 8, [9, 1, 2, 7, 1, 2]),  # none has 8 after it: the earliest (most after it)
        ([1, 2, 3, 9, 2, 3], 3, 2, [9, 2]),  # "9 2 3" never occurred; "2 3" did
        ([4, 5, 6, 7], 3, 2, []),  # nothing repeats
        ([7], 3, 2, []),
        ([3, 3, 3], 2, 4, [3]),  # overlapping matches
    ],
)
def test_ngram_proposal(tokens, max_ngram, k, expected):
    assert ngram_proposal(tokens, max_ngram, k) == expected


def test_longer_ngram_wins_over_a_later_shorter_match():
    tokens = [1, 2, 3, 50, 60, 9, 3, 70, 2, 3]  # "2 3" -> 50 60; the later single "3" -> 70
    assert ngram_proposal(tokens, 2, 2) == [50, 60]
    assert ngram_proposal(tokens, 1, 1) == [70]


# ---------------------------------------------------------------- greedy: identical output


@pytest.mark.parametrize("storage", ["dense", "paged"])
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_output_is_identical(target, draft, storage, drafter, k):
    accepted = 0
    for prompt in PROMPTS:
        params = SamplingParams(max_tokens=40)
        plain, _, _ = generate(target, prompt, params, EngineConfig(storage=storage, block_size=8))
        seq, _, engine = generate(target, prompt, params, speculative(storage, k, **DRAFTERS[drafter]), draft)
        assert seq.output_ids == plain.output_ids, (drafter, k)
        check_stats(seq, k)
        assert engine.speculator.stats == seq.spec
        accepted += seq.spec.accepted
    assert accepted > 0  # the drafts were not all rejected: the accepting path is exercised too


def test_chunked_prefill_of_target_and_draft(target, draft):
    for drafter in DRAFTERS.values():
        base = EngineConfig(prefill_chunk_size=7)
        plain, _, _ = generate(target, PROMPTS[2], SamplingParams(max_tokens=30), base)
        config = dataclasses.replace(base, speculative=SpeculativeConfig(num_draft_tokens=5, **drafter))
        seq, _, _ = generate(target, PROMPTS[2], SamplingParams(max_tokens=30), config, draft)
        assert seq.output_ids == plain.output_ids


@pytest.mark.parametrize("storage", ["dense", "paged"])
def test_quantized_kv(tmp_path, storage):
    lm = load_model(
        str(save_tiny_llama(tmp_path / "hd32", num_attention_heads=2, num_key_value_heads=1)), log=lambda m: None
    )  # head dim 32: quantized KV's group size
    lm.tokenizer.eos_token_ids = set()
    base = EngineConfig(kv_bits=8, storage=storage, block_size=8)
    plain, _, _ = generate(lm, PROMPTS[1], SamplingParams(max_tokens=30), base)
    config = dataclasses.replace(base, speculative=SpeculativeConfig(num_draft_tokens=4, ngram=2))
    seq, _, _ = generate(lm, PROMPTS[1], SamplingParams(max_tokens=30), config)
    assert seq.output_ids == plain.output_ids and seq.spec.accepted > 0


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_penalties_and_seeded_sampling_are_identical_too(target, draft, drafter):
    """Verification draws with the row's own sampler and random stream, so even sampled output is unchanged."""
    for params in (
        SamplingParams(max_tokens=30, repetition_penalty=1.3, presence_penalty=0.5, dry_multiplier=0.8),
        SamplingParams(max_tokens=30, temperature=0.7, top_k=5, seed=9),
        SamplingParams(max_tokens=30, temperature=0.3, seed=4, xtc_probability=0.5, xtc_threshold=0.3),
    ):
        plain, _, _ = generate(target, PROMPTS[1], params)
        seq, _, _ = generate(target, PROMPTS[1], params, speculative(k=4, **DRAFTERS[drafter]), draft)
        assert seq.output_ids == plain.output_ids, params


# ---------------------------------------------------------------- ends that land mid-draft


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_max_tokens_and_stops_mid_draft(target, draft, drafter):
    prompt = PROMPTS[1]
    config = speculative(k=6, **DRAFTERS[drafter])
    full, full_text, _ = generate(target, prompt, SamplingParams(max_tokens=30))
    for n in (1, 2, 3, 7, 11, 17):  # every limit gives the same prefix
        seq, _, _ = generate(target, prompt, SamplingParams(max_tokens=n), config, draft)
        assert seq.output_ids == full.output_ids[:n] and seq.finish_reason == "length"
    assert len(full_text) > 12
    for start in (1, 5, 9):
        stop = full_text[start : start + 2]
        params = SamplingParams(max_tokens=30, stop=(stop,))
        plain, plain_text, _ = generate(target, prompt, params)
        seq, text, _ = generate(target, prompt, params, config, draft)
        assert (seq.output_ids, text, seq.finish_reason) == (plain.output_ids, plain_text, "stop")
        assert text == full_text[: full_text.index(stop)]
    eos = full.output_ids[9]
    plain, _, _ = generate(target, prompt, SamplingParams(max_tokens=30), eos={eos})
    seq, _, _ = generate(target, prompt, SamplingParams(max_tokens=30), config, draft, eos={eos})
    assert seq.output_ids == plain.output_ids and seq.output_ids[-1] == eos and seq.finish_reason == "stop"


# ---------------------------------------------------------------- batching falls back, chat turns


@pytest.mark.parametrize("storage", ["dense", "paged"])
def test_batched_rows_decode_plainly_and_match(target, draft, storage):
    params = [SamplingParams(max_tokens=n) for n in (25, 8, 14)]
    expected = [generate(target, p, sp)[0].output_ids for p, sp in zip(PROMPTS, params)]
    # (whole prompts a step, whatever the backend's chunk: the rows then end in max_tokens order)
    config = dataclasses.replace(speculative(storage, k=4, ngram=2), max_batch_size=4, prefill_chunk_size=2048)
    engine = Engine(target.model, target.tokenizer, config)
    ids = [engine.open(p, sp) for p, sp in zip(PROMPTS, params)]
    while engine.has_work():
        engine.step()
    assert [engine.sequence(i).output_ids for i in ids] == expected
    # the longest row decoded alone at the end and speculated then
    assert engine.sequence(ids[0]).spec.rounds > 0 and engine.sequence(ids[1]).spec.rounds == 0


def test_chat_turns_with_speculation(target, draft_dir):
    if not target.tokenizer.chat_template:
        pytest.skip("no chat template")
    answers = []
    for config in (EngineConfig(), speculative(k=3, draft_model=str(draft_dir))):
        chat = ChatSession(target, SamplingParams(max_tokens=20), engine_config=config)
        answers.append([chat.ask("Hello there"), chat.ask("The capital of France"), chat.last_turn.reply_ids])
    assert answers[0] == answers[1]


# ---------------------------------------------------------------- refusals


def test_mismatched_vocabulary_is_refused(target, draft_dir, tmp_path):
    other = tmp_path / "other-vocab"
    shutil.copytree(draft_dir, other)
    build_tokenizer(vocab_size=300).save(str(other / "tokenizer.json"))
    config = speculative(k=3, draft_model=str(other))
    with pytest.raises(InputError, match="different vocabulary.*same tokenizer"):
        Engine(target.model, target.tokenizer, config)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_draft_tokens=0, ngram=2), "num-draft-tokens"),
        (dict(num_draft_tokens=65, ngram=2), "num-draft-tokens"),
        (dict(ngram=-1), "draft-ngram"),
        (dict(ngram=2, draft_model="x"), "not both"),
        (dict(), "needs a drafter"),
    ],
)
def test_bad_speculative_config(kwargs, message):
    with pytest.raises(InputError, match=message):
        SpeculativeConfig(**kwargs)


# ---------------------------------------------------------------- the CLI


def test_generate_verbose_prints_stats_and_json_has_them(tiny_llama_dir, draft_dir, capsys):
    from mlxcel_cli.main import main

    base = ["generate", "-m", str(tiny_llama_dir), "-p", "The capital of France", "-n", "24", "--no-chat-template"]
    assert main(base + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    for extra in (["--draft-ngram", "2", "--num-draft-tokens", "4"], ["--draft-model", str(draft_dir)]):
        assert main(base + extra + ["--json", "--verbose"]) == 0
        out, err = capsys.readouterr()
        result = json.loads(out)
        assert result["token_ids"] == plain["token_ids"]
        spec = result["speculative"]
        assert 0 <= spec["accepted"] <= spec["proposed"] and spec["rounds"] >= 1
        assert "speculative:" in err and f"{spec['proposed']} draft tokens proposed" in err
    assert "draft model:" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--draft-ngram", "2", "--num-draft-tokens", "0"], "num-draft-tokens must be"),
        (["--draft-ngram", "-3"], "draft-ngram must be"),
        (["--draft-ngram", "2", "--draft-model", "x"], "not both"),
    ],
)
def test_generate_bad_speculative_options_exit_2(tiny_llama_dir, capsys, args, message):
    from mlxcel_cli.main import main

    assert main(["generate", "-m", str(tiny_llama_dir), "-p", "hi", *args]) == 2
    assert message in capsys.readouterr().err


def test_generate_refuses_a_mismatched_draft_model(tiny_llama_dir, draft_dir, tmp_path, capsys):
    from mlxcel_cli.main import main

    other = tmp_path / "other-vocab"
    shutil.copytree(draft_dir, other)
    build_tokenizer(vocab_size=300).save(str(other / "tokenizer.json"))
    assert main(["generate", "-m", str(tiny_llama_dir), "-p", "hi", "--draft-model", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mlxcel: error: draft model") and "different vocabulary" in err[-1]
