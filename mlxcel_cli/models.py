"""`mlxcel pull`, `ls`, `rm`, `show`: models by name, in the Hugging Face cache and mlxcel's cache dir."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Optional

import typer

from .completion import complete_model
from .errors import fail, reported_errors

Json = Annotated[bool, typer.Option("--json", help="Print one JSON document (for scripts) instead of text.")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Tracebacks on errors.")]


def _stderr(message: str) -> None:
    print(f"mlxcel: {message}", file=sys.stderr)


def _quiet(message: str) -> None:
    pass


def human_size(size: int | None) -> str:
    if size is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return ""


def _ago(when: float | None) -> str:
    if not when:
        return "never"
    seconds = max(0, time.time() - when)
    for unit, span in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= span:
            n = int(seconds // span)
            return f"{n} {unit}{'s' if n > 1 else ''} ago"
    return "just now"


def pull(
    name: Annotated[
        str,
        typer.Argument(
            metavar="NAME",
            help="A catalogue name (smollm2, qwen3:4b-4bit) or a Hugging Face repo id (org/name).",
            autocompletion=complete_model,
        ),
    ],
    json_out: Json = False,
    verbose: Verbose = False,
) -> None:
    """Download a model into the Hugging Face cache and verify every file's checksum.

    A progress bar shows on stderr when it is a terminal. Files already downloaded are not fetched again; a
    dropped connection resumes where it stopped. Each file is then hashed and compared with the Hub's listing
    (sha256 for LFS files, the git blob id for the others); a mismatching file is downloaded again once, and the
    pull fails (exit 1) if it still differs. Network failures exit 1; an unknown name or repo exits 2."""
    with reported_errors(verbose):
        from mlxcel_core.pull import pull as pull_model

        terminal = sys.stderr.isatty() and not json_out
        result = pull_model(name, _stderr if terminal or verbose else _quiet, progress=terminal)
        if json_out:
            print(json.dumps(result.as_json()))
            return
        again = f", {len(result.fetched_again)} downloaded again" if result.fetched_again else ""
        print(
            f"{name}: {result.repo}@{result.commit[:12]}, {len(result.files)} files, "
            f"{human_size(result.size)}, checksums verified{again}"
        )


def ls(
    catalog_names: Annotated[
        bool, typer.Option("--catalog", help="List the catalogue's model names instead, marking the downloaded ones.")
    ] = False,
    json_out: Json = False,
    verbose: Verbose = False,
) -> None:
    """List downloaded models: name, source (hf-cache or mlxcel-cache), format, size on disk, last used."""
    with reported_errors(verbose):
        from mlxcel_core import catalog
        from mlxcel_core.model_store import list_models

        stored = list_models()
        if catalog_names:
            have = {m.name for m in stored}
            rows = [
                {"name": e.name, "repo": e.repo, "format": e.format, "downloaded": e.name in have, "note": e.note}
                for e in catalog.ENTRIES
            ]
            if json_out:
                print(json.dumps(rows))
                return
            _table(
                ["NAME", "REPO", "FORMAT", "DOWNLOADED", "NOTE"],
                [[r["name"], r["repo"], r["format"], "yes" if r["downloaded"] else "", r["note"]] for r in rows],
            )
            return
        if json_out:
            print(json.dumps([m.as_json() for m in stored]))
            return
        _table(
            ["NAME", "SOURCE", "FORMAT", "SIZE", "LAST USED"],
            [[m.name, m.source, m.format, human_size(m.size), _ago(m.last_used)] for m in stored],
        )


def _table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())


def rm(
    name: Annotated[
        str,
        typer.Argument(
            metavar="NAME",
            help="A catalogue name, a Hugging Face repo id, or a name `mlxcel ls` shows.",
            autocompletion=complete_model,
        ),
    ],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Remove without asking.")] = False,
    json_out: Json = False,
    verbose: Verbose = False,
) -> None:
    """Remove a downloaded model from the Hugging Face cache or mlxcel's cache dir.

    Asks for confirmation on a terminal; elsewhere (scripts, pipes) --yes is required. A catalogue name
    removes every copy of it (the default model may be in both caches); a GGUF file that shares its Hub repo
    with other downloaded GGUF files is removed alone."""
    with reported_errors(verbose):
        from mlxcel_core.model_store import find_stored, remove

        targets = find_stored(name)
        listing = "; ".join(f"{m.name} ({m.source}, {human_size(m.size)})" for m in targets)
        if not yes:
            if not sys.stdin.isatty():
                raise fail(f"would remove {listing}: pass --yes to remove without a terminal to confirm on")
            if not typer.confirm(f"remove {listing}?", default=False, err=True):
                print("mlxcel: nothing removed", file=sys.stderr)
                raise typer.Exit(1)
        for model in targets:
            remove(model)
        if json_out:
            print(json.dumps({"removed": [m.as_json() for m in targets]}))
        else:
            print(f"removed {listing}")


def show(
    model: Annotated[
        Optional[str],
        typer.Argument(
            metavar="[MODEL]",
            help="Model directory, .gguf file, Hugging Face repo id or catalogue name; default: the default model.",
            autocompletion=complete_model,
        ),
    ] = None,
    json_out: Json = False,
    verbose: Verbose = False,
) -> None:
    """Show what a downloaded model is: architecture, parameters, quantization, context length, chat template,
    license (like `ollama show`). Reads config.json and the safetensors headers, or the GGUF header; loads no
    weights and downloads nothing (a model that is not on disk is an error naming `mlxcel pull`)."""
    with reported_errors(verbose):
        from mlxcel_core.model_info import describe
        from mlxcel_core.model_store import locate

        info = describe(locate(model))
        if json_out:
            print(json.dumps({"model": model, **info}))
            return
        params = info["parameters"]
        arch = info["architecture"] or "unknown"
        if info["architectures"]:
            arch += f" ({', '.join(info['architectures'])})"
        rows = [
            ("architecture", arch),
            ("parameters", _count(params)),
            ("context length", info["context_length"] or "unknown"),
            ("quantization", info["quantization"]),
            ("format", info["format"]),
            ("chat template", "yes" if info["chat_template"] else "no"),
            ("license", info["license"] or "none found"),
            ("size on disk", human_size(info["size"])),
            ("path", info["path"]),
        ]
        for key, value in rows:
            print(f"  {key:<16}{value}")


def _count(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit} ({n:,})"
    return str(n)
