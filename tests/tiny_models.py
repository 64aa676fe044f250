"""Tiny test models built in-process (no downloads): a byte-level BPE tokenizer and a random Llama.

Imported by tests as `from tiny_models import ...` (a plain module: `conftest` names are ambiguous
once several conftest.py files exist).
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TRAINING_TEXT = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello world! héllo wörld 日本語 🙂 numbers 0123456789",
    "A quick brown fox jumps over the lazy dog while the cat sleeps.",
]


def build_tokenizer(vocab_size: int = 320):
    """A small byte-level BPE tokenizer with ChatML special tokens, trained in-process (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT * 4, trainer)
    return tok


def save_tiny_checkpoint(path: Path, config_cls, model_cls, **config) -> Path:
    """Random fp32 checkpoint saved by transformers, plus the tiny test tokenizer (vocab 320)."""
    import torch

    tok = build_tokenizer()
    config.setdefault("vocab_size", tok.get_vocab_size())
    torch.manual_seed(0)
    model = model_cls(config_cls(**config)).eval()
    model.save_pretrained(path, safe_serialization=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML})
    )
    return path


def save_tiny_llama(path: Path, **overrides) -> Path:
    """Save a random tiny Llama with transformers (fp32) plus a tokenizer; return the directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    params = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=None,
    )
    return save_tiny_checkpoint(path, LlamaConfig, LlamaForCausalLM, **{**params, **overrides})


def save_tiny_mlx_llama(path: Path) -> Path:
    """A random tiny Llama (mlxcel's "tiny" shape, float32) saved by MLX alone, plus the tiny tokenizer.

    For tests that also run where MLX computes on CUDA: no torch or transformers in the process. (The H200 runs that
    never got past their first model-level test were hung by MLX's CUDA quantized_matmul at K == group size, which
    the "tiny" shape now avoids; see shapes.py.)"""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxcel_core.loading.shapes import build_random_model

    model, config = build_random_model("tiny", dtype="float32", seed=0)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    tok = build_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML})
    )
    return path


class FakeGroup:
    """What sharding reads of an mx.distributed group (rank and size), for in-process tests where no collective
    runs: rank `rank` of `size` shards a model exactly as that rank would."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size
