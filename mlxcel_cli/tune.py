"""`mlxcel tune`: profile kernel tactics per shape and store the winners in the autotune cache."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .completion import complete_model
from .errors import fail, reported_errors

ENABLE = "Set MLXCEL_AUTOTUNE=cache (or 1) to consume these tactics at runtime."
HINT = f"done. {ENABLE}"
HEADER = (
    f"{'batch':>7} {'context':>8} | {'default':>13} {'default_us':>11} {'selected':>13} {'best_us':>10} "
    f"{'spread':>7} {'reps':>5} {'guard':>6} {'speedup':>8}"
)


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise fail(f"{option} must be a comma-separated list of positive integers, got '{text}'")
    return list(dict.fromkeys(values))


def _model_path(model: str) -> Path:
    """A local path as given; a catalogue name or a Hugging Face repo id: its files in the cache (from disk only:
    ModelNotFoundError, exit 2, naming `mlxcel pull` when it is not downloaded)."""
    from mlxcel_core import catalog
    from mlxcel_core.loading.resolve import _REPO_ID

    path = Path(model).expanduser()
    if path.exists() or model.startswith((".", "/", "~")):
        return path
    if not (catalog.looks_like_name(model) or _REPO_ID.match(model)):
        return path
    from mlxcel_core.model_store import locate

    return locate(model).path


def _read_model_config(model: str, path: Path) -> dict:
    """config.json of a model directory or a config.json path."""
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise fail(
            f"-m {model}: no config.json there (give a model directory, its config.json, "
            "a GGUF file, or a catalogue name or Hugging Face repo id that is already downloaded)"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise fail(f"-m {model}: cannot read {path}: {exc}")
    return config


def _is_gguf(path: Path) -> bool:
    """A GGUF file, by its name or by its first four bytes."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _gguf_config(path: Path) -> dict:
    """The config.json-style dict of a GGUF file (loading/gguf_arch.py), from its header alone: no tensor is read."""
    from mlxcel_core.errors import MlxcelError
    from mlxcel_core.loading.gguf_arch import gguf_config
    from mlxcel_core.loading.gguf_header import read_header

    try:
        meta, tensors = read_header(path)
        return gguf_config(meta, [t.name for t in tensors])
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except MlxcelError as exc:  # (an architecture or hyper-parameter it lacks)
        raise ValueError(str(exc)) from None
    except ValueError as exc:
        raise ValueError(f"not a readable GGUF file ({exc})") from None


def _gguf_geometry(path: Path) -> dict[str, int]:
    """head_dim / q_heads / kv_heads from a GGUF file's metadata (its header only; no tensor is read)."""
    from mlxcel_core.loading.gguf_arch import attention_geometry
    from mlxcel_core.loading.gguf_header import read_metadata

    try:
        meta = read_metadata(path, strings=False)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"not a readable GGUF file ({exc})") from None
    return attention_geometry(meta)


def geometry_from_config(config: dict) -> dict[str, int]:
    """head_dim / q_heads / kv_heads from a config.json (its text_config first, when there is one).
    head_dim falls back to hidden_size / heads; kv heads fall back to the query heads."""
    text = config.get("text_config")
    cfg = {**config, **text} if isinstance(text, dict) else config

    def first(*names):
        for name in names:
            if isinstance(cfg.get(name), int) and not isinstance(cfg.get(name), bool):
                return cfg[name]
        return None

    q_heads = first("num_attention_heads", "n_head", "n_heads")
    if not q_heads:
        raise ValueError("config.json has no num_attention_heads")
    kv_heads = first("num_key_value_heads", "n_kv_heads", "num_kv_heads") or q_heads
    head_dim = first("head_dim")
    if not head_dim:
        hidden = first("hidden_size", "n_embd", "d_model")
        if not hidden:
            raise ValueError("config.json has neither head_dim nor hidden_size")
        head_dim = hidden // q_heads
    return {"head_dim": head_dim, "q_heads": q_heads, "kv_heads": kv_heads}


def tune(
    op: Annotated[
        Optional[str],
        typer.Option(
            "--op",
            help="Op to tune (default paged-decode-splits; a dry run without --op lists every op). "
            "paged-decode-splits: the split-K factor of paged decode attention "
            "(the CUDA kernel on CUDA, the MLX-ops path elsewhere). qmv-multirow / hmv-multirow: the launch "
            "configuration (rows, warps, unroll) of the CUDA 4-bit / 16-bit decode matvec kernel, per weight shape "
            "and rows of x; qmm-splits: the K split of the tensor-core 4-bit batch product (CUDA only).",
        ),
    ] = None,
    model: Annotated[
        Optional[str],
        typer.Option(
            "-m",
            "--model",
            metavar="MODEL",
            help="Take the head geometry from MODEL: a GGUF file's metadata, or the config.json of a model "
            "directory or given itself; a catalogue name (`mlxcel ls --catalog`) or Hugging Face repo id already "
            "downloaded reads its files in the cache. No weights are loaded.",
            autocompletion=complete_model,
        ),
    ] = None,
    head_dim: Annotated[
        Optional[int], typer.Option("--head-dim", help="Head dimension. Default: 128, or the model's with -m.")
    ] = None,
    q_heads: Annotated[
        Optional[int], typer.Option("--q-heads", help="Query heads. Default: 32, or the model's with -m.")
    ] = None,
    kv_heads: Annotated[
        Optional[int], typer.Option("--kv-heads", help="Key/value heads. Default: 8, or the model's with -m.")
    ] = None,
    block_size: Annotated[int, typer.Option("--block-size", help="Paged KV block size in tokens.")] = 32,
    batch_sizes: Annotated[
        Optional[str],
        typer.Option(
            "--batch-sizes",
            help="Comma-separated batch sizes of the matrix (the product ops: rows of x, 1-8 for the matvecs, "
            "6-64 for qmm-splits). Default: 1,2,4,8 (qmm-splits: 8,16,32,64).",
        ),
    ] = None,
    shapes: Annotated[
        Optional[str],
        typer.Option(
            "--shapes",
            help="The product ops: comma-separated weight shapes NxK (NxK:swiglu for a fused gate/up weight's "
            "SwiGLU launch). Default: the model's decode matvecs with -m, else Llama-3-8B's.",
        ),
    ] = None,
    group_size: Annotated[
        Optional[int],
        typer.Option(
            "--group-size",
            help="qmv-multirow, qmm-splits: the 4-bit weights' group size. Default: 64; 32 with a GGUF -m (its 4-bit "
            "types load as groups of 32).",
        ),
    ] = None,
    context_lengths: Annotated[
        str, typer.Option("--context-lengths", help="Comma-separated context lengths (tokens) of the matrix.")
    ] = "1024,4096,16384,32768",
    dtype: Annotated[
        str, typer.Option("--dtype", help="KV and query dtype: float16, bfloat16 or float32.")
    ] = "float16",
    warmup: Annotated[int, typer.Option("--warmup", help="Warmup runs per candidate, at least.")] = 3,
    warmup_ms: Annotated[float, typer.Option("--warmup-ms", help="Warmup time per candidate (ms), at least.")] = 40.0,
    min_reps: Annotated[int, typer.Option("--min-reps", help="Fewest timed reps per candidate.")] = 5,
    max_reps: Annotated[int, typer.Option("--max-reps", help="Most timed reps per candidate.")] = 1000,
    sample_ms: Annotated[
        float, typer.Option("--sample-ms", help="Time budget (ms) of one cell's timed rounds; sets the rep count.")
    ] = 250.0,
    min_improvement: Annotated[
        float,
        typer.Option(
            "--min-improvement",
            help="Keep the default unless a candidate is faster by more than this fraction "
            "(and by more than both spreads together).",
        ),
    ] = 0.02,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the cache dir, the method, the geometry and every cell with its candidates; "
            "measure and write nothing.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the table.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Tracebacks on errors.")] = False,
) -> None:
    """Profile kernel tactics for a matrix of shapes and store the winners in the autotune cache.

    paged-decode-splits: each cell (batch size x context length) runs a synthetic workload (no weights): every
    candidate is checked against the default's output, warmed up, then timed round-robin with an adaptive rep count;
    the default is kept unless a candidate wins by more than the guard. Winners go to
    $MLXCEL_CACHE_DIR/autotune/, one JSON file per (op, runner, device, shape bucket, dtype); the engine
    reads them when MLXCEL_AUTOTUNE=cache (or 1; 0 or unset ignores the cache). MLXCEL_PAGED_DECODE_SPLITS
    overrides everything. There is no Metal kernel: on Apple silicon, as on CPU, the MLX-ops path is tuned.
    qmv-multirow / hmv-multirow / qmm-splits: each cell (weight shape x rows of x) times the CUDA 4-bit / 16-bit
    decode matvec kernel's launch configurations, or the tensor-core batch product's K splits, the same way, on
    random weights; the engine uses the winners with MLXCEL_AUTOTUNE=cache (or 1).
    """
    from autotune import autotune_dir
    from autotune.matvec_ops import SPECS as MATVEC_OPS
    from autotune.ops import OP
    from autotune.profiler import ProfileSettings

    with reported_errors(verbose):
        settings = ProfileSettings(warmup, warmup_ms, min_reps, max_reps, sample_ms, min_improvement)
        every_op, op = op is None and dry_run, op or OP
        if op in MATVEC_OPS:
            _matvec(op, model, shapes, batch_sizes, group_size, dtype, settings, dry_run, as_json)
            return
        if op != OP:
            raise fail(f"--op must be one of {', '.join([OP, *MATVEC_OPS])}, got '{op}'")
        geometry = _paged_geometry(model, head_dim, q_heads, kv_heads, block_size)
        _check_profile_and_dtype(settings, dtype)
        cells = [
            (b, c)
            for b in _int_list(batch_sizes or "1,2,4,8", "--batch-sizes")
            for c in _int_list(context_lengths, "--context-lengths")
        ]
        if dry_run:
            others = _other_ops(model, shapes, group_size, dtype, settings, as_json) if every_op else None
            _paged_dry_run(cells, geometry, dtype, settings, as_json, others)
            return
        _run(cells, geometry, dtype, settings, autotune_dir(), as_json)


def _check_profile_and_dtype(settings, dtype: str) -> None:
    """Every op's shared options: the profile settings and --dtype (one line, exit 2, when wrong)."""
    try:
        settings.validate()
    except ValueError as exc:
        raise fail(str(exc))
    from autotune.ops import DTYPES

    if dtype not in DTYPES:
        raise fail(f"--dtype must be float16, bfloat16 or float32, got '{dtype}'")


def _paged_geometry(model, head_dim, q_heads, kv_heads, block_size: int):
    """paged-decode-splits' head geometry: Llama-3-8B's, or -m MODEL's, with --head-dim/--q-heads/--kv-heads over it."""
    from autotune.ops import Geometry

    geo = {"head_dim": 128, "q_heads": 32, "kv_heads": 8}
    if model is not None:
        path = _model_path(model)
        try:
            geo = _gguf_geometry(path) if _is_gguf(path) else geometry_from_config(_read_model_config(model, path))
        except ValueError as exc:
            raise fail(f"-m {model}: {exc}")
    for name, value in (("head_dim", head_dim), ("q_heads", q_heads), ("kv_heads", kv_heads)):
        if value is not None:
            geo[name] = value
    geometry = Geometry(block_size=block_size, **geo)
    try:
        geometry.validate()
    except ValueError as exc:
        raise fail(str(exc))
    return geometry


def _paged_dry_run(cells, geometry, dtype: str, settings, as_json: bool, others: list | None) -> None:
    """paged-decode-splits' cells with their defaults and candidates; then `others` (_other_ops': every product op,
    when no --op was given)."""
    from autotune import autotune_dir
    from autotune.ops import OP, Bucket, candidates, default_splits, describe_runner, label, predicted_runner

    from . import tune_matvec

    runner, directory, rows = predicted_runner(), autotune_dir(), []
    for b, c in cells:
        bucket = Bucket.of(b, c, geometry)
        default, cands = label(default_splits(bucket, runner, dtype)), [label(s) for s in candidates(bucket, runner)]
        rows.append({"batch": b, "context": c, "bucket": bucket.key(), "default": default, "candidates": cands})
    if as_json:
        doc = {"dry_run": True, "cache_dir": str(directory), "op": OP, "runner": runner, "profile": settings.__dict__}
        doc.update(geometry=geometry.__dict__, dtype=dtype, cells=rows)
        if others is not None:
            doc["more_ops"] = [d if isinstance(d, dict) else {"op": r, "skipped": d} for r, d in others]
        print(json.dumps(doc, indent=2))
        return
    print(f"autotune cache: {directory}")
    print(f"profile: {settings.describe()}")
    print(f"runner: {describe_runner(runner)}")
    print(f"{OP}: {geometry.describe()} dtype={dtype}")
    print(f"{'batch':>7} {'context':>8} | {'default':>13}  candidates")
    for row in rows:
        splits = ",".join(s.split("=")[1] for s in row["candidates"])
        print(f"{row['batch']:>7} {row['context']:>8} | {row['default']:>13}  {splits}  (dry run)")
    print(f"dry run: {len(rows)} cells, nothing measured or written. {ENABLE}")
    for request, doc in others or []:
        print()
        if isinstance(doc, str):
            print(doc)
        else:
            tune_matvec.print_dry_run(request, doc, header=False)


def _matvec(op: str, model, shapes, batch_sizes, group_size: int, dtype: str, settings, dry_run, as_json) -> None:
    from . import tune_matvec

    request = _matvec_request(op, model, shapes, batch_sizes, group_size, dtype, settings, as_json)
    (tune_matvec.dry_run if dry_run else tune_matvec.run)(request)


def _matvec_request(op: str, model, shapes, batch_sizes, group_size, dtype: str, settings, as_json):
    """The request of a product kernel's op; `batch_sizes` None: the op's default rows; `group_size` None: 64, or a
    GGUF file's 32."""
    from autotune import autotune_dir
    from autotune.matvec_ops import LLAMA_3_8B_SHAPES

    from . import tune_matvec

    _check_profile_and_dtype(settings, dtype)
    gguf = model is not None and _is_gguf(_model_path(model))
    if shapes is not None:
        weights = tune_matvec.parse_shapes(shapes)
    elif model is not None:
        try:
            weights = _model_shapes(model)
        except ValueError as exc:
            raise fail(f"-m {model}: {exc}")
    else:
        weights = list(LLAMA_3_8B_SHAPES)
    rows = _int_list(batch_sizes or ("8,16,32,64" if op == "qmm-splits" else "1,2,4,8"), "--batch-sizes")
    group_size = group_size or (32 if gguf else 64)
    return tune_matvec.Request(op, weights, rows, group_size, dtype, settings, autotune_dir(), as_json)


def _model_shapes(model: str) -> list:
    """The decode products' (N, K, mode) of -m MODEL: from its config.json, or a GGUF file's header."""
    from autotune.matvec_ops import shapes_from_config

    path = _model_path(model)
    return shapes_from_config(_gguf_config(path) if _is_gguf(path) else _read_model_config(model, path))


def _other_ops(model, shapes, group_size, dtype: str, settings, as_json) -> list:
    """For `tune --dry-run` without --op: each product kernel's (request, doc) at its default rows, or (op, reason)
    where -m's weight shapes cannot be read (the paged op needs only its attention metadata)."""
    from autotune.matvec_ops import SPECS

    from . import tune_matvec

    if shapes is None and model is not None:
        try:
            _model_shapes(model)
        except ValueError as exc:
            return [
                (op, f"{op}: no weight shapes from -m {model} ({exc}): give --op {op} --shapes NxK,...") for op in SPECS
            ]
    requests = [_matvec_request(op, model, shapes, None, group_size, dtype, settings, as_json) for op in SPECS]
    return [(request, tune_matvec.dry_run_doc(request)) for request in requests]


def _progress():
    """A progress bar on stderr (cleared when done), stdout redirected through it only when both are terminals."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        redirect_stdout=console.is_terminal and sys.stdout.isatty(),
        redirect_stderr=False,
    )


def _cell_report(b: int, c: int, bucket, default: int, result, save) -> tuple[dict, list[str]]:
    """One profiled cell as its JSON object and its table lines; `save(result)` stores a usable result's entry and
    gives the cache file."""
    from autotune.ops import label

    cell = {
        "batch": b,
        "context": c,
        "bucket": bucket.key(),
        "default": label(default),
        "candidates": result.candidates,
        "dropped": [{"tactic": t, "reason": r} for t, r in result.dropped],
        "selected": None,
    }
    if not result.usable:
        lines = [f"{b:>7} {c:>8} | skipped (no usable measurement)"]
    else:
        best, ref = result.best, result.default_measurement
        cell.update(
            selected=result.selected,
            default_us=ref.median_us,
            best_us=best.median_us,
            spread=best.spread,
            default_spread=ref.spread,
            reps=result.reps,
            guard=result.required_improvement,
            speedup=result.speedup,
            cache_file=str(save(result)),
        )
        lines = [
            f"{b:>7} {c:>8} | {label(default):>13} {ref.median_us:>11.1f} {result.selected:>13} "
            f"{best.median_us:>10.1f} {best.spread * 100:>6.1f}% {result.reps:>5} "
            f"{result.required_improvement * 100:>5.1f}% {result.speedup:>7.3f}x"
        ]
    return cell, lines + [f"{'':>16}   dropped {tactic}: {reason}" for tactic, reason in result.dropped]


def _run(cells, geometry, dtype: str, settings, directory: Path, as_json: bool) -> None:
    from autotune.ops import OP, current_runner, describe_runner, device_identity, profile_cell
    from autotune.runtime import entry_from_result
    from autotune.store import Store

    runner, device, store, out = current_runner(geometry.head_dim), device_identity(), Store(directory), []
    emit = (lambda line: None) if as_json else (lambda line: print(line, flush=True))
    emit(f"autotune cache: {directory}")
    emit(f"profile: {settings.describe()}")
    emit(f"runner: {describe_runner(runner)} device: {device}")
    emit(f"{OP}: {geometry.describe()} dtype={dtype}")
    emit(HEADER)
    with _progress() as progress:
        task = progress.add_task("tune", total=len(cells))
        for b, c in cells:

            def phase(name: str, b=b, c=c) -> None:
                progress.update(task, description=f"batch {b} context {c}: {name}")

            phase("workload")
            bucket, _, default, result = profile_cell(b, c, geometry, dtype, settings, runner, progress=phase)
            progress.advance(task)

            def save(result, bucket=bucket, default=default):
                return store.save(entry_from_result(bucket, runner, device, dtype, default, result))

            cell, lines = _cell_report(b, c, bucket, default, result, save)
            for line in lines:
                emit(line)
            out.append(cell)
    if not as_json:
        print(HINT)
        return
    doc = {"dry_run": False, "cache_dir": str(directory), "op": OP, "runner": runner, "device": device}
    doc.update(profile=settings.__dict__, geometry=geometry.__dict__, dtype=dtype, cells=out)
    print(json.dumps(doc, indent=2))
