"""Large SentencePiece vocabularies of GGUF files, built once and kept as tokenizer.json files.

A SentencePiece vocabulary in a GGUF file carries no merges: gguf_vocab.spm_merges derives them by looking up every
cut of every piece, seconds for Gemma's 262k pieces on every load. The built tokenizer is kept under the cache dir
(`tokenizers/`), named by a digest of everything it is built from: the file's tokenizer metadata, the architecture,
the building code's own source and the tokenizers version, so a changed vocabulary or builder never reads a stale
one. A file that cannot be read or written is rebuilt or skipped, never an error.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..paths import cache_dir

MIN_PIECES = 65536  # smaller vocabularies build in well under a second: not kept


def digest(meta: dict[str, Any], builder: Path) -> str:
    """What the tokenizer is built from, hashed: every tokenizer.* key, the architecture, the builder's code (the
    source file `builder` and this one) and the tokenizers version."""
    import tokenizers

    h = hashlib.sha256()
    for part in (builder.read_bytes(), Path(__file__).read_bytes(), tokenizers.__version__.encode()):
        h.update(part)
    for key in sorted(k for k in meta if k.startswith("tokenizer.") or k == "general.architecture"):
        h.update(key.encode() + b"\0")
        value = meta[key]
        if isinstance(value, np.ndarray):
            h.update(str(value.dtype).encode() + value.tobytes())
        elif isinstance(value, (list, tuple)):
            h.update("\0".join(map(str, value)).encode("utf-8", "surrogatepass") + b"\1")
        else:
            h.update(repr(value).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def cached(meta: dict[str, Any], pieces: int, build: Callable[[], Any], builder: Path):
    """`build()`'s tokenizers.Tokenizer (the code of `build` in the source file `builder`), read from the cache when
    this vocabulary was built before."""
    from tokenizers import Tokenizer as HFTokenizer

    if pieces < MIN_PIECES:
        return build()
    path = cache_dir() / "tokenizers" / f"{digest(meta, builder)}.json"
    try:
        return HFTokenizer.from_file(str(path))
    except Exception:  # (absent, partial or from another tokenizers: built again below)
        pass
    backend = build()
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        backend.save(str(partial))
        os.replace(partial, path)  # (whole or not at all: another process may be reading it)
    except Exception:  # (a read-only or full disk: this load goes on without keeping it)
        partial.unlink(missing_ok=True)
    return backend
