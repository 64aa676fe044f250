"""`mlxcel bench`: llama-bench-style prefill / decode speed. Parse, call mlxcel_core.bench, print."""

from __future__ import annotations

import sys
from typing import Annotated, List, Optional

import typer

from . import options as opt
from .adapter_option import AdapterPath, check_adapter
from .errors import fail, reported_errors
from .progress_line import ProgressLine, hub_download_bars
from .tp import TpSize, join_ranks

OUTPUTS = ("md", "json", "jsonl", "csv")


def _int_list(value: str, option: str, low: int) -> tuple[int, ...]:
    """'512,1024' -> (512, 1024); anything else is a usage error (exit 2)."""
    parts = [p.strip() for p in value.split(",")]
    if not value.strip() or any(p == "" for p in parts):
        raise fail(f"{option} needs a comma-separated list of integers, got '{value}'")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise fail(f"{option} needs a comma-separated list of integers, got '{value}'") from None
    bad = [v for v in values if v < low]
    if bad:
        raise fail(f"{option} values must be >= {low}, got {bad[0]}")
    return values


def _pg(values: Optional[List[str]]) -> tuple[tuple[int, int], ...]:
    pairs = []
    for value in values or ():
        pair = _int_list(value, "--pg", 1)
        if len(pair) != 2:
            raise fail(f"--pg takes PROMPT,GEN (two integers >= 1), got '{value}'")
        pairs.append(pair)
    return tuple(pairs)


def bench(
    model: opt.Model = None,
    model_shape: Annotated[
        Optional[str],
        typer.Option(
            "--model-shape",
            metavar="NAME",
            help="Benchmark a known architecture with random weights instead of a checkpoint (e.g. llama-3-8b, "
            "gpt-oss-20b, gemma-4-e4b; the list is in docs/models.md, and an unknown name prints it).",
        ),
    ] = None,
    bits: Annotated[
        Optional[int],
        typer.Option("--bits", help="With --model-shape: quantize the weights to 4 or 8 bits (group size 64)."),
    ] = None,
    dtype: Annotated[
        Optional[str], typer.Option("--dtype", help="With --model-shape: bfloat16 (default), float16 or float32.")
    ] = None,
    n_prompt: Annotated[
        str, typer.Option("-p", "--n-prompt", metavar="N[,N...]", help="Prompt sizes for the pp tests; 0 = none.")
    ] = "512",
    n_gen: Annotated[
        str, typer.Option("-n", "--n-gen", metavar="N[,N...]", help="Generated tokens for the tg tests; 0 = none.")
    ] = "128",
    repetitions: Annotated[
        int, typer.Option("-r", "--repetitions", help="Timed runs per test (mean ± sample standard deviation).")
    ] = 5,
    n_depth: Annotated[
        str,
        typer.Option(
            "-d",
            "--n-depth",
            metavar="N[,N...]",
            help="Tokens already in the KV cache before each test (prefilled untimed; label ' @ dN').",
        ),
    ] = "0",
    batch: Annotated[
        str,
        typer.Option(
            "-b",
            "--batch-size",
            metavar="B[,B...]",
            help="Sequences run together in one engine; t/s is then the aggregate over all of them.",
        ),
    ] = "1",
    pg: Annotated[
        Optional[List[str]],
        typer.Option(
            "--pg",
            metavar="P,N",
            help="Also run a P-token prompt followed by N generated tokens (ppP+tgN). Repeatable.",
        ),
    ] = None,
    warmup: Annotated[
        bool, typer.Option("--warmup/--no-warmup", help="One untimed run of each test before the timed ones.")
    ] = True,
    output: Annotated[str, typer.Option("-o", "--output", help="Output format: md, json, jsonl or csv.")] = "md",
    kv_bits: opt.KvBits = None,
    storage: opt.StorageBackend = "auto",
    prefill_chunk_size: opt.PrefillChunk = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random prompt token ids.")] = 0,
    tp_size: TpSize = 1,
    adapter_path: AdapterPath = None,
    verbose: opt.Verbose = False,
) -> None:
    """Measure prefill and decode speed, llama-bench style.

    Random token prompts (the same ids in every repetition), EOS ignored. Tests: ppP (prefill: time to first
    token of a P-token prompt), tgN (N decode steps after a 1-token prompt, timed from the first token),
    ppP+tgN, each ' @ dD' with a D-token prefix already cached. Results go to stdout; progress goes to stderr:
    one line rewritten in place on a terminal, every step on its own line with -v.
    """
    with reported_errors(verbose):
        if model is not None and model_shape is not None:
            raise fail("give either -m/--model or --model-shape, not both")
        if model_shape is None and (bits is not None or dtype is not None):
            raise fail("--bits and --dtype apply to --model-shape only")
        if bits not in (None, 4, 8):
            raise fail(f"--bits must be 4 or 8, got {bits}")
        if dtype not in (None, "bfloat16", "float16", "float32"):
            raise fail(f"--dtype must be bfloat16, float16 or float32, got '{dtype}'")
        if output not in OUTPUTS:
            raise fail(f"-o/--output must be one of {', '.join(OUTPUTS)}, got '{output}'")
        if repetitions < 1:
            raise fail(f"-r/--repetitions must be >= 1, got {repetitions}")

        from mlxcel_core.bench import (
            BenchConfig,
        )

        config = BenchConfig(
            n_prompt=_int_list(n_prompt, "-p/--n-prompt", 0),
            n_gen=_int_list(n_gen, "-n/--n-gen", 0),
            pg=_pg(pg),
            n_depth=_int_list(n_depth, "-d/--n-depth", 0),
            n_batch=_int_list(batch, "-b/--batch-size", 1),
            repetitions=repetitions,
            warmup=warmup,
            seed=seed,
            kv_bits=kv_bits,
            storage=storage,
            prefill_chunk_size=prefill_chunk_size,
        )
        config.validate()
        if model_shape is not None:
            from mlxcel_core.loading.shapes import shape_config

            shape_config(model_shape)  # unknown names fail before anything is built

        check_adapter(adapter_path, tp_size)
        group, _ = join_ranks(tp_size, verbose=verbose)
        log = (lambda m: print(f"mlxcel: {m}", file=sys.stderr)) if verbose else None  # None: the progress line
        from mlxcel_core.distributed import lost_peer_errors

        with lost_peer_errors(group):
            _bench(model, model_shape, bits, dtype, seed, config, output, log, group, adapter_path)


def _bench(model, model_shape, bits, dtype, seed, config, output, log, group, adapter_path=None) -> None:
    """Load, print the header, run every test, printing each row as it finishes. `log` None: the per-test progress
    is one line on stderr (on a terminal only) instead of a line per step."""
    from mlxcel_core.bench import bench_header, load_bench_model, plan_tests, run_bench
    from mlxcel_core.bench_output import formatter

    hub_download_bars()
    bench_model = load_bench_model(
        model,
        model_shape,
        bits,
        dtype,
        seed=seed,
        log=lambda m: print(f"mlxcel: {m}", file=sys.stderr),
        group=group,
        adapter_path=adapter_path,
    )
    header = bench_header(bench_model) + (f", tensor parallel over {group.size()} ranks" if group else "")
    tests = plan_tests(config)
    fmt = formatter(output, bench_model.description, tests)
    if output == "md":
        _write(header + "\n\n")
    else:
        print(f"mlxcel: {header}", file=sys.stderr)
    _write(fmt.begin())
    line = ProgressLine(len(tests)) if log is None else None

    def row(result) -> None:
        if line is not None:
            line.advance()
        _write(fmt.row(result))

    try:
        run_bench(bench_model, config, on_result=row, log=line.show if line is not None else log)
    finally:
        if line is not None:
            line.clear()
    _write(fmt.end())


def _write(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
