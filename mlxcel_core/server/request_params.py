"""What a request's body turns into before the engine sees it: its logit bias and token ids checked against the
vocabulary, its response_format compiled to a Constraint, and its SamplingParams. Each bad value is a 400 naming
the parameter."""

from __future__ import annotations

from ..constraints import Constraint, ConstraintError, check
from ..processors import DEFAULT_DRY_SEQUENCE_BREAKERS
from ..sampling import SamplingParams
from .errors import bad_request


def validate_logit_bias(bias: dict | None, vocab_size: int) -> dict | None:
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 12 and int(key) < vocab_size):
            shown = repr(key) if len(key) <= 24 else repr(key[:20]) + "..."
            raise bad_request(f"logit_bias key {shown} is not a token id in [0, {vocab_size}).", "logit_bias")
        if not -100 <= value <= 100:
            raise bad_request(f"logit_bias value for token {key} must be in [-100, 100].", "logit_bias")
    return bias


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"Token id {bad} is outside the vocabulary [0, {vocab_size}).", param)
    return ids


def response_constraint(response_format) -> Constraint | None:
    """The request's response_format as a Constraint: a malformed one (not a schema) is a 400 here; whether its
    grammar compiles is `checked`'s question, asked while the request's rows open."""
    if response_format is None or response_format.type == "text":
        return None
    try:
        if response_format.type == "json_object":
            return Constraint.json_object()
        if response_format.json_schema is None:
            raise bad_request("response_format of type json_schema needs a 'json_schema' object.", "response_format")
        schema = response_format.json_schema.schema_
        return Constraint.json_schema(True if schema is None else schema)
    except ConstraintError as exc:
        raise bad_request(f"Invalid response_format: {exc}.", "response_format") from None


def checked(constraint: Constraint, param: str) -> None:
    """A 400 naming `param` (response_format, or tools for a forced call's grammar) when the constraint's grammar does
    not compile. Validating a new schema's grammar takes ~0.5-1 ms: the server runs that on a worker thread beside the
    row's opening and prefill, not before them, and cancels the rows of a request it refuses; a known one's answer is
    a lookup."""
    try:
        check(constraint)
    except ConstraintError as exc:
        raise bad_request(f"Invalid {param}: {exc}.", param) from None


def sampling_params(
    body,
    *,
    seed: int | None,
    max_tokens: int,
    logprobs: int | None,
    prompt_len: int,
    constraint: Constraint | None = None,
    skip_special_tokens: bool = True,
) -> SamplingParams:
    """A request's SamplingParams (built on the engine thread: a request's logits processors may hold MLX arrays).

    `prompt_len` is unused by the built-in stages (the engine knows the prompt) but lets tests wrap this.
    """
    breakers = body.dry_sequence_breakers
    return SamplingParams(
        temperature=body.temperature,
        top_k=max(body.top_k, 0),
        top_p=body.top_p,
        min_p=body.min_p,
        seed=seed,
        max_tokens=max_tokens,
        stop=tuple(body.stop),
        logprobs=logprobs,
        logit_bias=body.logit_bias or None,
        suppress_tokens=tuple(body.suppress_tokens or ()),
        repetition_penalty=body.penalty(),
        repeat_last_n=body.repeat_last_n,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        dry_multiplier=body.dry_multiplier,
        dry_base=body.dry_base,
        dry_allowed_length=body.dry_allowed_length,
        dry_penalty_last_n=body.dry_penalty_last_n,
        dry_sequence_breakers=DEFAULT_DRY_SEQUENCE_BREAKERS if breakers is None else tuple(breakers),
        xtc_threshold=body.xtc_threshold,
        xtc_probability=body.xtc_probability,
        constraint=constraint,
        skip_special_tokens=skip_special_tokens,
    )
