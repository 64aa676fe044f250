"""DeepSeek-V3 / Kimi-K2 / Moonlight (deepseek_v3): parity with transformers, from transformers 5's config and from the
Hub's older style, on two variants: V3-like (q through q_a_proj / q_a_layernorm / q_b_proj, YaRN with mscale and
mscale_all_dim, interleaved RoPE, 2 expert groups of which the router keeps 1, renormalized weights times 2.5, MTP
layer tensors in the checkpoint) and Moonlight-like (q_proj, q_lora_rank None; default RoPE, half-split; attention
biases; one group; 2 shared experts), random norms and biases. The caches hold the latent only (kv_lora_rank +
qk_rope_head_dim a token and layer, no values), the CUDA kernel is not taken for such layers, FP8 block-quantized
checkpoints dequantize as transformers does; refusals, engine paths, quantized copies, CLI and server."""

from __future__ import annotations

import json
import math
import shutil

import family_checks
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from parity import (
    assert_parity,
    checkpoint_logits,
    load_quiet,
    load_unfused,
    logits,
    prompt_ids,
    randomize_norms_and_biases,
    save_tiny_checkpoint,
)
from tiny_configs import DEEPSEEK_V3
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from mlxcel_core import backends
from mlxcel_core.backends.base import Backend
from mlxcel_core.cache import KVCache
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.engine.budget import kv_bytes_per_token
from mlxcel_core.errors import UnsupportedModelError
from mlxcel_core.kv.paged_attention import RUNNER_OPS, paged_decode_attention
from mlxcel_core.models import deepseek_v3
from mlxcel_core.models.grouped_moe import GroupedMoeBlock, GroupedTopKRouter
from mlxcel_core.models.transformer import GatedMLP
from mlxcel_core.sampling import SamplingParams

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 1.0,
    "mscale_all_dim": 0.7,  # != mscale: YaRN's attention factor is not 1, and the softmax scale takes mscale ** 2
    "beta_fast": 32,
    "beta_slow": 1,
}
VARIANTS = {
    "v3": dict(
        q_lora_rank=32,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        n_shared_experts=1,
        max_position_embeddings=128,  # factor x original: YaRN's own ratio
        rope_parameters=YARN,
    ),
    "moonlight": dict(
        q_lora_rank=None,
        num_experts_per_tok=3,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.446,
        norm_topk_prob=True,
        n_shared_experts=2,
        attention_bias=True,
        rope_interleave=False,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    ),
}
LATENT = DEEPSEEK_V3["kv_lora_rank"] + DEEPSEEK_V3["qk_rope_head_dim"]
MTP_LAYER = DEEPSEEK_V3["num_hidden_layers"]


def randomize(path, seed=0, mtp=False):
    """Random norms, biases and correction biases; `mtp`: with a multi-token-prediction layer as layer MTP_LAYER."""
    return randomize_norms_and_biases(path, seed, MTP_LAYER if mtp else None)


def save(path, variant, **overrides):
    path = save_tiny_checkpoint(
        path, DeepseekV3Config, DeepseekV3ForCausalLM, **{**DEEPSEEK_V3, **VARIANTS[variant], **overrides}
    )
    return randomize(path, mtp=variant == "v3")


def rewrite_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


def rewrite_config_older_style(path):
    """config.json as the Hub's DeepSeek-V3 / Moonlight checkpoints (transformers 4) write it: rope_theta and
    rope_scaling (`type`, null for the default RoPE), no head_dim / qk_head_dim, the routing's older keys, and no
    rope_interleave where it is the default (true)."""
    config = json.loads((path / "config.json").read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    config["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    for key in ("head_dim", "qk_head_dim"):
        config.pop(key)
    if config["rope_interleave"]:
        config.pop("rope_interleave")
    config.update(topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, ep_size=1)
    config["torch_dtype"] = config.pop("dtype", "float32")
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {variant: save(tmp_path_factory.mktemp(variant), variant) for variant in VARIANTS}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny_ds(request, checkpoints):
    return request.param, checkpoints[request.param]


def test_parity_with_transformers(tiny_ds):
    assert_parity(tiny_ds[1])


def test_older_config_style_parity(tiny_ds, tmp_path):
    """The Hub's configs: same logits as transformers 5's config, and parity."""
    path = rewrite_config_older_style(shutil.copytree(tiny_ds[1], tmp_path / "older"))
    np.testing.assert_array_equal(checkpoint_logits(path), checkpoint_logits(tiny_ds[1]))
    assert_parity(path)


def test_architecture_follows_config(tiny_ds):
    variant, path = tiny_ds
    spec = VARIANTS[variant]
    model = load_unfused(path).model
    attn = model.layers[0].self_attn
    assert isinstance(attn, deepseek_v3.LatentAttention) and len(model.layers) == 3  # (the MTP layer: not built)
    if spec["q_lora_rank"] is None:
        assert attn.q_proj.weight.shape == (4 * 48, 64) and "q_a_proj" not in attn
    else:
        assert attn.q_a_proj.weight.shape == (32, 64) and attn.q_b_proj.weight.shape == (4 * 48, 32)
        assert "q_proj" not in attn
    assert attn.kv_a_proj_with_mqa.weight.shape == (LATENT, 64)
    assert attn.embed_q.weight.shape == (4, 32, 32) and attn.unembed_out.weight.shape == (4, 32, 32)
    assert ("bias" in attn.o_proj) == spec.get("attention_bias", False)
    assert attn.rope.dims == 16 and attn.rope.traditional == spec.get("rope_interleave", True)
    if variant == "v3":  # 48 ** -0.5 x (0.1 x 0.7 x ln 4 + 1) ** 2; YaRN's cos/sin factor (1.0 and 0.7 mscales)
        mscale = 0.1 * 0.7 * math.log(4.0) + 1.0
        assert attn.scale == pytest.approx(48**-0.5 * mscale**2)
        assert attn.rope.mscale == pytest.approx((0.1 * math.log(4.0) + 1.0) / mscale)
    else:
        assert attn.scale == pytest.approx(48**-0.5)
    assert [type(layer.mlp) for layer in model.layers] == [GatedMLP, GroupedMoeBlock, GroupedMoeBlock]
    block = model.layers[-1].mlp
    assert block.shared_experts.gate_proj.weight.shape == (64 * spec["n_shared_experts"], 64)
    assert (block.gate.n_group, block.gate.topk_group, block.gate.top_k) == (
        spec["n_group"],
        spec["topk_group"],
        spec["num_experts_per_tok"],
    )
    assert block.gate.routed_scaling_factor == spec["routed_scaling_factor"]


def test_kv_b_proj_is_split_per_head(tiny_ds):
    """embed_q is W_UK per head transposed, unembed_out W_UV: the checkpoint's kv_b_proj rows, head by head."""
    path = tiny_ds[1]
    kv_b = np.array(mx.load(str(path / "model.safetensors"))["model.layers.1.self_attn.kv_b_proj.weight"])
    attn = load_quiet(path).model.layers[1].self_attn
    per_head = kv_b.reshape(4, 32 + 32, 32)
    np.testing.assert_array_equal(np.array(attn.embed_q.weight), per_head[:, :32].transpose(0, 2, 1))
    np.testing.assert_array_equal(np.array(attn.unembed_out.weight), per_head[:, 32:])


@pytest.mark.parametrize(
    "variant, change",
    [
        ("v3", dict(rope_interleave=False)),  # interleaved pairs vs halves
        ("moonlight", dict(rope_interleave=True)),
        ("v3", dict(rope_parameters={**YARN, "mscale_all_dim": 1.0})),  # the softmax scale's mscale ** 2
    ],
)
def test_config_features_reach_the_logits(checkpoints, tmp_path, variant, change):
    """What parity checks is not a no-op on these checkpoints: changing it changes the logits."""
    path = rewrite_config(shutil.copytree(checkpoints[variant], tmp_path / "changed"), **change)
    assert np.abs(checkpoint_logits(path) - checkpoint_logits(checkpoints[variant])).max() > 1e-3


def test_correction_bias_changes_the_choice(tiny_ds, monkeypatch):
    """The random correction bias changes the experts of many of the prompt's tokens (so parity covers it)."""
    model = load_quiet(tiny_ds[1]).model
    seen = []
    call = GroupedTopKRouter.__call__
    monkeypatch.setattr(GroupedTopKRouter, "__call__", lambda self, x: seen.append(x) or call(self, x))
    logits(model)
    monkeypatch.undo()
    router = model.layers[1].mlp.gate
    biased = np.sort(np.array(router(seen[0])[0]), axis=-1)
    router.e_score_correction_bias = mx.zeros_like(router.e_score_correction_bias)
    unbiased = np.sort(np.array(router(seen[0])[0]), axis=-1)
    assert (biased != unbiased).any(axis=-1).mean() > 0.2


def run_engine(loaded, prompts, steps=8, **config):
    loaded.tokenizer.eos_token_ids = set()
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=len(prompts), **config))
    ids = [engine.open(p, SamplingParams(max_tokens=steps)) for p in prompts]
    while engine.has_work():
        assert all(out.error is None for out in engine.step())
    return engine, [engine.sequence(i).output_ids for i in ids]


def test_caches_hold_the_latent_only(tiny_ds):
    """The dense cache and the paged pools of every layer hold kv_lora_rank + qk_rope_head_dim numbers a token and
    no values (the dense cache's value buffers have width 0, the paged storage has a key pool only); the KV budget
    counts that. A prompt of 20 in blocks of 8 is prefilled in chunks of 8, so chunks read the pools back."""
    loaded = load_quiet(tiny_ds[1])
    model = loaded.model
    caches = [KVCache() for _ in model.layers]
    model(mx.array([prompt_ids(10)]), caches)
    for cache in caches:
        assert cache.keys.shape[1] == 1 and cache.keys.shape[-1] == LATENT
        assert cache.values.shape[-1] == 0 and cache.values.nbytes == 0
    engine, _ = run_engine(loaded, [prompt_ids(20)], storage="paged", block_size=8, prefill_chunk_size=8)
    pools = engine.storage.pools
    assert len(pools) == 3
    for layer_pools in pools:
        assert [pool.shape[1:] for pool in layer_pools] == [(8, 1, LATENT)]
    assert kv_bytes_per_token(model) == 3 * LATENT * 2  # bf16: 2 bytes a number, one key a layer


def test_latent_kv_quantized(tmp_path):
    """kv_bits 8 on a latent of 64 (32 + 32 rope): dense and paged storage store it quantized and agree."""
    path = save(tmp_path / "ck", "moonlight", qk_rope_head_dim=32)
    loaded = load_quiet(path)
    prompts = [prompt_ids(n, seed=n) for n in (11, 5)]
    _, dense = run_engine(loaded, prompts, storage="dense", kv_bits=8)
    engine, paged = run_engine(loaded, prompts, storage="paged", block_size=8, kv_bits=8)
    assert dense == paged
    keys, scales, biases = engine.storage.pools[0]  # a key pool only, quantized
    assert keys.dtype == mx.uint32 and keys.shape[-1] == 64 * 8 // 32 and scales.shape[-1] == 1


def test_values_in_keys_cache_matches_explicit_values():
    """KVCache.attend(values_in_keys=n) equals attention over explicit values keys[..., :n] (quantized: over the
    keys as stored), for a prompt and then a decode step, and stores no values."""
    from mlxcel_core.models.base import scaled_dot_product_attention

    keys = mx.random.normal((2, 1, 8, 64), key=mx.random.key(0))
    queries = mx.random.normal((2, 4, 8, 64), key=mx.random.key(1))
    for bits in (None, 8):
        cache = KVCache(kv_bits=bits)
        stored = keys if bits is None else mx.dequantize(*mx.quantize(keys, group_size=64, bits=8), 64, 8)
        got = [
            cache.attend(queries[:, :, :7], keys[:, :, :7], None, 0.1, values_in_keys=48),
            cache.attend(queries[:, :, 7:], keys[:, :, 7:], None, 0.1, values_in_keys=48),
        ]
        want = scaled_dot_product_attention(queries, stored, stored[..., :48], 0.1, "causal")
        np.testing.assert_allclose(np.array(mx.concatenate(got, axis=2)), np.array(want), atol=1e-5)
        assert cache.values.shape[-1] == 0 and all(a.shape[-1] == 0 for a in (cache._scales or [])[2:])


@pytest.mark.parametrize("splits", [1, 2])
def test_paged_decode_attention_values_in_keys(splits):
    """The portable paged decode reads values as the keys' prefix: each row's softmax over its blocks' keys,
    weighting their first 32 dims (the whole key axis at once, and in splits)."""
    k_pool = mx.random.normal((6, 4, 1, 48), key=mx.random.key(0))
    q = mx.random.normal((2, 4, 1, 48), key=mx.random.key(1))
    tables, lens = [[0, 2, 4], [5, 1, 3]], [9, 12]
    got = paged_decode_attention(
        q, k_pool, k_pool[..., :0], mx.array(tables), mx.array(lens), num_splits=splits, scale=0.2, values_in_keys=32
    )
    assert got.shape == (2, 4, 1, 32)
    for row, (table, length) in enumerate(zip(tables, lens)):
        keys = np.array(k_pool)[table].reshape(-1, 48)[:length]  # [T, 48]: the row's tokens
        scores = 0.2 * np.array(q)[row, :, 0] @ keys.T  # [4, T]
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        want = (probs / probs.sum(-1, keepdims=True)) @ keys[:, :32]
        np.testing.assert_allclose(np.array(got)[row, :, 0], want, atol=1e-5)


def test_backend_kernel_not_taken_for_latent_layers(tiny_ds, monkeypatch):
    """A backend with a paged decode kernel (separate K and V pools of one head size) keeps it for other calls;
    latent layers run the portable path, with the same tokens as the portable backend."""
    loaded = load_quiet(tiny_ds[1])
    prompts = [prompt_ids(13), prompt_ids(4, seed=1)]
    monkeypatch.setattr(backends, "_current", Backend())
    _, want = run_engine(loaded, prompts, storage="paged", block_size=8)

    def kernel(*args, **kwargs):
        raise AssertionError("the kernel stand-in ran for a latent layer")

    class StandIn(Backend):
        def paged_runner(self, head_dim):
            return "kernel-stand-in"

        def paged_attention(self, runner):
            return kernel if runner == "kernel-stand-in" else paged_decode_attention

    stand_in = StandIn()
    assert stand_in.paged_runner_for(LATENT) == "kernel-stand-in"
    assert stand_in.paged_runner_for(LATENT, values_in_keys=True) == RUNNER_OPS
    monkeypatch.setattr(backends, "_current", stand_in)
    assert run_engine(loaded, prompts, storage="paged", block_size=8)[1] == want


def test_tensor_parallelism_splits_query_heads_only(tiny_ds):
    """The latent key is shared by every head: only the query heads must divide (tests/mlxcel_core/distributed/
    test_tensor_parallel_families.py runs the ranks). Checked the way a rank loads: before the backend swaps in its
    kernel modules."""
    from tiny_models import FakeGroup

    from mlxcel_core.loading import load_model

    load_model(str(tiny_ds[1]), log=lambda m: None, group=FakeGroup(0, 2))
    with pytest.raises(UnsupportedModelError, match="4 query heads \\(over one shared latent key\\)"):
        load_model(str(tiny_ds[1]), log=lambda m: None, group=FakeGroup(0, 3))


def fp8_copy(src, dst, block=(32, 32)):
    """`src` as an FP8 block-quantized checkpoint (DeepSeek-V3's layout): every projection of the layers (not the
    router, norms, embeddings or LM head) as float8_e4m3fn with a float32 `weight_scale_inv` per block (amax / 448)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    for name in [n for n in weights if n.startswith("model.layers.") and n.endswith("proj.weight")]:
        w = weights[name]
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        padded = torch.zeros(rows * block[0], cols * block[1])
        padded[: w.shape[0], : w.shape[1]] = w
        blocks = padded.reshape(rows, block[0], cols, block[1])
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        q = (blocks / scale[:, None, :, None]).reshape(padded.shape)[: w.shape[0], : w.shape[1]]
        weights[name] = q.to(torch.float8_e4m3fn)
        weights[name.replace(".weight", ".weight_scale_inv")] = scale.float()
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    return rewrite_config(dst, quantization_config=quant)


def test_fp8_checkpoint_dequantizes_as_transformers(checkpoints, tmp_path):
    """An FP8 block-quantized copy: our weights are transformers' dequantized ones, and parity holds."""
    import torch
    from transformers import AutoModelForCausalLM

    path = fp8_copy(checkpoints["v3"], tmp_path / "fp8")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    if ref["model.layers.0.self_attn.q_a_proj.weight"].dtype != torch.float32:
        pytest.skip("this transformers keeps the FP8 weights undequantized (5.24 dequantizes them)")
    attn = load_quiet(path).model.layers[0].self_attn
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
        want = ref[f"model.layers.0.self_attn.{name}.weight"].numpy()
        np.testing.assert_array_equal(np.array(attn[name].weight), want)
    kv_b = ref["model.layers.0.self_attn.kv_b_proj.weight"].numpy().reshape(4, 64, 32)
    np.testing.assert_array_equal(np.array(attn.unembed_out.weight), kv_b[:, 32:])
    original = mx.load(str(checkpoints["v3"] / "model.safetensors"))["model.layers.0.self_attn.q_a_proj.weight"]
    assert not mx.array_equal(attn.q_a_proj.weight, original)  # (FP8 values: not the fp32 original's)
    assert_parity(path)


def test_fp8_blocks_cut_short_at_the_edges():
    """A weight whose sides are not multiples of the block: the last blocks' scales cover what is left (DeepSeek's
    weight_dequant; e.g. its kv_a_proj_with_mqa of 576 rows in blocks of 128)."""
    rng = np.random.default_rng(0)
    values = rng.normal(0, 1, (40, 70)).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, (2, 3)).astype(np.float32)
    fp8 = mx.to_fp8(mx.array(values))
    out = deepseek_v3.dequantize_fp8({"x.weight": fp8, "x.weight_scale_inv": mx.array(scale)}, (32, 32))
    want = np.array(mx.from_fp8(fp8, dtype=mx.float32)) * np.repeat(np.repeat(scale, 32, 0), 32, 1)[:40, :70]
    assert set(out) == {"x.weight"}
    np.testing.assert_allclose(np.array(out["x.weight"].astype(mx.float32)), want, rtol=1e-2)


def test_quantized_kv_b_proj_is_split_and_requantized():
    """An older mlx-lm conversion's quantized kv_b_proj: dequantized, split per head, quantized again."""
    args = deepseek_v3.ModelArgs.from_dict(
        {**DEEPSEEK_V3, **VARIANTS["moonlight"], "kv_lora_rank": 64, "vocab_size": 320}
    )
    weight = mx.random.normal((4 * 64, 64), key=mx.random.key(0)) * 0.1
    packed, scales, biases = mx.quantize(weight, group_size=32, bits=4)
    weights = {"p.kv_b_proj.weight": packed, "p.kv_b_proj.scales": scales, "p.kv_b_proj.biases": biases}
    deepseek_v3.split_kv_b(weights, "p", args)
    assert sorted(weights) == sorted(
        f"p.{n}.{s}" for n in ("embed_q", "unembed_out") for s in ("weight", "scales", "biases")
    )
    whole = np.array(mx.dequantize(packed, scales, biases, group_size=32, bits=4)).reshape(4, 64, 64)
    parts = {
        n: np.array(
            mx.dequantize(*(weights[f"p.{n}.{s}"] for s in ("weight", "scales", "biases")), group_size=32, bits=4)
        )
        for n in ("embed_q", "unembed_out")
    }
    np.testing.assert_allclose(parts["embed_q"], whole[:, :32].transpose(0, 2, 1), atol=0.05)
    np.testing.assert_allclose(parts["unembed_out"], whole[:, 32:], atol=0.05)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_key_value_heads=2), "num_key_value_heads 2 != num_attention_heads 4 is not supported"),
        (dict(topk_method="group_limited_greedy"), "topk_method 'group_limited_greedy' is not supported"),
        (dict(scoring_func="softmax"), "scoring_func 'softmax' is not supported"),
        (dict(moe_layer_freq=2), "moe_layer_freq 2 is not supported"),
        (dict(quantization_config={"quant_method": "compressed-tensors"}), "quant_method 'compressed-tensors'"),
        (dict(quantization_config={"quant_method": "fp8", "fmt": "e5m2"}), "fmt 'e5m2'"),
        (dict(n_group=3), "n_group 3 does not divide the 8 routed experts"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope scaling type 'dynamic' is not supported"),
    ],
)
def test_refuses_what_it_cannot_compute(overrides, message):
    config = {**DEEPSEEK_V3, **VARIANTS["v3"], "vocab_size": 320, "model_type": "deepseek_v3", **overrides}
    with pytest.raises(UnsupportedModelError, match=message):
        deepseek_v3.Model(deepseek_v3.ModelArgs.from_dict(config))


def test_engine_paths(tiny_ds):
    family_checks.assert_engine_paths(tiny_ds[1])


@pytest.mark.parametrize("bits", family_checks.BITS)
def test_quantized(tiny_ds, tmp_path, bits):
    """The 4- or 8-bit copy: projections, expert banks and per-head latent maps whose input splits into groups of 64
    quantized, the router left as it is."""
    family_checks.assert_quantized(tiny_ds[1], tmp_path, bits=(bits,))
    model = load_quiet(tmp_path / f"q{bits}").model
    attn = model.layers[1].self_attn
    assert isinstance(attn.kv_a_proj_with_mqa, nn.QuantizedLinear) and attn.kv_a_proj_with_mqa.bits == bits
    assert type(model.layers[1].mlp.gate) is GroupedTopKRouter


@pytest.mark.skipif(backends.cuda_available(), reason="MLX's CUDA quantized matmul has no kernel for 32 outputs")
def test_quantized_latent_maps(tmp_path):
    """qk_nope_head_dim 64: embed_q's input splits into groups of 64, so the 4-bit copy quantizes it
    (QuantizedMultiLinear) and computes the dequantized architecture."""
    path = save(tmp_path / "ck", "moonlight", qk_nope_head_dim=64)
    family_checks.assert_quantized(path, tmp_path, bits=(4,))
    attn = load_quiet(tmp_path / "q4").model.layers[0].self_attn
    assert isinstance(attn.embed_q, deepseek_v3.QuantizedMultiLinear) and attn.embed_q.bits == 4
    assert type(attn.unembed_out) is deepseek_v3.MultiLinear  # (its input, kv_lora_rank 32, does not split)


def test_cli_and_server(tiny_ds):
    family_checks.assert_cli_and_server(tiny_ds[1])
