"""Tokenizer: a `tokenizers.Tokenizer` plus what generation needs (EOS ids, BOS, chat template)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .chat_template import render_chat
from .chat_tokens import GIL_FREE_CHARS, encode_chat
from .errors import CorruptModelError


@dataclass
class Tokenizer:
    backend: Any  # tokenizers.Tokenizer
    eos_token_ids: set[int] = field(default_factory=set)
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None
    add_bos_token: bool = False  # only when the backend's post-processor does not already add it
    # Chat prompts: special-token text inside message content becomes control tokens (the old behaviour) instead of
    # text (mlxcel_core/chat_tokens.py); `--parse-special-in-content` sets it.
    parse_special_in_content: bool = False
    content_tokenizer: Any = field(default=None, init=False, repr=False, compare=False)  # chat_tokens.py's, lazily

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > GIL_FREE_CHARS:  # the same ids; the batch call lets other threads run meanwhile
            ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token is not None:
            bos = self.backend.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > GIL_FREE_CHARS:
            return self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        parse_special_in_content: bool | None = None,
        **variables,
    ) -> list[int]:
        """`variables`: template variables such as `tools` (a list of {"type": "function", "function": {...}}).
        Message content is tokenized as text, so control tokens come only from the template itself, unless
        `parse_special_in_content` (default: the tokenizer's attribute) is set (mlxcel_core/chat_tokens.py)."""

        def render(messages: list[dict]) -> str:
            return render_chat(
                self.chat_template,
                messages,
                add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **variables,
            )

        if parse_special_in_content is None:
            parse_special_in_content = self.parse_special_in_content
        # The template writes BOS itself when the model wants one: no special tokens are added.
        return encode_chat(self, render, messages, parse_special_in_content)


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _as_id_set(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def load_hf_tokenizer(model_dir: Path, config: dict[str, Any]) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise CorruptModelError(f"{model_dir} has no tokenizer.json (a fast tokenizer file is required)")
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as exc:
        raise CorruptModelError(f"cannot read {path}: {exc}") from exc
    tok_cfg = _read_json(model_dir / "tokenizer_config.json")
    gen_cfg = _read_json(model_dir / "generation_config.json")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = model_dir / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    eos_token = _token_content(tok_cfg.get("eos_token"))
    eos_ids = _as_id_set(config.get("eos_token_id")) | _as_id_set(gen_cfg.get("eos_token_id"))
    if eos_token is not None and backend.token_to_id(eos_token) is not None:
        eos_ids.add(backend.token_to_id(eos_token))
    return Tokenizer(
        backend=backend,
        eos_token_ids=eos_ids,
        bos_token=_token_content(tok_cfg.get("bos_token")),
        eos_token=eos_token,
        chat_template=template,
        add_bos_token=bool(tok_cfg.get("add_bos_token", False)),
    )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CorruptModelError(f"{path} is not valid JSON: {exc}") from exc
