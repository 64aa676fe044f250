"""Options shared by the commands that generate text (one definition for generate, run, ...)."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

Model = Annotated[Optional[str], typer.Option(
    "-m", "--model", metavar="MODEL",
    help="Model directory, .gguf file or Hugging Face repo id. Default: SmolLM2-135M-Instruct.")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens to generate (>= 1).")]
Temp = Annotated[float, typer.Option("--temp", help="Sampling temperature; 0 = greedy (deterministic).")]
TopK = Annotated[int, typer.Option("--top-k", help="Keep only the K most likely tokens; 0 = off.")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass in (0, 1]; 1 = off.")]
MinP = Annotated[float, typer.Option("--min-p", help="Drop tokens below MIN_P x the top probability; 0 = off.")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Random seed for reproducible sampling.")]
Stop = Annotated[Optional[List[str]], typer.Option(
    "--stop", help="Stop when this text appears (never printed). Repeatable.")]
NoChatTemplate = Annotated[bool, typer.Option(
    "--no-chat-template", help="Send the prompt as raw text instead of through the model's chat template.")]
System = Annotated[Optional[str], typer.Option("--system", help="System prompt (needs the chat template).")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="More detail on stderr; tracebacks on errors.")]


def sampling_params(max_tokens: int, temp: float, top_k: int, top_p: float, min_p: float, seed: Optional[int],
                    stop: Optional[List[str]]):
    from mlxcel_core.sampling import SamplingParams

    return SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                          max_tokens=max_tokens, stop=tuple(stop or ()))
KvBits = Annotated[Optional[int], typer.Option(
    "--kv-bits", help="Store the KV cache quantized to 8 or 4 bits (group size 64): less memory, slightly different numbers.")]
StorageBackend = Annotated[str, typer.Option(
    "--decode-storage-backend", help="KV storage: auto (dense at batch 1, paged when batching), dense or paged.")]
PrefillChunk = Annotated[int, typer.Option(
    "--prefill-chunk-size", help="Prompt tokens computed per forward pass (bounds memory on long prompts).")]


def engine_config(max_batch_size: int, kv_bits: Optional[int], storage: str, prefill_chunk_size: int):
    from mlxcel_core.engine import EngineConfig
    from mlxcel_core.errors import InputError

    if kv_bits not in (None, 4, 8):
        raise InputError(f"--kv-bits must be 4 or 8, got {kv_bits}")
    if storage not in ("auto", "dense", "paged"):
        raise InputError(f"--decode-storage-backend must be auto, dense or paged, got '{storage}'")
    if prefill_chunk_size < 1:
        raise InputError(f"--prefill-chunk-size must be >= 1, got {prefill_chunk_size}")
    return EngineConfig(max_batch_size=max_batch_size, kv_bits=kv_bits, storage=storage,
                        prefill_chunk_size=prefill_chunk_size)
