"""Constrained decoding in the engine (engine/constrained.py) on the tiny random Llama: every output matches its
grammar, a disallowed token is never drawn even as the argmax, grammar completion stops the row, dead ends end only
their row, unconstrained neighbours get exactly their tokens alone, and lookahead or speculation change nothing."""

from __future__ import annotations

import json
import re

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from engine_drive import run_rows

from mlxcel_core.constraints import Constraint, ConstraintError
from mlxcel_core.engine import Engine, EngineConfig, SpeculativeConfig, constrained
from mlxcel_core.loading import load_model
from mlxcel_core.sampling import RowSampler, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "color": {"enum": ["red", "green"]},
    },
    "required": ["ok", "n", "color"],
    "additionalProperties": False,
}
DIGITS = Constraint.regex("[0-9]{2,6}")
LARK = Constraint.grammar('start: "(" ITEM ("," ITEM)* ")"\nITEM: /[a-c]/\n')


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), log=lambda m: None)


def run(loaded, rows, config=None, prompt="Hello world", engine=None):
    """[(params)...] -> [(text, tokens, finish_reason, error)], all rows opened at once."""
    engine = engine or Engine(loaded.model, loaded.tokenizer, config or EngineConfig(max_batch_size=max(len(rows), 1)))
    ran = run_rows(engine, loaded.tokenizer.encode(prompt), rows)
    return [(loaded.tokenizer.decode(tokens), tokens, reason, error) for tokens, reason, error in ran]


def params(constraint=None, **kw):
    return SamplingParams(max_tokens=kw.pop("max_tokens", 40), constraint=constraint, **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_match_their_grammars(loaded, temperature):
    rows = [params(Constraint.json_schema(SCHEMA), temperature=temperature, seed=1)]
    rows += [params(DIGITS, temperature=temperature, seed=2), params(LARK, temperature=temperature, seed=3)]
    (schema_text, _, reason, _), (digits, *_), (lark, *_) = run(loaded, rows)
    assert reason == "stop"
    jsonschema.validate(json.loads(schema_text), SCHEMA)
    assert re.fullmatch("[0-9]{2,6}", digits)
    assert re.fullmatch(r"\([a-c](,[a-c])*\)", lark) or re.fullmatch(r"\([a-c](,[a-c])*", lark)


def test_grammar_completion_stops_the_row(loaded):
    [(text, tokens, reason, error)] = run(loaded, [params(Constraint.regex("abc"), max_tokens=30)])
    assert (text, reason, error) == ("abc", "stop", None)
    assert len(tokens) <= 3


def test_the_argmax_is_never_drawn_when_disallowed(loaded):
    """Unconstrained, the tiny model's first greedy token is not a digit; constrained to digits it never appears."""
    [(free_text, free_tokens, *_)] = run(loaded, [params(max_tokens=1)])
    assert not free_text.isdigit()
    [(text, tokens, *_)] = run(loaded, [params(DIGITS)])
    assert free_tokens[0] not in tokens and text.isdigit()


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_the_sampler_masks_before_every_stage(temperature):
    """A row whose argmax (and almost all its mass) is on a disallowed token draws only allowed ones."""
    logits = mx.array([[0.0, 50.0, 1.0, 0.5, 40.0]])
    allowed = mx.array([True, False, True, True, False])
    sampler = RowSampler(SamplingParams(temperature=temperature, seed=0, logit_bias={1: 100.0}, top_k=2))
    drawn = {sampler.draw(sampler.process(logits, [], allowed)).item() for _ in range(50)}
    assert drawn <= {0, 2, 3} and drawn


@pytest.mark.parametrize("storage", ["dense", "paged"])
def test_unconstrained_rows_get_their_tokens_alone(loaded, storage):
    free = [params(max_tokens=12), params(temperature=1.0, top_p=0.9, seed=7, max_tokens=12)]
    constrained_rows = [params(Constraint.json_schema(SCHEMA)), params(DIGITS, temperature=0.7, seed=5)]
    mixed = run(loaded, [free[0], constrained_rows[0], free[1], constrained_rows[1]], EngineConfig(4, storage=storage))
    for row, index in ((free[0], 0), (free[1], 2)):
        [alone] = run(loaded, [row], EngineConfig(1, storage=storage))
        assert mixed[index][1] == alone[1]


@pytest.mark.parametrize("lookahead", [True, False])
def test_lookahead_changes_nothing(loaded, lookahead):
    rows = [params(Constraint.json_object(), temperature=1.0, seed=4), params(LARK), params(max_tokens=20)]
    reference = run(loaded, rows, EngineConfig(3, lookahead=False))
    assert run(loaded, rows, EngineConfig(3, lookahead=lookahead)) == reference


def test_speculative_rounds_verify_drafts_against_the_mask(loaded):
    """Prompt lookup drafts from a prompt full of the grammar's own text: the output equals plain decoding."""
    prompt = "(a,b,c,a,b) (a,b,c,a,b) 12345 12345 (a,b,c"
    rows = [params(LARK), params(DIGITS, temperature=0.9, seed=3)]
    spec = EngineConfig(1, speculative=SpeculativeConfig(num_draft_tokens=4, ngram=3))
    for row in rows:
        [plain] = run(loaded, [row], EngineConfig(1), prompt=prompt)
        [speculated] = run(loaded, [row], spec, prompt=prompt)
        assert speculated == plain


def test_draft_masks_leave_the_matcher_where_it_was(loaded):
    grammars = constrained.Grammars(loaded.tokenizer, loaded.model.args.vocab_size)
    row = grammars.open(Constraint.regex("abc"))
    a, b, c = (loaded.tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abc")
    masks = row.draft_masks([a, b, a])  # the third token is refused: verification stops there
    bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")
    assert bits[0, a] and bits[1, b] and bits[2, c] and not bits[2, a]
    assert bits[3].all()  # after a refused draft token: never used
    assert row.advance(a) is None and row.advance(b) is None and row.advance(c) is None and row.stopped


def test_a_dead_end_ends_its_row_and_the_batch_goes_on(loaded, monkeypatch):
    """Suppressing every token the grammar allows leaves no finite logit: the drawn token is refused at commit."""
    only_x = Constraint.regex("x+")
    x = loaded.tokenizer.encode("x", add_special_tokens=False)[0]
    free = params(max_tokens=10)
    rows = [free, params(only_x, suppress_tokens=(x,)), params(DIGITS)]
    (free_text, free_tokens, *_), (_, tokens, reason, error), (digits, *_) = run(loaded, rows)
    assert reason == "error" and "does not match the regex" in error and tokens == []
    assert digits.isdigit() and free_tokens == run(loaded, [free])[0][1]


def test_no_allowed_token_is_an_error_for_that_row(loaded, monkeypatch):
    real = constrained.RowConstraint.check

    def check(self, allows_any):
        return real(self, allows_any and self.constraint != DIGITS)  # as if the digits row's mask were empty

    monkeypatch.setattr(constrained.RowConstraint, "check", check)
    (_, _, reason, error), (text, *_) = run(loaded, [params(DIGITS), params(Constraint.regex("abc"))])
    assert (reason, error) == ("error", "no token can continue the output under the regex")
    assert text == "abc"


def test_a_new_bad_grammar_ends_its_row_and_a_known_one_is_refused_when_the_row_opens(loaded):
    """A never-seen grammar is checked beside the prefill: a bad one ends its row with "error" naming the problem, its
    neighbour goes on and the storage is freed. Then it is known: opening it again raises at once."""
    bad = Constraint.grammar("start: nothing_here_" + str(id(loaded)))  # (a grammar no earlier test compiled)
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=2))
    rows = [params(bad), params(Constraint.regex("abc"))]
    (_, tokens, reason, error), (text, *_) = run(loaded, rows, engine=engine)
    assert (tokens, reason) == ([], "error") and "unknown name" in error and error.startswith("invalid grammar")
    assert text == "abc" and engine.storage.stats()["blocks_free"] == engine.storage.pool.num_blocks
    with pytest.raises(ConstraintError, match="unknown name"):
        engine.open([1, 2, 3], params(bad))
    assert not engine.has_work()


def test_one_call_fills_the_masks_each_row_would(loaded):
    """next_masks (every row in one llguidance call) equals each row's own fill; a free row allows every token."""
    grammars = constrained.Grammars(loaded.tokenizer, loaded.model.args.vocab_size)
    rows = [grammars.open(c) for c in (DIGITS, LARK, Constraint.json_schema(SCHEMA), Constraint.regex("abc"))]
    a = loaded.tokenizer.encode("a", add_special_tokens=False)[0]
    assert rows[3].advance(a) is None  # rows at different points of their grammars
    bitmask, dead = constrained.next_masks([rows[0], None, *rows[1:]])
    assert dead == {} and (bitmask[1] == -1).all()
    for i, row in zip((0, 2, 3, 4), rows):
        alone = np.zeros(bitmask.shape[1], dtype=np.int32)
        row.fill(alone)
        assert (bitmask[i] == alone).all() and not (alone == -1).all()


@pytest.mark.parametrize("vocab", [96, 100])
@pytest.mark.parametrize("compiled", [False, True])
def test_packed_masks_apply_as_the_unpacked_ones(monkeypatch, vocab, compiled):
    """apply_bitmask (unpacked on the device, compiled or not; a vocabulary of whole words or not) sets exactly the
    tokens the unpacked boolean mask leaves out to -inf."""
    monkeypatch.setattr(constrained, "_masker", mx.compile(constrained._masked) if compiled else constrained._masked)
    rng = np.random.default_rng(vocab)
    bitmask = rng.integers(-(2**31), 2**31, size=(3, constrained.vocab_words(vocab)), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1
    logits = mx.array(rng.normal(size=(3, vocab)).astype(np.float32))
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    expected = np.where(bits, np.array(logits), -np.inf)
    assert np.array_equal(np.array(constrained.apply_bitmask(logits, mx.array(bitmask))), expected)


def test_a_batch_argmax_and_a_row_sampler_draw_the_same_tokens(loaded):
    """Greedy constrained rows alone share the batch's argmax; with a logprobs row each goes through its own sampler
    (the per-row path): the tokens are the same."""
    rows = [params(Constraint.json_schema(SCHEMA)), params(LARK)]
    shared = run(loaded, rows)
    per_row = run(loaded, [*rows, params(DIGITS, logprobs=2)])
    assert [r[1] for r in per_row[:2]] == [r[1] for r in shared] and all(r[2] == "stop" for r in shared)
