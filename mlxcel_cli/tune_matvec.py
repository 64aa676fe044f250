"""`mlxcel tune --op qmv-multirow|hmv-multirow|qmm-splits`: the CUDA decode product kernels' launch configuration per
weight shape and rows of x (autotune/matvec_ops.py); tune.py parses the shared options and hands them here."""

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
    from autotune.matvec_ops import HMV, SPECS, Cell, cell_of, validate

    op = request.op
    group = 0 if op == HMV else request.group_size
    shapes = request.shapes if len(SPECS[op].modes) > 1 else [(n, k, "plain") for n, k, _ in request.shapes]
    asked = [Cell(n, k, m, group, mode) for n, k, mode in shapes for m in request.rows]
    for cell in asked:  # (the rows as asked: a cell rounds them up to the kernel's tiles)
        try:
            validate(request.op, cell)
        except ValueError as exc:
            raise fail(str(exc))
    return list(dict.fromkeys(cell_of(op, c.n, c.k, c.m, c.group_size, c.mode) for c in asked))


def _shape(cell) -> str:
    return f"{cell.n}x{cell.k}" + ("" if cell.mode == "plain" else f":{cell.mode}")


def dry_run_doc(request: Request) -> dict:
    """The dry run of `request` as one JSON-ready object: its cells, each with the rule's choice and the candidates."""
    from autotune.matvec_ops import candidates, default_config, label, runner_kind

    op = request.op
    rows = [
        {
            "n": c.n,
            "k": c.k,
            "mode": c.mode,
            "rows": c.m,
            "cell": c.key(),
            "default": label(default_config(op, c), op),
            "candidates": [label(x, op) for x in candidates(op, c)],
        }
        for c in cells(request)
    ]
    head = {"dry_run": True, "cache_dir": str(request.directory), "op": op, "runner": runner_kind(op)}
    return {**head, "profile": request.settings.__dict__, "dtype": request.dtype, "cells": rows}


def print_dry_run(request: Request, doc: dict, header: bool = True) -> None:
    """`doc` (dry_run_doc's) as text; `header`: the cache and profile lines too (not under another op's)."""
    from autotune.matvec_ops import HMV

    if header:
        print(f"autotune cache: {request.directory}")
        print(f"profile: {request.settings.describe()}")
    print(f"runner: {doc['runner']} (a CUDA decode product kernel; its launch configuration)")
    group = "" if request.op == HMV else f"group_size={request.group_size} "
    print(f"{request.op}: {group}dtype={request.dtype}")
    rows = doc["cells"]
    names = ",".join(f.partition("=")[0] for f in rows[0]["default"].split(",")) if rows else ""
    print(f"{'shape':>20} {'rows':>4} | {'default':>24}  candidates ({names})")
    for row in rows:
        shape = f"{row['n']}x{row['k']}" + ("" if row["mode"] == "plain" else f":{row['mode']}")
        values = " ".join(",".join(f.partition("=")[2] for f in x.split(",")) for x in row["candidates"])
        print(f"{shape:>20} {row['rows']:>4} | {row['default']:>24}  {values}  (dry run)")
    print(f"dry run: {len(rows)} cells, nothing measured or written.")


def dry_run(request: Request) -> None:
    doc = dry_run_doc(request)
    if request.as_json:
        print(json.dumps(doc, indent=2))
    else:
        print_dry_run(request, doc)


def run(request: Request) -> None:
    from autotune.matvec_ops import entry_from_result, label, profile_cell, runner
    from autotune.ops import device_identity
    from autotune.store import Store
    from mlxcel_core.backends import current

    op, todo = request.op, cells(request)
    if not current().name.startswith("cuda"):
        raise fail(f"--op {op} tunes a CUDA kernel: this machine has no MLX CUDA device")
    device, store, out = device_identity(), Store(request.directory), []
    emit = (lambda line: None) if request.as_json else (lambda line: print(line, flush=True))
    emit(f"autotune cache: {request.directory}")
    emit(f"runner: {runner(op)} device: {device}")
    emit(f"{op}: dtype={request.dtype}")
    emit(HEADER)
    for cell in todo:
        print(f"mlxcel: tune: {_shape(cell)} rows {cell.m}...", file=sys.stderr, flush=True)
        default, result = profile_cell(op, cell, request.dtype, request.settings)
        row = {"cell": cell.key(), "default": label(default, op), "candidates": result.candidates, "selected": None}
        row["dropped"] = [{"tactic": t, "reason": r} for t, r in result.dropped]
        if result.usable:
            entry = entry_from_result(op, cell, device, request.dtype, default, result)
            row.update(selected=result.selected, default_us=entry.default_latency_us, best_us=entry.latency_us)
            row.update(speedup=result.speedup, cache_file=str(store.save(entry)))
            emit(
                f"{_shape(cell):>20} {cell.m:>4} | {label(default, op):>24} {entry.default_latency_us:>10.2f} "
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
