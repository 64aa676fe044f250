"""Options shared by the commands that generate text (one definition for generate, run, ...)."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from .completion import complete_model

Model = Annotated[
    Optional[str],
    typer.Option(
        "-m",
        "--model",
        metavar="MODEL",
        help="Model directory, .gguf file, Hugging Face repo id or catalogue name (smollm2, qwen3:4b-4bit: "
        "`mlxcel ls --catalog`). Default: SmolLM2-135M-Instruct.",
        autocompletion=complete_model,
    ),
]
MaxTokens = Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens to generate (>= 1).")]
Temp = Annotated[float, typer.Option("--temp", help="Sampling temperature; 0 = greedy (deterministic).")]
TopK = Annotated[int, typer.Option("--top-k", help="Keep only the K most likely tokens; 0 = off.")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass in (0, 1]; 1 = off.")]
MinP = Annotated[float, typer.Option("--min-p", help="Drop tokens below MIN_P x the top probability; 0 = off.")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Random seed for reproducible sampling.")]
Stop = Annotated[
    Optional[List[str]], typer.Option("--stop", help="Stop when this text appears (never printed). Repeatable.")
]
NoChatTemplate = Annotated[
    bool,
    typer.Option(
        "--no-chat-template", help="Send the prompt as raw text instead of through the model's chat template."
    ),
]
System = Annotated[Optional[str], typer.Option("--system", help="System prompt (needs the chat template).")]
ParseSpecialInContent = Annotated[
    bool,
    typer.Option(
        "--parse-special-in-content",
        help="Turn special-token text inside messages (e.g. '<|im_end|>') into control tokens. By default it is "
        "plain text: control tokens come only from the chat template, so a message cannot forge a turn.",
    ),
]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="More detail on stderr; tracebacks on errors.")]


# The rest of the sampler, in pipeline order (mlxcel_core/sampling.py): bias/suppression -> repetition ->
# presence/frequency -> DRY -> temperature -> top-k -> top-p -> min-p -> XTC -> draw.
LogitBias = Annotated[
    Optional[List[str]],
    typer.Option(
        "--logit-bias",
        "-l",
        metavar="ID(+|-|=)BIAS",
        help="Add BIAS (in [-100, 100]) to token ID's logit, e.g. 15043+1 or 15043=-5. Repeatable.",
    ),
]
SuppressToken = Annotated[
    Optional[List[int]], typer.Option("--suppress-token", metavar="ID", help="Never generate token ID. Repeatable.")
]
RepeatPenalty = Annotated[
    float,
    typer.Option(
        "--repeat-penalty",
        "--repetition-penalty",
        help="Divide positive (multiply negative) logits of tokens seen in the last --repeat-last-n tokens; 1 = off.",
    ),
]
RepeatLastN = Annotated[
    int,
    typer.Option("--repeat-last-n", help="Tokens (prompt included) the repeat penalty looks at; -1 = all, 0 = none."),
]
PresencePenalty = Annotated[
    float,
    typer.Option("--presence-penalty", help="Subtract this from generated tokens' logits once they occur, in [-2, 2]."),
]
FrequencyPenalty = Annotated[
    float,
    typer.Option(
        "--frequency-penalty", help="Subtract this times a generated token's count from its logit, in [-2, 2]."
    ),
]
DryMultiplier = Annotated[
    float, typer.Option("--dry-multiplier", help="DRY repetition penalty strength (koboldcpp/llama.cpp); 0 = off.")
]
DryBase = Annotated[
    float, typer.Option("--dry-base", help="DRY: the penalty grows as BASE ** (repeat length - allowed length); >= 1.")
]
DryAllowedLength = Annotated[
    int, typer.Option("--dry-allowed-length", help="DRY: repeats up to this many tokens are not penalized (>= 1).")
]
DryPenaltyLastN = Annotated[
    int, typer.Option("--dry-penalty-last-n", help="DRY: tokens scanned for repeats; -1 = the whole context, 0 = off.")
]
DrySequenceBreaker = Annotated[
    Optional[List[str]],
    typer.Option(
        "--dry-sequence-breaker",
        metavar="TEXT",
        help="DRY: repeats never extend across TEXT. Repeatable; replaces the defaults \\n : \" *; 'none' = no breakers.",  # noqa: E501
    ),
]
XtcThreshold = Annotated[
    float, typer.Option("--xtc-threshold", help="XTC: tokens at least this likely are 'top choices', in [0, 1].")
]
XtcProbability = Annotated[
    float,
    typer.Option(
        "--xtc-probability", help="XTC: chance per token to drop every top choice but the least likely; 0 = off."
    ),
]


# Structured output (mlxcel_core/constraints.py): the output must match one of these.
JsonSchema = Annotated[
    Optional[str],
    typer.Option(
        "--json-schema",
        metavar="FILE|JSON",
        help="Constrain the output to JSON valid against this JSON schema (a file, or the schema itself).",
    ),
]
Regex = Annotated[
    Optional[str], typer.Option("--regex", metavar="RE", help="Constrain the output to a full match of this regex.")
]
Grammar = Annotated[
    Optional[str],
    typer.Option(
        "--grammar", metavar="FILE", help="Constrain the output to this grammar: Lark (llguidance) or GBNF (llama.cpp)."
    ),
]


def constraint(json_schema: Optional[str], regex: Optional[str], grammar: Optional[str]):
    """The Constraint of --json-schema / --regex / --grammar (at most one), checked now: InputError (exit 2) naming
    the problem before any model loads. None without one. Imports llguidance only when one is given."""
    from mlxcel_core.constraints import Constraint, ConstraintError, check
    from mlxcel_core.errors import InputError

    given = [
        (flag, value) for flag, value in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar))
    ]
    given = [(flag, value) for flag, value in given if value is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InputError(f"give one output constraint, not {' and '.join(flag for flag, _ in given)}")
    flag, value = given[0]
    try:
        if flag == "--json-schema":
            inline = value.lstrip().startswith("{") or value.strip() == "true"
            made = Constraint.json_schema(value if inline else _read(flag, value))
        elif flag == "--regex":
            made = Constraint.regex(value)
        else:
            made = Constraint.grammar(_read(flag, value))
        check(made)
    except ConstraintError as exc:
        raise InputError(f"{flag}: {exc}") from None
    return made


def _read(flag: str, path: str) -> str:
    from mlxcel_core.errors import InputError

    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{flag}: cannot read {path}: {exc.strerror if isinstance(exc, OSError) else exc}") from None


def sampling_params(
    max_tokens: int,
    temp: float,
    top_k: int,
    top_p: float,
    min_p: float,
    seed: Optional[int],
    stop: Optional[List[str]],
    *,
    logit_bias: Optional[List[str]] = None,
    suppress_token: Optional[List[int]] = None,
    repeat_penalty: float = 1.0,
    repeat_last_n: int = 64,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    dry_multiplier: float = 0.0,
    dry_base: float = 1.75,
    dry_allowed_length: int = 2,
    dry_penalty_last_n: int = -1,
    dry_sequence_breaker: Optional[List[str]] = None,
    xtc_threshold: float = 0.1,
    xtc_probability: float = 0.0,
    constraint=None,
):
    """SamplingParams from the command line; out-of-range values raise InputError (exit 2). `constraint`: from
    `constraint()` above."""
    from mlxcel_core.errors import InputError
    from mlxcel_core.processors import DEFAULT_DRY_SEQUENCE_BREAKERS
    from mlxcel_core.sampling import SamplingParams

    if dry_sequence_breaker is None:
        breakers = DEFAULT_DRY_SEQUENCE_BREAKERS
    elif [b.lower() for b in dry_sequence_breaker] == ["none"]:
        breakers = ()
    else:  # typed on a command line: \n means a newline
        breakers = tuple(b.encode("latin-1", "backslashreplace").decode("unicode_escape") for b in dry_sequence_breaker)
    try:
        return SamplingParams(
            temperature=temp,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed=seed,
            max_tokens=max_tokens,
            stop=tuple(stop or ()),
            logit_bias=parse_logit_bias(logit_bias),
            suppress_tokens=tuple(suppress_token or ()),
            repetition_penalty=repeat_penalty,
            repeat_last_n=repeat_last_n,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            dry_multiplier=dry_multiplier,
            dry_base=dry_base,
            dry_allowed_length=dry_allowed_length,
            dry_penalty_last_n=dry_penalty_last_n,
            dry_sequence_breakers=breakers,
            xtc_threshold=xtc_threshold,
            xtc_probability=xtc_probability,
            constraint=constraint,
        )
    except InputError as exc:
        raise _as_typed(exc) from None


# SamplingParams' range errors name its fields; the command line's name the option (`--temp`, `-n/--max-tokens`)
_OPTION_NAMES = {
    "temperature": "--temp",
    "max-tokens": "-n/--max-tokens",
    "suppress-tokens": "--suppress-token",
    "repeat-penalty": "--repetition-penalty/--repeat-penalty",
}
_SAME_NAMED = (
    "top-k top-p min-p seed repeat-last-n presence-penalty frequency-penalty dry-multiplier dry-base "
    "dry-allowed-length dry-penalty-last-n xtc-threshold xtc-probability"
).split()


def _as_typed(exc):
    from mlxcel_core.errors import InputError

    name, sep, rest = str(exc).partition(" must be ")
    option = _OPTION_NAMES.get(name) or (f"--{name}" if name in _SAME_NAMED else None)
    return InputError(f"{option} must be {rest}") if sep and option else exc


def parse_logit_bias(items: Optional[List[str]]) -> dict[int, float]:
    """llama.cpp's TOKEN_ID(+|-)BIAS (15043+1, 15043-1) or TOKEN_ID=BIAS; a later entry for a token wins."""
    import re

    from mlxcel_core.errors import InputError

    bias = {}
    for item in items or []:
        match = re.fullmatch(r"\s*(\d+)\s*(?:=\s*([-+]?[^=]+)|([-+][^=+-]+))\s*", item)
        try:
            value = float((match.group(2) or match.group(3)).strip()) if match else None
        except ValueError:
            value = None
        if value is None:
            raise InputError(f"--logit-bias must look like ID+BIAS, ID-BIAS or ID=BIAS, got '{item}'")
        bias[int(match.group(1))] = value
    return bias


KvBits = Annotated[
    Optional[int],
    typer.Option(
        "--kv-bits",
        help="Store the KV cache quantized to 8 or 4 bits (group size 64): less memory, slightly different numbers.",
    ),
]
Reasoning = Annotated[
    str,
    typer.Option(
        "--reasoning",
        metavar="show|hide",
        help="A reasoning model's reasoning (<think> tags, gpt-oss analysis): show it between <think> and </think> "
        "lines before the answer, or hide it.",
    ),
]
CtxSize = Annotated[
    int,
    typer.Option(
        "-c",
        "--ctx-size",
        min=0,
        help="Cap the context (prompt + completion tokens); 0 = the model's (as llama.cpp's -c).",
    ),
]
# (the CPU value is backends/base.py's CPU_PREFILL_CHUNK: the CLI does not import the backends, which import MLX)
PREFILL_CHUNK_HELP = (
    "Prompt tokens computed per forward pass: a running stream waits for one chunk at most. "
    "Default: 2048 at batch 1; batching, the backend's (32 on CPU, 2048 on a GPU)."
)
StorageBackend = Annotated[
    str,
    typer.Option(
        "--decode-storage-backend",
        help="KV storage: auto (paged when batching or on CUDA, else dense), dense or paged.",
    ),
]
PrefillChunk = Annotated[
    Optional[int],
    typer.Option("--prefill-chunk-size", help=PREFILL_CHUNK_HELP),
]


DraftModel = Annotated[
    Optional[str],
    typer.Option(
        "--draft-model",
        metavar="MODEL",
        help="Speculative decoding with this smaller model (same tokenizer) drafting tokens the model verifies.",
        autocompletion=complete_model,
    ),
]
DraftNgram = Annotated[
    int,
    typer.Option(
        "--draft-ngram",
        metavar="N",
        help="Speculative decoding by prompt lookup: draft what followed the last 1..N tokens earlier in the text; 0 = off.",  # noqa: E501
    ),
]
NumDraftTokens = Annotated[
    int, typer.Option("--num-draft-tokens", metavar="K", help="Speculative decoding: tokens drafted per round (1-64).")
]


def speculative_config(draft_model: Optional[str], draft_ngram: int, num_draft_tokens: int):
    """None unless a drafter is asked for; InputError (exit 2) on bad values."""
    from mlxcel_core.engine import SpeculativeConfig

    if not draft_model and not draft_ngram:
        return None
    return SpeculativeConfig(num_draft_tokens=num_draft_tokens, ngram=draft_ngram, draft_model=draft_model or None)


def engine_config(
    max_batch_size: int,
    kv_bits: Optional[int],
    storage: str,
    prefill_chunk_size: Optional[int],
    speculative=None,
    prefill_batch: Optional[int] = None,
    ctx_size: int = 0,
):
    """`ctx_size`: --ctx-size (0: the model's context)."""
    from mlxcel_core.engine import EngineConfig
    from mlxcel_core.errors import InputError

    if kv_bits not in (None, 4, 8):
        raise InputError(f"--kv-bits must be 4 or 8, got {kv_bits}")
    if storage not in ("auto", "dense", "paged"):
        raise InputError(f"--decode-storage-backend must be auto, dense or paged, got '{storage}'")
    if prefill_chunk_size is not None and prefill_chunk_size < 1:
        raise InputError(f"--prefill-chunk-size must be >= 1, got {prefill_chunk_size}")
    if prefill_batch is not None and prefill_batch < 1:
        raise InputError(f"--prefill-batch must be >= 1, got {prefill_batch}")
    return EngineConfig(
        max_batch_size=max_batch_size,
        kv_bits=kv_bits,
        storage=storage,
        prefill_chunk_size=prefill_chunk_size,
        speculative=speculative,
        prefill_batch_size=prefill_batch,
        max_context=ctx_size or None,
    )
