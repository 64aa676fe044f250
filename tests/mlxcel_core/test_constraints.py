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
