"""Parity harness shared by every model family's test: transformers (fp32, CPU) vs our loader + engine,
and the checks every family's 4-bit copy goes through."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from tiny_models import save_tiny_checkpoint  # noqa: F401  (family tests import it from here)


def mlx_class_name(module) -> str:
    """The name of a module's class as the model built it, under any subclass a backend swapped in
    (backends/cpu_float32.py, backends/cuda/kernels/fast_linear.py)."""
    return next(c for c in type(module).__mro__ if not c.__module__.startswith("mlxcel_core.backends")).__name__


def prompt_ids(length: int, vocab: int = 320, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=length).tolist()


def load_quiet(path: Path):
    """load_model as the CLI calls it, without the progress log."""
    from mlxcel_core.loading import load_model

    return load_model(str(path), log=lambda m: None)


def load_unfused(path: Path):
    """load_quiet with the blocks' own classes: on CUDA the backend's prepare step mixes fused projections into
    attention and MLP blocks (backends/cuda/kernels/fused_projections.py); tests of a family's structure undo it."""
    from mlxcel_core.backends.cuda.kernels.fused_projections import unfuse_projections

    loaded = load_quiet(path)
    unfuse_projections(loaded.model)
    return loaded


def logits(model, prompt: list[int] | None = None) -> np.ndarray:
    """Our fp32 logits [L, vocab] for `prompt` (default: prompt_ids(64)), one forward without a cache."""
    prompt = prompt_ids(64) if prompt is None else prompt
    return np.array(model(mx.array([prompt])).astype(mx.float32))[0]


def checkpoint_logits(path: Path, prompt: list[int] | None = None) -> np.ndarray:
    return logits(load_quiet(path).model, prompt)


def reference_model(path: Path):
    """transformers' model of the checkpoint at `path`, as the parity tests compare against: fp32, eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    # Eager attention, asked for here and not only in config.json: it is the reference definition (Gemma 2's
    # attention soft-capping exists only there), whichever transformers the machine has and whatever it defaults to.
    # MXFP4 blocks dequantized, asked for too: where CUDA, Triton and `kernels` are all present transformers would
    # fetch Hub kernels for them instead.
    extra = {}
    config = json.loads((path / "config.json").read_text())
    if config.get("quantization_config", {}).get("quant_method") == "mxfp4":
        from transformers import Mxfp4Config

        extra["quantization_config"] = Mxfp4Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **extra).eval()


def reference(path: Path, prompt: list[int], steps: int):
    """transformers' logits for every prompt position and its greedy continuation (EOS ignored)."""
    return model_reference(reference_model(path), prompt, steps)


def model_reference(model, prompt: list[int], steps: int):
    """`reference` for a transformers model already loaded."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref_logits = model(ids).logits[0].float().numpy()
        out = model.generate(
            ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return ref_logits, out[0, len(prompt) :].tolist()


def loaded_greedy(loaded, prompt: list[int], steps: int):
    """Our logits (one forward, no cache) and `steps` greedy tokens through stream_generate, EOS ignored (random
    weights: every step compared), for a model already loaded (a GGUF file's, say)."""
    from mlxcel_core.api import stream_generate
    from mlxcel_core.sampling import SamplingParams

    forward = np.array(loaded.model(mx.array([prompt])).astype(mx.float32))[0]
    loaded.tokenizer.eos_token_ids = set()
    chunks = stream_generate(loaded, prompt, SamplingParams(max_tokens=steps))
    return forward, [c.token for c in chunks if c.token is not None]


def ours(path: Path, prompt: list[int], steps: int):
    """Our logits (one forward, no cache) and greedy tokens through the engine, loaded like the CLI does; the
    last_only forward (with a cache) must give the last position's logits.

    The tokens are generated three times, with decode steps built op by op, compiled (engine/compiled_decode.py,
    the default on a GPU), and compiled with the fused q/k/v and gate/up projections
    (backends/cuda/kernels/fused_projections.py, what the CUDA backend prepares), and must be the same."""
    from mlxcel_core.api import stream_generate
    from mlxcel_core.backends.cuda.kernels.fused_projections import fuse_projections, unfuse_projections
    from mlxcel_core.cache import make_cache
    from mlxcel_core.engine import EngineConfig
    from mlxcel_core.sampling import SamplingParams

    loaded = load_quiet(path)
    forward = logits(loaded.model, prompt)
    # A prompt's last chunk as the engine runs it: the last layer past its attention on the last position only.
    last = loaded.model(mx.array([prompt]), make_cache(len(loaded.model.layers)), last_only=True)
    np.testing.assert_allclose(
        np.array(last[0, -1].astype(mx.float32)),
        forward[-1],
        atol=1e-4,
        rtol=0,
        err_msg="last_only logits differ from the full forward's last position",
    )
    loaded.tokenizer.eos_token_ids = set()  # random weights: compare all `steps` tokens

    def generate(compiled: bool) -> list[int]:
        return [
            c.token
            for c in stream_generate(
                loaded,
                prompt,
                SamplingParams(max_tokens=steps),
                EngineConfig(max_batch_size=1, compile_decode=compiled),
            )
            if c.token is not None
        ]

    eager, compiled = generate(False), generate(True)
    assert eager == compiled, "compiled decode steps gave other tokens than op-by-op ones"
    fuse_projections(loaded.model)
    try:
        assert generate(True) == eager, "fused projections gave other tokens than separate ones"
    finally:
        unfuse_projections(loaded.model)
    return forward, eager


def assert_parity(path: Path, prompt_len: int = 64, steps: int = 40, atol: float = 1e-4) -> None:
    prompt = prompt_ids(prompt_len)
    ref_logits, ref_tokens = reference(path, prompt, steps)
    logits, tokens = ours(path, prompt, steps)
    diff = float(np.abs(logits - ref_logits).max())
    assert diff <= atol, f"max-abs logit difference {diff:.3g} > {atol}{on_the_cpu_stream(path, prompt, logits)}"
    assert tokens == ref_tokens


def on_the_cpu_stream(path: Path, prompt: list[int], device_logits: np.ndarray) -> str:
    """On a GPU, where a parity failure comes from: our same forward on the CPU stream, against the reference's
    difference (the reference runs on the CPU, in whatever transformers that machine has)."""
    if mx.default_device() == mx.cpu:
        return ""
    model = load_quiet(path).model
    with mx.stream(mx.cpu):
        cpu = logits(model, prompt)
    return f"; ours on the CPU stream differs from ours on the GPU by {float(np.abs(cpu - device_logits).max()):.3g}"


def quantize_4bit(src: Path, dst: Path) -> Path:
    """The project's quantize_checkpoint at 4 bits, group 64 (MoE expert banks included)."""
    from mlxcel_core.quantize import quantize_checkpoint

    return quantize_checkpoint(src, dst, bits=4, group_size=64)


def dequantized_logits(src: Path, quantized_model) -> np.ndarray:
    """The fp32 architecture run on the dequantized 4-bit weights: what the quantized kernels must compute."""
    from mlx.utils import tree_flatten

    flat = dict(tree_flatten(quantized_model.parameters()))
    weights = {}
    for name, value in flat.items():
        base = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")):
            continue
        if name.endswith(".weight") and f"{base}.scales" in flat:
            layer = dict(quantized_model.named_modules())[base]
            value = mx.dequantize(
                value, flat[f"{base}.scales"], flat[f"{base}.biases"], group_size=layer.group_size, bits=layer.bits
            )
        weights[name] = value
    model = load_quiet(src).model
    model.load_weights(list(weights.items()), strict=True)
    return logits(model)


def assert_4bit_close(src: Path, quantized_model, max_abs: float, rel_rms: float) -> None:
    """The quantized kernels compute the dequantized fp32 architecture (to 1e-4), and the 4-bit logits stay
    within `max_abs` and `rel_rms` (RMS of the error over RMS of the logits) of fp32's."""
    ours, fp32 = logits(quantized_model), checkpoint_logits(src)
    np.testing.assert_allclose(ours, dequantized_logits(src, quantized_model), atol=1e-4, rtol=0)
    assert np.abs(ours - fp32).max() <= max_abs
    assert np.sqrt(np.mean((ours - fp32) ** 2) / np.mean(fp32**2)) <= rel_rms


def assert_4bit_near_fp32(src: Path, dst: Path, max_abs: float, mean_abs: float, min_corr: float) -> None:
    """`dst`, a 4-bit copy of `src`: attention and embedding quantized; logits near fp32's (max, mean, correlation)."""
    import mlx.nn as nn

    model = load_quiet(dst).model
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    fp32, q4 = checkpoint_logits(src), logits(model)
    diff = np.abs(q4 - fp32)
    assert diff.max() <= max_abs and diff.mean() <= mean_abs, (diff.max(), diff.mean())
    assert np.corrcoef(q4.ravel(), fp32.ravel())[0, 1] >= min_corr


def randomize_norms_and_biases(path: Path, seed: int = 0, mtp_layer: int | None = None) -> Path:
    """transformers initializes norms to ones and biases (MoE correction biases too) to zeros: make them random, so
    that parity checks where each is applied. `mtp_layer`: add a multi-token-prediction layer's tensors as released
    DeepSeek-V3 / GLM-4.5 checkpoints carry them (a copy of the last decoder layer as layer `mtp_layer`, plus its
    eh_proj, enorm, hnorm, shared_head), which loading must drop."""
    from safetensors.numpy import load_file, save_file

    weights = load_file(path / "model.safetensors")
    rng = np.random.default_rng(seed)
    for name, w in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = rng.uniform(0.5, 1.5, w.shape).astype(w.dtype)
        elif name.endswith((".bias", "e_score_correction_bias")):
            weights[name] = rng.uniform(-0.3, 0.3, w.shape).astype(w.dtype)
    if mtp_layer is not None:
        last = f"model.layers.{mtp_layer - 1}."
        for name in [n for n in weights if n.startswith(last)]:
            weights[name.replace(last, f"model.layers.{mtp_layer}.")] = weights[name].copy()
        hidden = weights["model.embed_tokens.weight"].shape[1]
        weights[f"model.layers.{mtp_layer}.eh_proj.weight"] = rng.normal(0, 0.1, (hidden, 2 * hidden)).astype("f4")
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            weights[f"model.layers.{mtp_layer}.{norm}.weight"] = np.ones(hidden, "f4")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


# transformers' image-text checkpoints (language_model.model.*) as transformers 5 saves them (model.language_model.*)
WRAPPER_RENAMES = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.", "model.vision_tower."),
    ("vision_model.", "model.vision_model."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)


def rename_weights(path: Path, renames=WRAPPER_RENAMES) -> Path:
    """Rewrite model.safetensors in place with each name's first matching prefix replaced."""
    renamed = {}
    for name, value in mx.load(str(path / "model.safetensors")).items():
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        renamed[name] = value
    mx.save_safetensors(str(path / "model.safetensors"), renamed)
    return path


def mlx_lm_model(path, **kwargs):
    """mlx_lm.load's model of `path` (skip without mlx-lm). On CUDA, its layers whose input is one quantization
    group wide are routed around MLX's CUDA quantized_matmul fault as mlxcel's backend routes its own
    (backends/cuda/kernels/mlx_workarounds.py): the comparison is of the two models, not of that MLX fault."""
    import pytest

    mlx_lm = pytest.importorskip("mlx_lm")
    model, _ = mlx_lm.load(str(path), **kwargs)
    from mlxcel_core.backends.cuda.kernels import qmv
    from mlxcel_core.backends.cuda.kernels.mlx_workarounds import route_around_qmm_fault

    if qmv.cuda_kernel_available():
        route_around_qmm_fault(model)
    return model


def assert_generate_cli_gives_greedy(path, hf_model, steps: int, prompt: str = "The capital of France is") -> None:
    """`mlxcel generate -m PATH --json` (in this process, on a raw prompt) gives `hf_model`'s greedy tokens for
    `steps` steps, up to and including the first end-of-generation token."""
    import json

    import torch
    from typer.testing import CliRunner

    from mlxcel_cli.main import app
    from mlxcel_core.loading import load_model

    tokenizer = load_model(str(path), log=lambda m: None).tokenizer
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0
        )
    expected = out[0, len(ids) :].tolist()
    eos = tokenizer.eos_token_ids
    expected = expected[: next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))]
    result = CliRunner().invoke(
        app, ["generate", "-m", str(path), "-p", prompt, "-n", str(steps), "--no-chat-template", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["token_ids"] == expected
