"""`mlxcel run`: chat with a model in the terminal (or answer one prompt with -p, like generate).

Only terminal I/O lives here; turns, history, KV reuse and context trimming are mlxcel_core.chat.ChatSession.
Line editing and history come from the standard library's readline (no extra dependency, and it behaves
in pseudo-terminals and over ssh the same way).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Annotated, Optional

import typer

from . import options as opt
from .adapter_option import AdapterPath, check_adapter
from .completion import complete_model
from .errors import fail, reported_errors
from .generate import _read_prompt, answer_once
from .prefill_notice import PrefillNotice
from .progress_line import hub_download_bars
from .reasoning_view import ReasoningView, check_mode
from .tp import TpSize, follow_leader, join_ranks

PROMPT, CONTINUATION, FENCE = ">>> ", "... ", '"""'
COMMANDS = ("/help", "/clear", "/system", "/set", "/stats", "/bye", "/exit")
HELP = f"""commands:
  /help                 this list
  /clear                start a new conversation (the system prompt is kept)
  /system [TEXT]        show or set the system prompt
  /set [NAME VALUE]     show or change a setting: temp, top-k, top-p, min-p, max-tokens, seed,
                        repeat-penalty, repeat-last-n, presence-penalty, frequency-penalty, dry-multiplier,
                        dry-base, dry-allowed-length, dry-penalty-last-n, xtc-threshold, xtc-probability
  /stats                token counts and speeds of the last reply
  /bye, /exit           leave (so do Ctrl-D, and Ctrl-C at an empty prompt)
{FENCE} starts and ends a multi-line message; Ctrl-C during a reply stops it (the partial reply is kept)."""


def run(
    model_arg: Annotated[
        Optional[str],
        typer.Argument(
            metavar="[MODEL]",
            show_default=False,
            help="Model directory, .gguf file, Hugging Face repo id or catalogue name (same as -m). "
            "Default: SmolLM2-135M-Instruct.",
            autocompletion=complete_model,
        ),
    ] = None,
    model: opt.Model = None,
    adapter_path: AdapterPath = None,
    prompt: Annotated[
        Optional[str],
        typer.Option(
            "-p", "--prompt", help="Answer this one prompt exactly like `mlxcel generate` and exit ('-' reads stdin)."
        ),
    ] = None,
    system: opt.System = None,
    parse_special_in_content: opt.ParseSpecialInContent = False,
    reasoning: opt.Reasoning = "show",
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
    kv_bits: opt.KvBits = None,
    prefill_chunk_size: opt.PrefillChunk = None,
    ctx_size: opt.CtxSize = 0,
    draft_model: opt.DraftModel = None,
    draft_ngram: opt.DraftNgram = 0,
    num_draft_tokens: opt.NumDraftTokens = 5,
    tp_size: TpSize = 1,
    verbose: opt.Verbose = False,
) -> None:
    """Chat with a model in the terminal (with -p: answer one prompt and exit).

    Replies stream as they are generated, and each turn reuses the KV cache of the conversation so far,
    so only the new message is computed. Type /help in the chat for its commands.

    With -p, answer one prompt like `mlxcel generate` and exit. When stdin is not a terminal, every line
    is one message and every reply is one line on stdout (newlines in a reply written as \\n, backslashes as \\\\).
    """
    with reported_errors(verbose):
        if model_arg and model and model_arg != model:
            raise fail("give the model once: as the MODEL argument or with -m, not both")
        spec = model_arg or model
        check_adapter(adapter_path, tp_size)
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
        engine_config = opt.engine_config(1, kv_bits, "dense", prefill_chunk_size, speculative, ctx_size=ctx_size)
        if prompt is not None:
            text = _read_prompt(prompt)
            if not text.strip():
                raise fail("prompt is empty")
            group, params = join_ranks(
                tp_size, stdin_text=text if prompt == "-" else None, params=params, verbose=verbose
            )
            answer_once(
                text,
                spec,
                params,
                engine_config,
                system,
                verbose=verbose,
                group=group,
                parse_special_in_content=parse_special_in_content,
                reasoning=check_mode(reasoning),
                adapter_path=adapter_path,
            )
            return

        from mlxcel_core.chat import chat_engine_config

        group, _ = join_ranks(tp_size, verbose=verbose, leader_stdin=True)
        if group is not None and group.rank() > 0:  # rank 0 chats; this rank mirrors its engine
            follow_leader(group, spec, chat_engine_config(engine_config))
            return
        code = _chat(
            spec,
            params,
            system,
            engine_config,
            verbose,
            group,
            parse_special_in_content,
            check_mode(reasoning),
            adapter_path,
        )
    if code:
        raise typer.Exit(code)


def _chat(
    spec,
    params,
    system,
    engine_config,
    verbose: bool,
    group,
    parse_special_in_content: bool,
    reasoning,
    adapter_path=None,
) -> int:
    from mlxcel_core.chat import ChatSession
    from mlxcel_core.distributed import lost_peer_errors
    from mlxcel_core.loading import load_model

    interactive = sys.stdin.isatty()
    hub_download_bars()
    ui = _Ui(
        color=interactive and sys.stderr.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"
    )
    ui.reasoning = reasoning
    with lost_peer_errors(group):
        log = lambda m: print(f"mlxcel: {m}", file=sys.stderr)  # noqa: E731
        loaded = load_model(spec, log=log, group=group, adapter_path=adapter_path)
        loaded.tokenizer.parse_special_in_content = parse_special_in_content
        print(f"mlxcel: model: {loaded.source.origin}", file=sys.stderr)
        session = ChatSession(
            loaded,
            params,
            system=system,
            engine_config=engine_config,
            notify=lambda m: ui.info(f"mlxcel: {m}"),
            on_prefill=ui.reading if interactive else None,
        )
        mirror = None
        if group is not None:  # the other ranks mirror this chat's engine until it stops
            from mlxcel_core.distributed.mirror import LeaderMirror

            print(f"mlxcel: tensor parallel: {group.size()} ranks", file=sys.stderr)
            mirror = session.engine.mirror = LeaderMirror(group)
        try:
            return _interactive(session, ui, verbose) if interactive else _piped(session, ui, verbose)
        finally:
            if mirror is not None:
                mirror.stop()


class _Ui:
    """Where non-reply text goes: stderr, dimmed on a colour terminal. Replies alone go to stdout."""

    def __init__(self, color: bool):
        self.color = color
        self.reasoning = "show"  # --reasoning: a reasoning model's reasoning shown or hidden (reasoning_view.py)
        self.notice: PrefillNotice | None = None

    def reading(self, n_tokens: int) -> None:
        """A turn starts computing `n_tokens` prompt tokens: the line while a long message is read (terminal only)."""
        self.notice = PrefillNotice(n_tokens, as_json=False)

    def read(self) -> None:
        """The reply's first text is here, or the turn ended: the line goes."""
        if self.notice is not None:
            self.notice.done()
            self.notice = None

    def info(self, text: str) -> None:
        print(f"\x1b[2m{text}\x1b[0m" if self.color else text, file=sys.stderr, flush=True)

    def error(self, text: str) -> None:
        print(f"mlxcel: error: {text}", file=sys.stderr, flush=True)


# -- the two modes -----------------------------------------------------------------------------------
def _interactive(session, ui: _Ui, verbose: bool) -> int:
    readline = _setup_readline()
    ui.info(f"Chat started. /help for commands, {FENCE} for multi-line input, /bye or Ctrl-D to leave.")
    while True:
        try:
            text, fenced = _read_message()
        except EOFError:  # Ctrl-D
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            typed = readline.get_line_buffer() if readline else ""
            print(file=sys.stderr)
            if typed:  # Ctrl-C with text on the line: drop the line, like a shell
                continue
            return 0
        if text is None or not text.strip():
            continue
        if not fenced and text.lstrip().startswith("/"):
            if _command(session, text.strip(), ui) == "exit":
                return 0
            continue
        _reply(session, text, ui, verbose, interactive=True)


def _piped(session, ui: _Ui, verbose: bool) -> int:
    """One message per input line, one reply per output line (so replies line up with the questions)."""
    status = 0
    for line in iter(sys.stdin.readline, ""):  # a line at a time, so a coprocess gets each answer at once
        text = line.rstrip("\r\n")
        if not text.strip():
            continue
        if text.lstrip().startswith("/"):
            if _command(session, text.strip(), ui) == "exit":
                break
            continue
        status = _reply(session, text, ui, verbose, interactive=False) or status
    return status


def _reply(session, text: str, ui: _Ui, verbose: bool, interactive: bool) -> int:
    """Stream one reply to stdout; Ctrl-C (interactive) stops it. Returns an exit status for the turn."""
    from mlxcel_core.errors import MlxcelError

    out = sys.stdout
    failure, wrote = None, False

    def write(piece: str) -> None:
        nonlocal wrote
        out.write(piece if interactive else _one_line(piece))
        out.flush()
        wrote = True

    if interactive:  # Ctrl-C stops this reply (between engine steps, never inside one) instead of raising
        previous = signal.signal(signal.SIGINT, lambda signum, frame: session.cancel())
    try:
        view = None
        for piece in session.send(text):
            ui.read()
            if view is None:  # (the turn's prompt is rendered by now)
                view = ReasoningView(session.reply_split(session.prompt_ids), ui.reasoning, write)
            view.feed(piece)
        if view is not None:
            view.finish()
    except MlxcelError as exc:  # one line, and the chat goes on
        failure = exc
    finally:
        ui.read()
        if interactive:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if wrote or failure is None or not interactive:  # piped: a failed turn still writes its (empty) line
        out.write("\n")
        out.flush()
    if failure is not None:
        ui.error(str(failure))
        return failure.exit_code
    turn = session.last_turn
    if turn.interrupted:
        ui.info("[interrupted]")
    if verbose:
        ui.info(
            f"mlxcel: prompt {turn.prompt_tokens} tokens: {turn.computed_tokens} computed "
            f"({turn.cached_tokens} cached), {turn.prefill_tps:.2f} tok/s; "
            f"reply {turn.generated_tokens} tokens, {turn.decode_tps:.2f} tok/s"
        )
    return 0


def _one_line(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\r", "\\r").replace("\n", "\\n")


# -- input ---------------------------------------------------------------------------------------------
def _setup_readline():
    """Line editing, in-session history and Tab completion of commands, where readline exists."""
    try:
        import readline
    except ImportError:  # e.g. Windows without pyreadline: plain input() still works
        return None

    def complete(text: str, state: int):
        matches = [c for c in COMMANDS if c.startswith(text)] if text.startswith("/") else []
        return matches[state] if state < len(matches) else None

    readline.set_completer(complete)
    readline.set_completer_delims(" \t\n")
    if "libedit" in (readline.__doc__ or ""):
        readline.parse_and_bind("bind ^I rl_complete")
    else:
        readline.parse_and_bind("tab: complete")
    return readline


def _input(prompt: str) -> str:
    """input(), but the prompt goes to stderr when stdout is not the terminal (stdout carries replies only)."""
    if sys.stdout.isatty():
        return input(prompt)
    sys.stderr.write(prompt)
    sys.stderr.flush()
    return input()


def _read_message() -> tuple[str | None, bool]:
    """One message: a line, or the lines between two \"\"\" fences. Returns (text or None, fenced)."""
    line = _input(PROMPT)
    start = line.lstrip()
    if not start.startswith(FENCE):
        return line, False
    rest = start[len(FENCE) :]
    if rest.rstrip().endswith(FENCE):  # """one line"""
        return rest.rstrip()[: -len(FENCE)], True
    lines = [rest] if rest.strip() else []
    while True:
        try:
            more = _input(CONTINUATION)
        except KeyboardInterrupt:  # abandon this message, back to the prompt
            print(file=sys.stderr)
            return None, True
        if more.rstrip().endswith(FENCE):
            last = more.rstrip()[: -len(FENCE)]
            if last.strip():
                lines.append(last)
            return "\n".join(lines), True
        lines.append(more)


# -- slash commands -------------------------------------------------------------------------------------
def _command(session, line: str, ui: _Ui) -> str | None:
    """Run one /command; problems are one line and the chat goes on. Returns "exit" to leave."""
    from mlxcel_core.errors import InputError

    name, _, arg = line.partition(" ")
    arg = arg.strip()
    name = name.lower()
    if name in ("/bye", "/exit", "/quit"):
        return "exit"
    if name in ("/help", "/?"):
        ui.info(HELP)
    elif name == "/clear":
        session.clear()
        ui.info("mlxcel: new conversation" + (" (system prompt kept)" if session.system else ""))
    elif name == "/system":
        if arg:
            session.system = arg
            ui.info("mlxcel: system prompt set")
        else:
            ui.info(
                f"system prompt: {session.system}" if session.system else "no system prompt (/system TEXT sets one)"
            )
    elif name == "/set":
        if not arg:
            p = session.params
            ui.info(
                f"temp {p.temperature}, top-k {p.top_k}, top-p {p.top_p}, min-p {p.min_p}, "
                f"max-tokens {p.max_tokens}, seed {p.seed if p.seed is not None else 'none'}, "
                f"repeat-penalty {p.repetition_penalty}, repeat-last-n {p.repeat_last_n}, "
                f"presence-penalty {p.presence_penalty}, frequency-penalty {p.frequency_penalty}, "
                f"dry-multiplier {p.dry_multiplier}, dry-base {p.dry_base}, "
                f"dry-allowed-length {p.dry_allowed_length}, dry-penalty-last-n {p.dry_penalty_last_n}, "
                f"xtc-threshold {p.xtc_threshold}, xtc-probability {p.xtc_probability}"
            )
            return None
        key, _, value = arg.partition(" ")
        if not value.strip():
            ui.error(f"usage: /set {key} VALUE")
            return None
        try:
            session.set(key, value)
        except InputError as exc:
            ui.error(str(exc))
        else:
            ui.info(f"mlxcel: {key} = {value.strip()}")
    elif name == "/stats":
        turn = session.last_turn
        if turn is None:
            ui.info("no reply yet")
        else:
            ui.info(
                f"prompt tokens: {turn.prompt_tokens}\n"
                f"prefill computed tokens: {turn.computed_tokens} ({turn.cached_tokens} reused from the cache), "
                f"{turn.prefill_tps:.2f} tok/s\n"
                f"generated tokens: {turn.generated_tokens}, {turn.decode_tps:.2f} tok/s"
                + (" (interrupted)" if turn.interrupted else "")
            )
    else:
        ui.error(f"unknown command {name}; /help lists the commands")
    return None
