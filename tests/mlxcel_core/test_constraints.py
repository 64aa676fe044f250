"""The Constraint spec (mlxcel_core/constraints.py): what each kind accepts, and one-line messages naming what is
wrong with a schema, regex or grammar (the server's 400s and the CLI's exit-2 lines carry them)."""

from __future__ import annotations

import pytest

from mlxcel_core.constraints import Constraint, ConstraintError, check, grammar_of, parse_json
from mlxcel_core.errors import InputError
from mlxcel_core.sampling import SamplingParams


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint.json_object(),
        Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
        Constraint.json_schema('{"enum": [1, 2]}'),
        Constraint.json_schema(True),  # any JSON value
        Constraint.regex("[0-9]+"),
        Constraint.grammar('start: "a" | "b"'),  # Lark
        Constraint.grammar('root ::= "yes" | "no"'),  # GBNF
    ],
)
def test_good_constraints_compile(constraint):
    assert grammar_of(constraint)
    assert grammar_of(constraint) is grammar_of(constraint)  # compiled once


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: Constraint.json_schema({"not": {}}), 'invalid JSON schema: Unimplemented keys: ["not"]'),
        (lambda: Constraint.json_schema({"type": "strin"}), "invalid JSON schema: Invalid type: strin"),
        (lambda: Constraint.json_schema({"type": "string", "format": "bogus"}), "Unknown format: bogus"),
        (lambda: Constraint.json_schema({"$ref": "#/nowhere"}), "Pointer '/nowhere' does not exist"),
        (lambda: Constraint.regex("(ab"), "invalid regex: regex parse error: unclosed group"),
        (lambda: Constraint.grammar("start: nothing"), 'invalid grammar: at 1(8): unknown name: "nothing"'),
    ],
)
def test_bad_constraints_name_the_problem_in_one_line(make, message):
    with pytest.raises(ConstraintError) as caught:
        check(make())
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert isinstance(caught.value, InputError)  # CLI exit 2, HTTP 400


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: Constraint.json_schema("{oops"), "the JSON schema is not valid JSON"),
        (lambda: Constraint.json_schema(False), "got false"),
        (lambda: Constraint.json_schema([1]), "must be an object, got list"),
        (lambda: Constraint.regex("  "), "the regex is empty"),
        (lambda: Constraint("xml", "x"), "constraint kind must be one of"),
    ],
)
def test_malformed_constraints_are_refused_when_made(make, message):
    with pytest.raises(InputError, match=message):
        make()


def test_sampling_params_take_a_constraint_only():
    assert SamplingParams(constraint=Constraint.json_object()).adjusts_logits
    assert SamplingParams(constraint=Constraint.json_object()).masked_greedy
    assert not SamplingParams(constraint=Constraint.json_object()).plain_greedy
    check(None)
    with pytest.raises(InputError, match="constraint must be a Constraint"):
        SamplingParams(constraint={"type": "json_object"})


def test_parse_json():
    assert parse_json('{"a": [1, true]}') == {"a": [1, True]}
    assert parse_json('{"a": [1, tr') is None


def test_threads_asking_for_a_new_constraint_at_once_compute_it_once(monkeypatch):
    """The server's check and the engine's compile of a never-seen schema ask at once: one computation, one answer,
    known afterwards; a failed computation is not kept (the next call tries again)."""
    import threading
    import time

    from mlxcel_core import constraints

    calls, real = [], constraints._compile

    def slow(constraint):
        calls.append(constraint)
        time.sleep(0.05)
        return real(constraint)

    monkeypatch.setattr(constraints, "_compile", slow)
    new = Constraint.regex(f"[a-c]{{{len(calls) + 7}}}x{id(calls)}")  # (no earlier test compiled it)
    assert not constraints.compiled_now(new)
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(grammar_of(new))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(answers) == 4 and len(set(answers)) == 1
    assert constraints.compiled_now(new)

    def failing(constraint):
        raise RuntimeError("llguidance went away")

    other = Constraint.regex(f"q{id(calls)}")
    monkeypatch.setattr(constraints, "_compile", failing)
    with pytest.raises(RuntimeError):
        grammar_of(other)
    assert not constraints.compiled_now(other)
    monkeypatch.setattr(constraints, "_compile", real)
    assert grammar_of(other)
