"""`mlxcel generate` / `mlxcel run` with --json-schema, --regex and --grammar (tiny random Llama): the output matches,
--json carries the parsed object, and bad or conflicting constraints are one line and exit 2 before any model loads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from mlxcel_cli.main import main

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def generate(capsys, model, *args):
    return run_cli(capsys, "generate", "-m", str(model), "-p", "Hello", "-n", "40", *args)


@pytest.mark.parametrize("inline", [True, False])
def test_json_schema_output_is_parsed_in_json(tiny_llama_dir, capsys, tmp_path, inline):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    code, out, err = generate(
        capsys, tiny_llama_dir, "--json", "--json-schema", json.dumps(SCHEMA) if inline else str(schema_file)
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["finish_reason"] == "stop"
    jsonschema.validate(result["parsed"], SCHEMA)
    assert json.loads(result["text"]) == result["parsed"]


def test_regex_output_matches(tiny_llama_dir, capsys):
    code, out, err = generate(capsys, tiny_llama_dir, "--regex", r"[0-9]{3}-[a-z]{2,4}")
    assert code == 0, err
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}\n", out)


@pytest.mark.parametrize(
    "grammar,pattern",
    [
        ('start: "(" ITEM ("," ITEM)* ")"\nITEM: /[a-c]/\n', r"\([a-c](,[a-c])*\)?"),  # Lark
        ('root ::= answer\nanswer ::= "yes" | "no"\n', r"yes|no"),  # GBNF
    ],
)
def test_grammar_file_output_matches(tiny_llama_dir, capsys, tmp_path, grammar, pattern):
    path = tmp_path / "grammar.txt"
    path.write_text(grammar)
    code, out, err = generate(capsys, tiny_llama_dir, "--grammar", str(path), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert re.fullmatch(pattern, result["text"]) and "parsed" not in result


@pytest.mark.parametrize(
    "args,message",
    [
        (("--regex", "(ab"), "--regex: invalid regex: regex parse error: unclosed group"),
        (("--json-schema", '{"not": {}}'), '--json-schema: invalid JSON schema: Unimplemented keys: ["not"]'),
        (("--json-schema", "{oops"), "--json-schema: the JSON schema is not valid JSON"),
        (("--json-schema", "/no/such/schema.json"), "--json-schema: cannot read /no/such/schema.json"),
        (("--grammar", "/no/such/grammar.lark"), "--grammar: cannot read /no/such/grammar.lark"),
        (("--regex", "a", "--json-schema", "{}"), "give one output constraint, not --json-schema and --regex"),
    ],
)
def test_bad_constraints_are_one_line_and_exit_2(capsys, args, message):
    code, out, err = run_cli(capsys, "generate", "-m", "/no/model/needed", "-p", "Hi", *args)
    lines = err.strip().splitlines()
    assert code == 2 and out == ""
    assert len(lines) == 1 and lines[0].startswith("mlxcel: error: ") and message in lines[0], err


def test_bad_grammar_file_names_the_problem(capsys, tmp_path):
    path = tmp_path / "bad.lark"
    path.write_text("start: missing_rule\n")
    code, _, err = run_cli(capsys, "generate", "-p", "Hi", "--grammar", str(path))
    assert code == 2 and 'mlxcel: error: --grammar: invalid grammar: at 1(8): unknown name: "missing_rule"' in err


def test_run_constrains_every_reply(tiny_llama_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "mlxcel_cli.main", "run", str(tiny_llama_dir), "-n", "20", "--regex", "[0-9]{2,4}"],
        input="Hello\nAnd again\n",
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(ROOT),
        env={**os.environ},
    )
    assert proc.returncode == 0, proc.stderr
    replies = proc.stdout.splitlines()
    assert len(replies) == 2 and all(re.fullmatch("[0-9]{2,4}", r) for r in replies), replies


def test_run_prompt_takes_the_flags(tiny_llama_dir, capsys):
    code, out, err = run_cli(capsys, "run", str(tiny_llama_dir), "-p", "Hi", "-n", "20", "--regex", "(yes|no)")
    assert code == 0, err
    assert out in ("yes\n", "no\n")


def test_help_does_not_import_llguidance():
    probe = (
        "import sys; from mlxcel_cli.main import main; main(['generate', '--help']); print('llguidance' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert proc.stdout.split()[-1] == "False"
