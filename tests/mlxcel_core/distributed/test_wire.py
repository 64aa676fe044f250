"""The step records rank 0 sends its followers (distributed/wire.py): JSON with a fixed schema, checked on arrival.
A pickle (even one that would run code when loaded), an unknown kind or field, a wrong type or NaN is refused,
and a follower stops with one line instead of applying it."""

from __future__ import annotations

import os
import pickle
from dataclasses import fields

import pytest

from mlxcel_core.constraints import Constraint
from mlxcel_core.distributed import mirror, wire
from mlxcel_core.errors import RuntimeFailure
from mlxcel_core.sampling import SamplingParams

FULL = SamplingParams(
    temperature=0.7,
    top_k=40,
    top_p=0.9,
    min_p=0.05,
    seed=2**40 + 3,
    max_tokens=77,
    stop=("END", "\n\n"),
    logprobs=3,
    logit_bias={5: -1.5, 7: 100.0},
    suppress_tokens=(0, 2),
    repetition_penalty=1.1,
    repeat_last_n=-1,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    dry_multiplier=0.8,
    dry_base=1.75,
    dry_allowed_length=3,
    dry_penalty_last_n=128,
    dry_sequence_breakers=("\n", "::"),
    xtc_threshold=0.2,
    xtc_probability=0.5,
    constraint=Constraint("regex", "[a-z]+ é"),
    skip_special_tokens=False,
)


def test_every_sampling_field_travels():
    assert {f.name for f in fields(SamplingParams)} == set(wire.PARAM_TYPES) | set(wire.NOT_SENT)
    records = [("open", 4, [1, 2, 3], FULL, None, 512), ("open", 5, [9], SamplingParams(), 0, 512)]
    records += [("close", 4), ("forget", 0), ("stop",)]
    decoded = wire.decode(wire.encode(records))
    assert decoded == records
    assert decoded[0][3] == FULL and hash(decoded[0][3].constraint) == hash(FULL.constraint)


class _RunsCode:
    """Unpickling this would create a directory: the proof that a payload ran code on the follower."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


class _Group:
    def rank(self):
        return 1


class _Engine:
    def __getattr__(self, name):
        raise AssertionError(f"a refused payload touched the engine ({name})")


@pytest.mark.parametrize("kind", ["code", "records"])
def test_a_follower_refuses_a_pickle_and_runs_nothing(tmp_path, monkeypatch, kind):
    marker = tmp_path / "pwned"
    obj = [_RunsCode(str(marker))] if kind == "code" else [("open", 0, [1, 2], SamplingParams(), None, 64)]
    monkeypatch.setattr(mirror, "broadcast_bytes", lambda group, payload: pickle.dumps(obj))
    with pytest.raises(wire.WireError, match="rank 1 refused a step from rank 0: not a JSON step payload"):
        mirror.follow(_Engine(), _Group())
    assert not marker.exists()


@pytest.mark.parametrize(
    "payload, message",
    [
        (b'{"records": [{"kind": "exec", "code": "x"}]}', "unknown kind 'exec'"),
        (b'{"records": [{"kind": "close", "seq_id": 1, "extra": 2}]}', "unknown fields \\['extra'\\]"),
        (b'{"records": [{"kind": "close"}]}', "missing fields \\['seq_id'\\]"),
        (b'{"records": [{"kind": "close", "seq_id": "1"}]}', "seq_id must be an integer, got str"),
        (b'{"records": [{"kind": "close", "seq_id": true}]}', "seq_id must be an integer, got bool"),
        (b'{"records": [], "more": 1}', "must be a JSON object"),
        (b'[["stop"]]', "must be a JSON object"),
        (b'{"records": [{"kind": "close", "seq_id": NaN}]}', "NaN is not allowed"),
        (b"\xff\xfe", "not a JSON step payload"),
    ],
)
def test_malformed_records_are_refused(payload, message):
    with pytest.raises(wire.WireError, match=message):
        wire.decode(payload)


def _open_with(**params) -> bytes:
    good = wire.encode([("open", 0, [1], SamplingParams(), None, 64)])
    import json

    doc = json.loads(good)
    doc["records"][0]["params"].update(params)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "params, message",
    [
        ({"temperature": "hot"}, "temperature must be a number, got str"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias must be a list"),
        ({"logit_bias": [[5, 1.0, 2]]}, "must be a \\[token id, bias\\] pair"),
        ({"stop": "END"}, "stop must be a list"),
        ({"constraint": {"kind": "python", "text": "x"}}, "constraint kind must be one of"),
        ({"constraint": {"kind": "regex", "text": "a", "code": 1}}, "exactly 'kind' and 'text'"),
        ({"logits_processors": []}, "unknown fields \\['logits_processors'\\]"),
        ({"top_p": 7.0}, "top-p"),
        ({"skip_special_tokens": 0}, "skip_special_tokens must be a bool, got int"),
    ],
)
def test_malformed_params_are_refused(params, message):
    with pytest.raises(wire.WireError, match=message):
        wire.decode(_open_with(**params))


def test_the_leader_sends_nothing_the_schema_does_not_know():
    with pytest.raises(RuntimeFailure, match="cannot send a 'run' record"):
        wire.encode([("run", "code")])
    with pytest.raises(RuntimeFailure, match="logits processors"):
        wire.encode([("open", 0, [1], SamplingParams(logits_processors=(lambda i, x: x,)), None, 64)])
