"""Tokenizers from GGUF metadata (`tokenizer.ggml.*`), built as `tokenizers` objects that encode like llama.cpp.

Two vocabulary models:
- `gpt2`: byte-level BPE with the file's merges, split first by the pre-tokenizer regexes llama.cpp's
  llama-vocab.cpp uses for `tokenizer.ggml.pre`;
- `llama`: SentencePiece BPE (Llama 2, Mistral, Gemma, Phi-3): pieces with scores and `<0xNN>` byte fallback,
  spaces written as U+2581, a space prefixed to each text run when `add_space_prefix`. The file lists no merges;
  they follow from the vocabulary: a piece merges from any two pieces that spell it, best-scored piece first
  (file order for Gemma, whose scores do not follow its merge order).
Control tokens are special added tokens, user-defined ones plain added tokens (matched whole, as llama.cpp does);
BOS/EOS are added per `add_bos_token`/`add_eos_token`; end-of-generation ids are the EOS/EOT/EOM ids plus the
control tokens llama.cpp treats as end of generation.
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptModelError, UnsupportedModelError
from ..tokenizer import Tokenizer
from .gguf_arch import as_list, as_scalar

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"

# llama-vocab.cpp's pre-tokenizer regexes (applied in order, each splitting the pieces of the one before).
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (  # Qwen2's with combining marks (\p{M}) kept in words
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek-V3's three splits: digits in threes, CJK runs, then words and punctuation.
_DEEPSEEK3 = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
# Kimi-K2's split as llama.cpp's own splitter computes it (unicode_regex_split_custom_kimi_k2): runs of its Han
# ranges, then words of non-Han letters (one run: no upper/lower case split, marks not letters) with an optional
# contraction, digits in threes, punctuation, whitespace as Llama 3's.
_HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002a6df\U0002a700-\U0002ebef\U0002f800-\U0002fa1f"
_KIMI_K2 = (
    f"[{_HAN}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{L}&&[^" + _HAN + r"]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pre-tokenizer name -> split regexes; "gpt2" is GPT-2's own byte-level split, "digits+gpt2" that after
# splitting every digit apart.
PRE_SPLITS: dict[str, list[str] | str] = {
    "default": "gpt2",
    "gpt-2": "gpt2",
    "olmo": "gpt2",
    "smollm": "digits+gpt2",
    "starcoder": "digits+gpt2",
    "refact": "digits+gpt2",
    "command-r": "digits+gpt2",
    "llama3": [_LLAMA3],
    "llama-v3": [_LLAMA3],
    "llama-bpe": [_LLAMA3],
    "falcon3": [_LLAMA3],
    "smaug-bpe": [_LLAMA3],
    "dbrx": [_LLAMA3],
    "qwen2": [_QWEN2],
    "deepseek-r1-qwen": [_QWEN2],
    "stablelm2": [_QWEN2],
    "qwen35": [_QWEN35],
    "lfm2": [_LLAMA3],
    "deepseek-v3": _DEEPSEEK3,
    "kimi-k2": [_KIMI_K2],
    "glm4": [_LLAMA3],  # llama.cpp's CHATGLM4: Llama 3's regex
    "gpt-4o": [_GPT4O],
    "llama4": [_GPT4O],
    "minimax-m2": [_GPT4O],
    "tekken": [_TEKKEN],
}
# Control tokens llama.cpp ends generation at, besides the file's EOS/EOT/EOM ids.
EOG_TEXTS = {
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
    "<｜end▁of▁sentence｜>",
    "<eos>",  # gemma4
    "<turn|>",  # gemma4
}
# Architectures whose SentencePiece merge order is the file's token order, not the scores.
_POSITION_ORDERED = {"gemma", "gemma2", "gemma3"}


def _meta_id(meta: dict[str, Any], key: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    return None if value is None else int(as_scalar(value))


def _meta_flag(meta: dict[str, Any], key: str, default: bool) -> bool:
    value = meta.get(f"tokenizer.ggml.{key}")
    return default if value is None else bool(as_scalar(value))


def _bpe_pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    split = PRE_SPLITS.get(pre)
    if split is None:  # another split regex would tokenize differently, silently
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer '{pre}' is not supported (supported: {', '.join(sorted(PRE_SPLITS))})"
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "gpt2":
        return byte_level
    if split == "digits+gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in split]
    return pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _gpt2_backend(meta: dict[str, Any], tokens: list[str]):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    merges = [tuple(m.split(" ", 1)) for m in as_list(meta.get("tokenizer.ggml.merges", []))]
    vocab = _vocab(tokens)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _bpe_pre_tokenizer(str(as_scalar(meta.get("tokenizer.ggml.pre", "default"))))
    backend.decoder = decoders.ByteLevel()
    return backend


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a repeated piece keeps its first id, as a lookup by text finds it first
    return vocab


def spm_merges(tokens: list[str], priority: list[float], mergeable: list[bool]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: (left, right) for every two mergeable pieces that spell
    a third, best `priority` of the spelled piece first (ties: lower id), then by the parts' ids."""
    ids = {tok: i for i, tok in reversed(list(enumerate(tokens))) if mergeable[i]}
    merges = []
    for i in sorted(ids.values(), key=lambda i: (-priority[i], i)):
        piece = tokens[i]
        pairs = []
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                pairs.append((ids[left], ids[right], left, right))
        merges.extend((left, right) for _, _, left, right in sorted(pairs))
    return merges


def _spm_backend(meta: dict[str, Any], tokens: list[str], types: list[int], arch: str):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    # Gemma stores runs of spaces as real spaces; the text side writes them as U+2581.
    tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    if arch in _POSITION_ORDERED:
        priority = [-float(i) for i in range(len(tokens))]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise CorruptModelError("GGUF SentencePiece vocabulary has no tokenizer.ggml.scores")
        priority = [float(s) for s in as_list(scores)]
    mergeable = [t in (NORMAL, 0) for t in types]
    unk_id = _meta_id(meta, "unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    model = models.BPE(
        vocab=_vocab(tokens),
        merges=spm_merges(tokens, priority, mergeable),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = HFTokenizer(model)
    prefix = _meta_flag(meta, "add_space_prefix", True)
    escape = normalizers.Replace(" ", SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if prefix else escape
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return backend, tokens


def _post_processor(backend, tokens: list[str], bos: int | None, eos: int | None, add_bos: bool, add_eos: bool):
    from tokenizers import processors

    single, special = ["$A"], []
    if add_bos and bos is not None:
        single.insert(0, tokens[bos])
        special.append((tokens[bos], bos))
    if add_eos and eos is not None:
        single.append(tokens[eos])
        special.append((tokens[eos], eos))
    if special:
        pair = [*single, *[s if s != "$A" else "$B" for s in single]]
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(pair), special_tokens=list(dict.fromkeys(special))
        )


def _gemma4_backend(meta: dict[str, Any], tokens: list[str]):
    """llama.cpp's `gemma4` vocabulary (LLAMA_VOCAB_PRE_TYPE_GEMMA4): BPE with the file's merges over raw UTF-8
    characters, spaces written as U+2581 (no prefix), the text split into runs of newlines and runs of anything
    else, a newline run that is a token kept whole, <0xNN> byte fallback. The newline tokens are added tokens, so a
    run longer than any of them splits longest token first where llama.cpp merges its newlines by rank."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    merges = [tuple(m.split(" ", 1)) for m in as_list(meta.get("tokenizer.ggml.merges", []))]
    backend = HFTokenizer(models.BPE(vocab=_vocab(tokens), merges=merges, fuse_unk=False, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    newlines = sorted({t for t in tokens if t and not t.strip("\n")}, key=len, reverse=True)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in newlines])
    return backend


def gguf_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    from tokenizers import AddedToken

    kind = as_scalar(meta.get("tokenizer.ggml.model"))
    if kind not in ("gpt2", "llama", "gemma4"):
        raise UnsupportedModelError(
            f"GGUF tokenizer model '{kind}' is not supported (supported: gpt2 byte-level BPE, llama SentencePiece, "
            "gemma4 SentencePiece-style BPE)"
        )
    tokens = [str(t) for t in as_list(meta.get("tokenizer.ggml.tokens", []))]
    if not tokens:
        raise CorruptModelError("GGUF file has no tokenizer.ggml.tokens")
    raw_types = meta.get("tokenizer.ggml.token_type")
    types = [int(t) for t in as_list(raw_types)] if raw_types is not None else [NORMAL] * len(tokens)
    arch = str(as_scalar(meta.get("general.architecture", "")))
    if kind == "gpt2":
        backend = _gpt2_backend(meta, tokens)
    elif kind == "gemma4":
        backend = _gemma4_backend(meta, tokens)
    else:
        backend, tokens = _spm_backend(meta, tokens, types, arch)
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == CONTROL]
    )
    user = [i for i, t in enumerate(types) if t == USER_DEFINED and set(tokens[i]) != {SPACE}]
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])

    bos, eos = _meta_id(meta, "bos_token_id"), _meta_id(meta, "eos_token_id")
    add_bos = _meta_flag(meta, "add_bos_token", kind == "llama")  # llama.cpp's default for SentencePiece
    _post_processor(backend, tokens, bos, eos, add_bos, _meta_flag(meta, "add_eos_token", False))
    eog = {i for i in (eos, _meta_id(meta, "eot_token_id"), _meta_id(meta, "eom_token_id")) if i is not None}
    eog |= {i for i, t in enumerate(types) if t == CONTROL and tokens[i] in EOG_TEXTS}
    template = meta.get("tokenizer.chat_template")
    return Tokenizer(
        backend=backend,
        eos_token_ids=eog,
        bos_token=tokens[bos] if bos is not None else None,
        eos_token=tokens[eos] if eos is not None else None,
        chat_template=None if template is None else str(as_scalar(template)),
        add_bos_token=False,  # the post-processor adds BOS where the file asks for it
    )
