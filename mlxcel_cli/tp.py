"""`--tp-size N` for the text-generating commands: join (or start) the ranks of a tensor-parallel group.

`mlxcel generate --tp-size 2 ...` on its own starts 2 local ranks over the ring backend on 127.0.0.1 and
waits for them; under `mlx.launch` (one host or several) each process is already a rank and joins the group.
Every rank then runs the same deterministic loop (greedy, or sampling with rank 0's seed); only rank 0 prints.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Optional

import typer

TpSize = Annotated[
    int,
    typer.Option(
        "--tp-size",
        metavar="N",
        help="Tensor parallelism over N ranks (mx.distributed). Without a launcher, starts N local processes (NCCL, "
        "one GPU each, when MLX runs on CUDA; else the ring backend on 127.0.0.1); under `mlx.launch`, N must "
        "equal the number of launched ranks.",
    ),
]


def join_ranks(
    tp_size: int, *, stdin_text: Optional[str] = None, params=None, verbose: bool = False, leader_stdin: bool = False
):
    """(group, params) for this process: (None, params) when tp_size is 1. When not launched as a rank, run
    `tp_size` local ranks of this same command (each given `stdin_text` on stdin; with `leader_stdin`, rank 0
    reads this terminal or pipe and the others nothing) and exit with their status."""
    from .errors import fail

    if tp_size < 1:
        raise fail(f"--tp-size must be >= 1, got {tp_size}")
    if tp_size == 1:
        return None, params
    from mlxcel_core.distributed import init_group, is_launched, run_local_ranks, shared_seed

    if not is_launched():
        raise typer.Exit(
            run_local_ranks(
                tp_size, stdin_data=None if stdin_text is None else stdin_text.encode(), leader_stdin=leader_stdin
            )
        )
    group = init_group(tp_size, quiet_others=not verbose)
    if params is not None:
        params = replace(params, seed=shared_seed(group, params.seed))
    return group, params


def follow_leader(group, model: Optional[str], engine_config) -> None:
    """The life of a rank > 0 under `run` or `serve`: load this rank's shard, then mirror rank 0's engine
    (same config) until rank 0 stops. Ctrl-C in the terminal reaches every local rank; only rank 0 acts on
    it (and tells this one)."""
    import signal
    import sys

    from mlxcel_core.distributed import lost_peer_errors
    from mlxcel_core.distributed.mirror import follow
    from mlxcel_core.engine import Engine
    from mlxcel_core.loading import load_model

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log = lambda m: print(f"mlxcel: {m}", file=sys.stderr)  # noqa: E731 - ranks > 0 print errors only
    with lost_peer_errors(group):
        loaded = load_model(model, log=log, group=group)
        speculative = engine_config.speculative
        draft = load_model(speculative.draft_model, log=log) if speculative and speculative.draft_model else None
        follow(Engine(loaded.model, loaded.tokenizer, engine_config, draft=draft), group)
