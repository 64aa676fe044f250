"""`mlxcel generate`: one prompt in, text streamed out."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from . import options as opt
from .adapter_option import AdapterPath, check_adapter
from .errors import fail, reported_errors
from .prefill_notice import PrefillNotice
from .progress_line import hub_download_bars
from .reasoning_view import ReasoningView, check_mode
from .tp import TpSize, join_ranks


def _read_prompt(prompt: Optional[str]) -> str:
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        return sys.stdin.read()
    if prompt is None:
        raise fail("no prompt: pass -p TEXT, or '-p -' / a pipe to read it from stdin")
    return prompt


def _print_stats(stats, verbose: bool) -> None:
    err = sys.stderr
    print(f"prompt: {stats.prompt_tokens} tokens, {stats.prefill_tps:.2f} tok/s", file=err)
    print(f"generation: {stats.generated_tokens} tokens, {stats.decode_tps:.2f} tok/s", file=err)
    print(f"peak memory: {stats.peak_memory_gb:.3f} GB", file=err)
    if verbose:
        print(f"prefill: {stats.prefill_s * 1000:.1f} ms, decode: {stats.decode_s * 1000:.1f} ms", file=err)
        spec = stats.speculative
        if spec is not None:
            print(
                f"speculative: {spec.rounds} rounds, {spec.proposed} draft tokens proposed, {spec.accepted} "
                f"accepted ({spec.acceptance_rate:.1%}), {spec.mean_accepted:.2f} accepted per round",
                file=err,
            )


def generate(
    prompt: Annotated[
        Optional[str], typer.Option("-p", "--prompt", help="Prompt text; '-' reads stdin (so does a pipe).")
    ] = None,
    model: opt.Model = None,
    adapter_path: AdapterPath = None,
    max_tokens: opt.MaxTokens = 256,
    temp: opt.Temp = 0.0,
    top_k: opt.TopK = 0,
    top_p: opt.TopP = 1.0,
    min_p: opt.MinP = 0.0,
    seed: opt.Seed = None,
    stop: opt.Stop = None,
    logit_bias: opt.LogitBias = None,
    suppress_token: opt.SuppressToken = None,
    repeat_penalty: opt.RepeatPenalty = 1.0,
    repeat_last_n: opt.RepeatLastN = 64,
    presence_penalty: opt.PresencePenalty = 0.0,
    frequency_penalty: opt.FrequencyPenalty = 0.0,
    dry_multiplier: opt.DryMultiplier = 0.0,
    dry_base: opt.DryBase = 1.75,
    dry_allowed_length: opt.DryAllowedLength = 2,
    dry_penalty_last_n: opt.DryPenaltyLastN = -1,
    dry_sequence_breaker: opt.DrySequenceBreaker = None,
    xtc_threshold: opt.XtcThreshold = 0.1,
    xtc_probability: opt.XtcProbability = 0.0,
    json_schema: opt.JsonSchema = None,
    regex: opt.Regex = None,
    grammar: opt.Grammar = None,
    no_chat_template: opt.NoChatTemplate = False,
    system: opt.System = None,
    parse_special_in_content: opt.ParseSpecialInContent = False,
    reasoning: opt.Reasoning = "show",
    kv_bits: opt.KvBits = None,
    storage: opt.StorageBackend = "auto",
    prefill_chunk_size: opt.PrefillChunk = None,
    ctx_size: opt.CtxSize = 0,
    tp_size: TpSize = 1,
    draft_model: opt.DraftModel = None,
    draft_ngram: opt.DraftNgram = 0,
    num_draft_tokens: opt.NumDraftTokens = 5,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print one JSON object (text, token ids, finish_reason, usage, timings) instead of streaming.",
        ),
    ] = False,
    verbose: opt.Verbose = False,
) -> None:
    """Generate text for one prompt. Text streams to stdout; statistics go to stderr."""
    with reported_errors(verbose):
        check_adapter(adapter_path, tp_size)
        text = _read_prompt(prompt)
        params = opt.sampling_params(
            max_tokens,
            temp,
            top_k,
            top_p,
            min_p,
            seed,
            stop,
            logit_bias=logit_bias,
            suppress_token=suppress_token,
            repeat_penalty=repeat_penalty,
            repeat_last_n=repeat_last_n,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            dry_multiplier=dry_multiplier,
            dry_base=dry_base,
            dry_allowed_length=dry_allowed_length,
            dry_penalty_last_n=dry_penalty_last_n,
            dry_sequence_breaker=dry_sequence_breaker,
            xtc_threshold=xtc_threshold,
            xtc_probability=xtc_probability,
            constraint=opt.constraint(json_schema, regex, grammar),
        )
        speculative = opt.speculative_config(draft_model, draft_ngram, num_draft_tokens)
        engine_config = opt.engine_config(1, kv_bits, storage, prefill_chunk_size, speculative, ctx_size=ctx_size)
        if not text.strip():
            raise fail("prompt is empty")
        if system and no_chat_template:
            raise fail("a system prompt needs the chat template, but --no-chat-template was given")
        group, params = join_ranks(
            tp_size, stdin_text=text if prompt in (None, "-") else None, params=params, verbose=verbose
        )

        answer_once(
            text,
            model,
            params,
            engine_config,
            system,
            chat_template=not no_chat_template,
            as_json=as_json,
            verbose=verbose,
            group=group,
            parse_special_in_content=parse_special_in_content,
            reasoning=check_mode(reasoning),
            adapter_path=adapter_path,
        )


def answer_once(
    text: str,
    model: Optional[str],
    params,
    engine_config,
    system: Optional[str],
    *,
    chat_template: bool = True,
    as_json: bool = False,
    verbose: bool = False,
    group=None,
    parse_special_in_content: bool = False,
    reasoning: str = "show",
    adapter_path: Optional[str] = None,
) -> None:
    """Load the model, answer one prompt (streamed, or one JSON object) and print statistics on stderr.

    The body of `mlxcel generate`; `mlxcel run -p` calls it too, so both print exactly the same.
    `group`: this process is one rank of a tensor-parallel group (every rank runs this same loop).
    `parse_special_in_content`: special-token text in the prompt and system prompt becomes control tokens.
    `reasoning`: "show" or "hide" a reasoning model's reasoning (reasoning_view.py).
    """
    from mlxcel_core.distributed import lost_peer_errors

    hub_download_bars(as_json)
    with lost_peer_errors(group):
        _answer_once(
            text,
            model,
            params,
            engine_config,
            system,
            chat_template,
            as_json,
            verbose,
            group,
            parse_special_in_content,
            reasoning,
            adapter_path=adapter_path,
        )


def _answer_once(
    text,
    model,
    params,
    engine_config,
    system,
    chat_template,
    as_json,
    verbose,
    group,
    parse_special_in_content,
    mode,
    adapter_path=None,
) -> None:
    from mlxcel_core.api import prepare_prompt, stream_generate
    from mlxcel_core.loading import load_model

    loaded = load_model(
        model, log=lambda m: print(f"mlxcel: {m}", file=sys.stderr), group=group, adapter_path=adapter_path
    )
    loaded.tokenizer.parse_special_in_content = parse_special_in_content
    print(f"mlxcel: model: {loaded.source.origin}", file=sys.stderr)
    if group is not None:
        print(f"mlxcel: tensor parallel: {group.size()} ranks", file=sys.stderr)
    draft = None
    speculative = engine_config.speculative
    if speculative is not None and speculative.draft_model:
        draft = load_model(speculative.draft_model, log=lambda m: print(f"mlxcel: {m}", file=sys.stderr))
        print(f"mlxcel: draft model: {draft.source.origin}", file=sys.stderr)
    prompt_ids = prepare_prompt(loaded.tokenizer, text, system, chat_template=chat_template)
    if verbose:
        print(f"mlxcel: prompt tokens: {len(prompt_ids)}", file=sys.stderr)

    tokens, last = [], None
    write = None if as_json else _stdout
    view, run_params = ReasoningView.for_prompt(loaded.tokenizer, prompt_ids, params, chat_template, mode, write)
    notice = PrefillNotice(len(prompt_ids), as_json=as_json)
    try:
        for chunk in stream_generate(loaded, prompt_ids, run_params, engine_config, draft):
            notice.done()
            if chunk.token is not None:
                tokens.append(chunk.token)
            view.feed(chunk.text)
            last = chunk
    finally:
        notice.done()
    view.finish()
    stats = last.stats
    if as_json:
        result = _json_result(view.answer, tokens, last, loaded, params)
        if view.split is not None and view.show:
            result = {"text": result.pop("text"), "reasoning": view.reasoning, **result}
        print(json.dumps(result, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
    _print_stats(stats, verbose)


def _stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _json_result(text: str, tokens: list[int], last, loaded, params) -> dict:
    """`--json`'s object. Output constrained to JSON (--json-schema) also carries it parsed ("parsed": null when
    max tokens cut it short)."""
    stats = last.stats
    result = {"text": text, "token_ids": tokens, "finish_reason": last.finish_reason}
    constraint = params.constraint
    if constraint is not None and constraint.is_json:
        from mlxcel_core.constraints import parse_json

        result["parsed"] = parse_json(text)
    result["usage"] = {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
    }
    result["timings"] = {
        "prefill_s": stats.prefill_s,
        "decode_s": stats.decode_s,
        "prefill_tokens_per_s": stats.prefill_tps,
        "decode_tokens_per_s": stats.decode_tps,
        "peak_memory_gb": stats.peak_memory_gb,
    }
    spec = stats.speculative
    if spec is not None:
        result["speculative"] = {
            "rounds": spec.rounds,
            "proposed": spec.proposed,
            "accepted": spec.accepted,
            "acceptance_rate": spec.acceptance_rate,
            "mean_accepted_per_round": spec.mean_accepted,
        }
    result["model"] = str(loaded.source.path)  # the file or directory loaded (stderr says where it came from)
    return result
