"""`mlxcel tune --op qmv-multirow|hmv-multirow`: the CUDA decode matvec kernels' launch configuration per weight shape
and rows of x (autotune/matvec_ops.py); tune.py parses the shared options and hands them here."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import fail

HEADER = (
    f"{'shape':>20} {'rows':>4} | {'default':>24} {'default_us':>10} {'selected':>24} {'best_us':>8} "
    f"{'spread':>7} {'reps':>5} {'speedup':>8}"
)


@dataclass
class Request:
    op: str
    shapes: list[tuple[int, int, str]]  # (N, K, mode)
    rows: list[int]
    group_size: int
    dtype: str
    settings: object  # autotune.profiler.ProfileSettings
    directory: Path
    as_json: bool


def parse_shapes(text: str) -> list[tuple[int, int, str]]:
    """`--shapes 4096x4096,28672x4096:swiglu`: N x K of each weight, and its mode when not plain."""
    shapes = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        dims, _, mode = item.lower().partition(":")
        n, _, k = dims.partition("x")
        if not (n.isdigit() and k.isdigit() and int(n) > 0 and int(k) > 0) or mode not in ("", "plain", "swiglu"):
            raise fail(f"--shapes must be a comma-separated list of NxK[:swiglu] (positive integers), got '{text}'")
        shapes.append((int(n), int(k), mode or "plain"))
    if not shapes:
        raise fail(f"--shapes must be a comma-separated list of NxK[:swiglu] (positive integers), got '{text}'")
    return list(dict.fromkeys(shapes))


def cells(request: Request) -> list:
    from autotune.matvec_ops import QMV, Cell, validate

    group = request.group_size if request.op == QMV else 0
    shapes = [(n, k, "plain") for n, k, _ in request.shapes] if request.op == QMV else request.shapes
    out = [Cell(n, k, m, group, mode) for n, k, mode in dict.fromkeys(shapes) for m in request.rows]
    for cell in out:
        try:
            validate(request.op, cell)
        except ValueError as exc:
            raise fail(str(exc))
    return out


def _shape(cell) -> str:
    return f"{cell.n}x{cell.k}" + ("" if cell.mode == "plain" else f":{cell.mode}")


def dry_run(request: Request) -> None:
    from autotune.matvec_ops import QMV, candidates, default_config, label, runner

    op = request.op
    rows = [
        {
            "n": c.n,
            "k": c.k,
            "mode": c.mode,
            "rows": c.m,
            "cell": c.key(),
            "default": label(default_config(op, c)),
            "candidates": [label(x) for x in candidates(op, c)],
        }
        for c in cells(request)
    ]
    head = {"dry_run": True, "cache_dir": str(request.directory), "op": op, "runner": runner(op)}
    if request.as_json:
        body = {**head, "profile": request.settings.__dict__, "dtype": request.dtype, "cells": rows}
        print(json.dumps(body, indent=2))
        return
    print(f"autotune cache: {request.directory}")
    print(f"profile: {request.settings.describe()}")
    print(f"runner: {head['runner']} (a CUDA decode matvec kernel; ROWS, WARPS, UNROLL launch configuration)")
    group = f"group_size={request.group_size} " if op == QMV else ""
    print(f"{op}: {group}dtype={request.dtype}")
    print(f"{'shape':>20} {'rows':>4} | {'default':>24}  candidates (rows,warps,unroll)")
    for c, row in zip(cells(request), rows):
        triples = " ".join(
            x.replace("rows=", "").replace("warps=", "").replace("unroll=", "") for x in row["candidates"]
        )
        print(f"{_shape(c):>20} {c.m:>4} | {row['default']:>24}  {triples}  (dry run)")
    print(f"dry run: {len(rows)} cells, nothing measured or written.")


def run(request: Request) -> None:
    from autotune.matvec_ops import entry_from_result, label, profile_cell, runner
    from autotune.ops import device_identity
    from autotune.store import Store
    from mlxcel_core.backends import current

    op, todo = request.op, cells(request)
    if not current().name.startswith("cuda"):
        raise fail(f"--op {op} tunes a CUDA matvec kernel: this machine has no MLX CUDA device")
    device, store, out = device_identity(), Store(request.directory), []
    emit = (lambda line: None) if request.as_json else (lambda line: print(line, flush=True))
    emit(f"autotune cache: {request.directory}")
    emit(f"runner: {runner(op)} device: {device}")
    emit(f"{op}: dtype={request.dtype}")
    emit(HEADER)
    for cell in todo:
        print(f"mlxcel: tune: {_shape(cell)} rows {cell.m}...", file=sys.stderr, flush=True)
        default, result = profile_cell(op, cell, request.dtype, request.settings)
        row = {"cell": cell.key(), "default": label(default), "candidates": result.candidates, "selected": None}
        row["dropped"] = [{"tactic": t, "reason": r} for t, r in result.dropped]
        if result.usable:
            entry = entry_from_result(op, cell, device, request.dtype, default, result)
            row.update(selected=result.selected, default_us=entry.default_latency_us, best_us=entry.latency_us)
            row.update(speedup=result.speedup, cache_file=str(store.save(entry)))
            emit(
                f"{_shape(cell):>20} {cell.m:>4} | {label(default):>24} {entry.default_latency_us:>10.2f} "
                f"{result.selected:>24} {entry.latency_us:>8.2f} {result.best.spread * 100:>6.1f}% {result.reps:>5} "
                f"{result.speedup:>7.3f}x"
            )
        else:
            emit(f"{_shape(cell):>20} {cell.m:>4} | skipped (no usable measurement)")
        for tactic, reason in result.dropped:
            emit(f"{'':>26}   dropped {tactic}: {reason}")
        out.append(row)
    if request.as_json:
        print(json.dumps({"dry_run": False, "op": op, "runner": runner(op), "device": device, "cells": out}, indent=2))
    else:
        print("done. Set MLXCEL_AUTOTUNE=cache (or 1) to use these launch configurations.")
