"""What rank 0 sends the other ranks each step: plain JSON with a fixed schema, checked on arrival (never pickles).

A follower applies whatever arrives on its socket, so a payload must not be able to run code there: it is UTF-8
JSON, `{"records": [...]}`, and each record's `kind` fixes its fields and their types:

    open    seq_id: int, prompt_ids: [int], params: {every SamplingParams field}, conversation: int | null,
            max_context: int
    close   seq_id: int
    forget  conversation: int
    stop    (no other field)

`params` carries each `SamplingParams` field by the type in `PARAM_TYPES` (logit_bias as [[token id, bias], ...],
the constraint as {"kind", "text"} or null); `logits_processors` (Python callables) cannot travel and the leader
refuses them before this point. Anything else -- bytes that are not UTF-8 JSON, NaN or infinity, an unknown kind,
a missing or unknown field, a wrong type, a value SamplingParams refuses -- is a `WireError`.

In memory a record is the tuple the mirror works with: ("open", seq_id, prompt_ids, params, key, max_context),
("close", seq_id), ("forget", key), ("stop",).
"""

from __future__ import annotations

import json
from dataclasses import fields

from ..constraints import Constraint
from ..errors import MlxcelError, RuntimeFailure
from ..sampling import SamplingParams

# SamplingParams field -> its wire type; every field but logits_processors (tests check that this list is complete).
PARAM_TYPES = {
    "temperature": "number",
    "top_k": "int",
    "top_p": "number",
    "min_p": "number",
    "seed": "int|null",
    "max_tokens": "int",
    "stop": "[str]",
    "logprobs": "int|null",
    "logit_bias": "bias",
    "suppress_tokens": "[int]",
    "repetition_penalty": "number",
    "repeat_last_n": "int",
    "presence_penalty": "number",
    "frequency_penalty": "number",
    "dry_multiplier": "number",
    "dry_base": "number",
    "dry_allowed_length": "int",
    "dry_penalty_last_n": "int",
    "dry_sequence_breakers": "[str]",
    "xtc_threshold": "number",
    "xtc_probability": "number",
    "constraint": "constraint",
    "skip_special_tokens": "bool",
}
NOT_SENT = ("logits_processors",)

# kind -> (field, wire type) in the order of the in-memory tuple
RECORDS = {
    "open": (
        ("seq_id", "int"),
        ("prompt_ids", "[int]"),
        ("params", "params"),
        ("conversation", "int|null"),
        ("max_context", "int"),
    ),
    "close": (("seq_id", "int"),),
    "forget": (("conversation", "int"),),
    "stop": (),
}


class WireError(RuntimeFailure):
    """A payload from rank 0 that does not follow the schema: the follower stops instead of applying it."""


def encode(records: list[tuple]) -> bytes:
    """The leader's records as the JSON payload (RuntimeFailure for a record or field the schema does not know)."""
    _check_schema_covers_sampling_params()
    out = []
    for record in records:
        kind, values = record[0], record[1:]
        spec = RECORDS.get(kind)
        if spec is None or len(values) != len(spec):
            raise RuntimeFailure(f"tensor parallelism: cannot send a {kind!r} record with {len(values)} values")
        out.append({"kind": kind, **{name: _to_wire(value, kind) for (name, kind), value in zip(spec, values)}})
    return json.dumps({"records": out}, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def decode(payload: bytes) -> list[tuple]:
    """The records in a payload, each checked against the schema; WireError for anything else."""
    try:
        doc = json.loads(payload.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireError(f"not a JSON step payload ({_first_line(exc)})") from None
    if not isinstance(doc, dict) or set(doc) != {"records"} or not isinstance(doc["records"], list):
        raise WireError('a step payload must be a JSON object {"records": [...]}')
    return [_record(i, item) for i, item in enumerate(doc["records"])]


def _record(index: int, item) -> tuple:
    where = f"record {index}"
    if not isinstance(item, dict) or not isinstance(item.get("kind"), str):
        raise WireError(f"{where} is not an object with a string 'kind'")
    kind = item["kind"]
    spec = RECORDS.get(kind)
    if spec is None:
        raise WireError(f"{where} has an unknown kind {kind!r}")
    names = [name for name, _ in spec]
    if set(item) != {"kind", *names}:
        extra, missing = set(item) - {"kind", *names}, set(names) - set(item)
        raise WireError(f"{where} ({kind}): unknown fields {sorted(extra)}, missing fields {sorted(missing)}")
    return (kind, *(_from_wire(item[name], t, f"{where}.{name}") for name, t in spec))


def _to_wire(value, kind: str):
    if kind == "params":
        _refuse_unsent(value)
        return {name: _to_wire(getattr(value, name), t) for name, t in PARAM_TYPES.items()}
    if kind == "bias":
        return None if value is None else [[int(k), float(v)] for k, v in value.items()]
    if kind == "constraint":
        return None if value is None else {"kind": value.kind, "text": value.text}
    if kind == "[int]":
        return [int(v) for v in value]
    if kind == "[str]":
        return list(value)
    return value


def _refuse_unsent(params) -> None:
    if params.logits_processors:
        raise RuntimeFailure("custom logits processors cannot be used with tensor parallelism")


def _from_wire(value, kind: str, where: str):
    if kind == "params":
        return _params(value, where)
    if kind == "bias":
        if value is None:
            return None
        pairs = _typed(value, list, where)
        out = {}
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise WireError(f"{where}[{i}] must be a [token id, bias] pair")
            out[_scalar(pair[0], "int", f"{where}[{i}][0]")] = _scalar(pair[1], "number", f"{where}[{i}][1]")
        return out
    if kind == "constraint":
        if value is None:
            return None
        if not (isinstance(value, dict) and set(value) == {"kind", "text"}):
            raise WireError(f"{where} must be null or an object with exactly 'kind' and 'text'")
        return Constraint(_typed(value["kind"], str, where + ".kind"), _typed(value["text"], str, where + ".text"))
    if kind.startswith("["):
        element = kind[1:-1]
        return [_scalar(v, element, f"{where}[{i}]") for i, v in enumerate(_typed(value, list, where))]
    return _scalar(value, kind, where)


def _params(value, where: str) -> SamplingParams:
    if not isinstance(value, dict):
        raise WireError(f"{where} must be an object")
    if set(value) != set(PARAM_TYPES):
        extra, missing = set(value) - set(PARAM_TYPES), set(PARAM_TYPES) - set(value)
        raise WireError(f"{where}: unknown fields {sorted(extra)}, missing fields {sorted(missing)}")
    try:
        given = {name: _from_wire(value[name], t, f"{where}.{name}") for name, t in PARAM_TYPES.items()}
        given.update({name: tuple(given[name]) for name, t in PARAM_TYPES.items() if t.startswith("[")})
        return SamplingParams(**given)
    except WireError:
        raise
    except MlxcelError as exc:  # a value SamplingParams (or Constraint) refuses
        raise WireError(f"{where}: {exc}") from None


def _scalar(value, kind: str, where: str):
    if kind == "int|null" and value is None:
        return None
    if kind in ("int", "int|null"):
        if type(value) is not int:
            raise WireError(f"{where} must be an integer, got {_type_name(value)}")
        return value
    if kind == "number":
        if type(value) not in (int, float):
            raise WireError(f"{where} must be a number, got {_type_name(value)}")
        return value
    if kind == "str":
        return _typed(value, str, where)
    if kind == "bool":
        return _typed(value, bool, where)
    raise WireError(f"{where}: no wire type {kind!r}")


def _typed(value, cls, where: str):
    if type(value) is not cls:
        raise WireError(f"{where} must be a {cls.__name__}, got {_type_name(value)}")
    return value


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def _no_constant(name: str):
    raise ValueError(f"{name} is not allowed")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _check_schema_covers_sampling_params() -> None:
    names = {f.name for f in fields(SamplingParams)} - set(NOT_SENT)
    if names != set(PARAM_TYPES):
        missing, stale = sorted(names - set(PARAM_TYPES)), sorted(set(PARAM_TYPES) - names)
        raise RuntimeFailure(
            f"tensor parallelism: the wire schema does not match SamplingParams (not sent: {missing}; unknown: {stale})"
        )
