"""Gemma 4 text (`gemma4_text`, and the language model of `gemma4` image/audio-text checkpoints): parity with
transformers on tiny random checkpoints -- sliding and full layers of different head sizes, proportional RoPE,
per-layer embeddings, KV shared across layers, double-wide MLPs, layer scalars, final soft-capping; a MoE variant
(experts beside the dense MLP, K = V full layers with their own KV heads) -- in transformers 5's config style and the
released checkpoints' older one, the multimodal wrapper (towers dropped with a notice), the engine paths, quantized
weights and KV, the CUDA kernel's read-only routing for KV-shared layers, and the refusals."""

from __future__ import annotations

import json
import shutil

import family_checks
import mlx.core as mx
import numpy as np
import pytest
from parity import assert_parity, checkpoint_logits, load_quiet, prompt_ids, reference, save_tiny_checkpoint
from test_qwen3 import set_norms
from tiny_configs import GEMMA4_DENSE, GEMMA4_MOE, F, S
from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

from mlxcel_core.backends import cuda_available as backends_cuda
from mlxcel_core.errors import UnsupportedModelError
from mlxcel_core.models.gemma4 import ModelArgs

COMMON = dict(max_position_embeddings=512, initializer_range=0.1, eos_token_id=2, bos_token_id=None, pad_token_id=0)
RANDOM = ("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")  # ones in transformers' init
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    patch_size=4,
    position_embedding_size=64,
    pooling_kernel_size=1,
)
AUDIO = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    subsampling_conv_channels=[8, 4],
    output_proj_dims=32,
)


def randomize(path):
    """Random norm gains, layer scalars and router scales in [0.5, 1.5); q/k norm gains in [0.25, 0.75). Attention
    is unscaled (1.0) over RMS-normed q and k, so the gains set how peaked it is: with [0.5, 1.5) ones, transformers'
    own fp32 logits differ from its fp64 ones by 5e-5, too close to parity's 1e-4 to tell anything."""
    from safetensors.numpy import load_file, save_file

    set_norms(path, suffixes=RANDOM)
    weights = load_file(path / "model.safetensors")
    for name, w in weights.items():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            weights[name] = (w * 0.5).astype(w.dtype)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    return {
        name: randomize(save_tiny_checkpoint(root / name, Gemma4TextConfig, Gemma4ForCausalLM, **COMMON, **cfg))
        for name, cfg in (("dense", GEMMA4_DENSE), ("moe", GEMMA4_MOE))
    }


@pytest.fixture(scope="module")
def wrapper(tmp_path_factory):
    """Gemma4ForConditionalGeneration as transformers saves it: text_config nested, the text weights under
    `model.language_model.`, vision and audio towers beside them."""
    path = tmp_path_factory.mktemp("gemma4-mm") / "mm"
    text = {**GEMMA4_DENSE, **COMMON, "vocab_size": 320, "use_bidirectional_attention": "vision"}
    save_tiny_checkpoint(
        path,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        text_config=text,
        vision_config=VISION,
        audio_config=AUDIO,
        **{k: COMMON[k] for k in ("eos_token_id", "bos_token_id", "pad_token_id")},
    )
    return randomize(path)


def _edit_config(src, dst, edit):
    path = shutil.copytree(src, dst)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return path


def released_style(config):
    """As the released checkpoints' config.json: `global_head_dim` (and `num_global_key_value_heads`) where
    transformers 5 writes `per_layer_config`."""
    overrides = config.pop("per_layer_config")
    full = [i for i, kind in enumerate(config["layer_types"]) if kind == F]
    assert sorted(int(i) for i in overrides) == full
    (head_dim,) = {o["head_dim"] for o in overrides.values()}
    config["global_head_dim"] = head_dim
    kv_heads = {o.get("num_key_value_heads") for o in overrides.values()} - {None}
    if kv_heads:
        config["num_global_key_value_heads"] = kv_heads.pop()


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_logits_and_greedy_match_transformers(checkpoints, name):
    assert_parity(checkpoints[name])


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_released_config_style_same_logits(checkpoints, tmp_path, name):
    path = checkpoints[name]
    old = _edit_config(path, tmp_path / "old", released_style)
    assert "per_layer_config" not in json.loads((old / "config.json").read_text())
    prompt = prompt_ids(64)
    ref, _ = reference(path, prompt, 1)
    assert np.abs(checkpoint_logits(old, prompt) - ref).max() <= 1e-4


def test_architecture_follows_config(checkpoints):
    from mlxcel_core.engine.budget import kv_bytes_per_token

    model = load_quiet(checkpoints["dense"]).model
    assert model.kv_sources == [0, 1, 2, 2, 1]
    attn = [layer.self_attn for layer in model.layers]
    assert [a.head_dim for a in attn] == [32, 64, 32, 32, 64]
    assert [a.window for a in attn] == [8, None, 8, 8, None]
    assert ["k_proj" in a for a in attn] == [True, True, True, False, False]
    assert [layer.mlp.gate_proj.weight.shape[0] for layer in model.layers] == [96, 96, 96, 192, 192]
    assert model.kv_layout() == [(2, 32), (2, 64), (2, 32), None, None]
    assert kv_bytes_per_token(model) == 2 * (64 + 128 + 64) * 2  # the 3 storing layers, fp16
    moe = load_quiet(checkpoints["moe"]).model
    assert moe.args.layer_types == [S, S, F]
    assert [(a.self_attn.n_kv_heads, "v_proj" in a.self_attn) for a in moe.layers] == [(2, True), (2, True), (1, False)]
    assert moe.layers[0].experts.switch_glu.gate_proj.weight.shape == (4, 32, 64)


def test_config_knobs_all_matter(checkpoints, tmp_path):
    """Each RoPE, the window and the final soft-capping are read from config.json: other values, other logits."""
    path = checkpoints["dense"]
    prompt = prompt_ids(64)
    ref, _ = reference(path, prompt, 1)
    rope = GEMMA4_DENSE["rope_parameters"]
    changes = {
        "softcap": {"final_logit_softcapping": None},
        "window": {"sliding_window": 4096},
        "sliding-theta": {"rope_parameters": {**rope, S: {"rope_type": "default", "rope_theta": 10_000.0}}},
        "partial": {"rope_parameters": {**rope, F: {**rope[F], "partial_rotary_factor": 1.0}}},
        "factor": {"rope_parameters": {**rope, F: {**rope[F], "factor": 4.0}}},
    }
    for name, change in changes.items():
        changed = _edit_config(path, tmp_path / name, lambda c: c.update(change))
        assert np.abs(checkpoint_logits(changed, prompt) - ref).max() > 1e-2, name


def test_wrapper_checkpoint_loads_its_text_model_with_a_notice(wrapper):
    from mlxcel_core.loading import load_model

    config = json.loads((wrapper / "config.json").read_text())
    assert config["model_type"] == "gemma4" and "hidden_size" not in config
    names = mx.load(str(wrapper / "model.safetensors"))
    assert any(n.startswith("model.language_model.") for n in names)
    assert any(n.startswith("model.vision_tower.") for n in names)
    assert any(n.startswith("model.audio_tower.") for n in names)
    said = []
    load_model(str(wrapper), log=said.append)
    notice = "gemma4 checkpoint: loading its gemma4_text language model only (the vision and audio towers' weights"
    assert any(line.startswith(notice) for line in said), said
    assert_parity(wrapper)  # transformers' Gemma4ForConditionalGeneration on text-only input


def _rewrite_weights(src, dst, rename):
    """A copy of checkpoint `src` whose weights are `rename(weights)`."""
    path = shutil.copytree(src, dst)
    mx.save_safetensors(str(path / "model.safetensors"), rename(mx.load(str(path / "model.safetensors"))))
    return path


def test_mlx_lm_layout_and_released_extras_same_logits(checkpoints, wrapper, tmp_path):
    """mlx-lm's names (`language_model.model.`, `experts.switch_glu`) load to the same logits, and so do the
    KV-shared layers' unused key/value weights that released checkpoints keep (dropped, as transformers does)."""

    def mlx_lm(weights):
        out = {}
        for name, value in weights.items():
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                base, kind = name.rsplit(".", 1)
                parts = mx.split(value, 2, axis=1) if kind == "gate_up_proj" else [value]
                for proj, part in zip(("gate_proj", "up_proj") if len(parts) == 2 else ("down_proj",), parts):
                    out[f"language_model.{base}.switch_glu.{proj}.weight"] = mx.contiguous(part)
            else:
                out[
                    name.replace("model.", "language_model.model.", 1).replace("lm_head.", "language_model.lm_head.")
                ] = value
        return out

    def released(weights):
        extra = {}
        for layer in (3, 4):
            for proj, shape in (("k_proj.weight", (64, 64)), ("v_proj.weight", (64, 64)), ("k_norm.weight", (32,))):
                extra[f"model.language_model.layers.{layer}.self_attn.{proj}"] = mx.ones(shape)
        return {**weights, **extra}

    prompt = prompt_ids(64)
    for src, rename in ((checkpoints["moe"], mlx_lm), (wrapper, released)):
        renamed = _rewrite_weights(src, tmp_path / rename.__name__, rename)
        assert set(mx.load(str(renamed / "model.safetensors"))) != set(mx.load(str(src / "model.safetensors")))
        np.testing.assert_allclose(checkpoint_logits(renamed, prompt), checkpoint_logits(src, prompt), atol=1e-6)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_engine_paths(checkpoints, name):
    family_checks.assert_engine_paths(checkpoints[name])


@pytest.mark.parametrize("bits", family_checks.BITS)
def test_quantized(checkpoints, tmp_path, bits):
    family_checks.assert_quantized(checkpoints["dense"], tmp_path, bits=(bits,))


def test_cli_and_server(checkpoints):
    family_checks.assert_cli_and_server(checkpoints["dense"])


def test_quantized_kv_reaches_the_shared_layers(checkpoints):
    """8-bit KV: the KV-shared layers read their source's quantized store; dense and paged storage (one prompt at a
    time, several at once, chunked) give the same tokens."""
    loaded = load_quiet(checkpoints["dense"])
    prompts = [prompt_ids(n, seed=i) for i, n in enumerate(family_checks.LENGTHS)]
    loaded.tokenizer.eos_token_ids = set()
    run = family_checks._run
    dense = [run(loaded, [p], 16, max_batch_size=1, storage="dense", kv_bits=8)[0] for p in prompts]
    paged = run(loaded, prompts, 16, max_batch_size=4, storage="paged", block_size=8, kv_bits=8, prefill_chunk_size=8)
    assert paged == dense and all(len(t) == 16 for t in dense)


def test_kv_shared_layers_store_nothing(checkpoints):
    """No pool is made for a KV-shared layer and its dense cache stays empty; the other layers' pools have their
    own head sizes."""
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.sampling import SamplingParams

    loaded = load_quiet(checkpoints["dense"])
    for storage in ("paged", "dense"):
        engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(storage=storage, max_batch_size=2, block_size=8))
        for n in (9, 3):
            engine.open(prompt_ids(n), SamplingParams(max_tokens=30))
        for _ in range(4):
            engine.step()
        if storage == "paged":
            pools = engine.storage.pools
            assert [None if p is None else p[0].shape[2:] for p in pools] == [(2, 32), (2, 64), (2, 32), None, None]
        else:
            assert [c.keys is None for c in engine.storage._batch] == [False, False, False, True, True]


@pytest.mark.parametrize("storage", ["dense", "paged"])
def test_conversation_and_speculative_decoding(checkpoints, storage):
    """A chat's second turn reusing the first's KV (dense: the KV-shared layers' caches stay empty through the row
    copies, merges and trims), and prompt-lookup speculative decoding (several tokens verified in one forward, the
    rejected ones rolled back) give the tokens of a fresh plain run."""
    from mlxcel_core.engine import Conversation, Engine, EngineConfig, SpeculativeConfig
    from mlxcel_core.sampling import SamplingParams

    loaded = load_quiet(checkpoints["dense"])
    loaded.tokenizer.eos_token_ids = set()

    def turn(config, prompt, conversation=None):
        engine = Engine(loaded.model, loaded.tokenizer, config)
        seq = engine.open(prompt, SamplingParams(max_tokens=12), conversation)
        while engine.has_work():
            assert all(out.error is None for out in engine.step())
        return engine.sequence(seq).output_ids

    plain = EngineConfig(storage=storage, block_size=8)
    first = prompt_ids(20)
    second = first + turn(plain, first) + prompt_ids(6, seed=1)
    chat = Conversation()
    turn(plain, first, chat)
    assert turn(plain, second, chat) == turn(plain, second)
    spec = EngineConfig(storage=storage, block_size=8, speculative=SpeculativeConfig(num_draft_tokens=4, ngram=2))
    repetitive = (prompt_ids(6) * 4)[:22]
    assert turn(spec, repetitive) == turn(plain, repetitive)


def test_kv_shared_layers_read_on_the_kernel_without_writing(checkpoints, monkeypatch):
    """Where the backend's decode kernel writes a step's keys itself (CUDA: new_kv), a KV-shared full layer's call
    goes to the kernel read-only (no new_kv) over its source's pools, after the source's in-place write: the tokens
    are the portable path's. (A stand-in kernel on the CPU: the MLX-ops attention plus an in-place write.)"""
    from mlxcel_core import backends
    from mlxcel_core.backends.base import Backend
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.kv.paged_attention import paged_decode_attention
    from mlxcel_core.sampling import SamplingParams

    loaded = load_quiet(checkpoints["dense"])
    loaded.tokenizer.eos_token_ids = set()

    def run():
        # (op by op: a compiled step would replay the trace of the first backend's attention)
        engine = Engine(
            loaded.model, loaded.tokenizer, EngineConfig(storage="paged", block_size=8, compile_decode=False)
        )
        seq = engine.open(prompt_ids(20), SamplingParams(max_tokens=12))
        while engine.has_work():
            engine.step()
        return engine.sequence(seq).output_ids

    monkeypatch.setattr(backends, "_current", Backend())
    want = run()
    calls = []

    def kernel_stand_in(
        q, k_pool, v_pool, tables, lens, num_splits=1, scale=None, new_kv=None, counters=None, window=None
    ):
        calls.append((q.shape[-1], new_kv is not None, counters is not None, window))
        if new_kv is not None:  # in place: the storage's pool arrays themselves take the step's keys and values
            k, v, blocks, offsets = new_kv
            k_pool[blocks, offsets] = k
            v_pool[blocks, offsets] = v
        return paged_decode_attention(
            q, k_pool, v_pool, tables, lens, num_splits=num_splits, scale=scale, window=window
        )

    class StandIn(Backend):
        kv_written_in_kernel = True

        def paged_runner(self, head_dim):
            return "cuda-kernel-stand-in"

        def paged_attention(self, runner):
            return kernel_stand_in

        def combine_counters(self, num_layers):
            return [mx.zeros((8,), mx.int32) for _ in range(num_layers)]

    monkeypatch.setattr(backends, "_current", StandIn())
    assert run() == want
    # Each decode step: full layer 1 writes its keys in the kernel, then layer 4 (sharing them) reads them there;
    # the sliding layers take the kernel too, with their window.
    full = [call[:3] for call in calls if call[3] is None]
    assert len(full) >= 2 * (len(want) - 1)
    assert full == [(64, True, True), (64, False, True)] * (len(full) // 2)
    sliding = [call for call in calls if call[3] is not None]
    assert sliding and {call[3] for call in sliding} == {loaded.model.args.sliding_window}


@pytest.mark.skipif(not backends_cuda(), reason="needs MLX on a CUDA device")
def test_kv_shared_layers_read_on_the_cuda_kernel(checkpoints, monkeypatch):
    """On CUDA, the real kernel: the KV-shared full layer's decode attention runs on it read-only, after its
    source's launch wrote the step's keys in place, and the sliding layers' with their window; the tokens are the
    portable backend's."""
    from mlxcel_core import backends
    from mlxcel_core.backends.base import Backend
    from mlxcel_core.backends.cuda import backend as cuda_backend
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.sampling import SamplingParams

    loaded = load_quiet(checkpoints["dense"])
    loaded.tokenizer.eos_token_ids = set()

    def run():
        config = EngineConfig(storage="paged", block_size=8, compile_decode=False, decode_graph=False)
        engine = Engine(loaded.model, loaded.tokenizer, config)
        seq = engine.open(prompt_ids(20), SamplingParams(max_tokens=12))
        while engine.has_work():
            engine.step()
        return engine.sequence(seq).output_ids

    kernel_runs = []
    real = cuda_backend.decode_attention_for

    def recording(runner):
        attention = real(runner)
        return lambda *args, **kwargs: (
            kernel_runs.append((kwargs.get("new_kv") is not None, kwargs.get("window"))) or attention(*args, **kwargs)
        )

    monkeypatch.setattr(cuda_backend, "decode_attention_for", recording)
    monkeypatch.setattr(backends, "_current", cuda_backend.CudaBackend())
    on_kernel = run()
    monkeypatch.setattr(backends, "_current", Backend())
    assert on_kernel == run()
    full = [writes for writes, window in kernel_runs if window is None]  # (the sliding layers' calls have a window)
    assert full and full == [True, False] * (len(full) // 2)
    assert {window for _, window in kernel_runs} == {None, loaded.model.args.sliding_window}


def test_tensor_parallelism_needs_every_layers_heads_to_divide(checkpoints):
    """The MoE checkpoint's full layers have 1 KV head: refused at 2 ranks; the dense one shards
    (tests/mlxcel_core/distributed/test_tensor_parallel_families.py runs the ranks)."""
    from tiny_models import FakeGroup

    from mlxcel_core.loading import load_model

    load_model(str(checkpoints["dense"]), log=lambda m: None, group=FakeGroup(0, 2))  # (as a rank loads: unprepared)
    with pytest.raises(UnsupportedModelError, match="4 query heads and 1 KV heads"):
        load_model(str(checkpoints["moe"]), log=lambda m: None, group=FakeGroup(0, 2))


BASE = dict(GEMMA4_DENSE, vocab_size=320)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention 'all'"),
        ({"hidden_activation": "silu"}, "hidden_activation 'silu'"),
        (
            {"rope_parameters": {S: {"rope_type": "yarn", "rope_theta": 1.0}, F: GEMMA4_DENSE["rope_parameters"][F]}},
            "'yarn'",
        ),
        ({"per_layer_config": {"1": {"intermediate_size": 32}}}, "per_layer_config of layer 1 \\(intermediate_size"),
        ({"num_kv_shared_layers": 5}, "num_kv_shared_layers 5"),
        ({"layer_types": [S, S, S, F, F]}, "KV-shared full_attention layers have no earlier"),
        ({"enable_moe_block": True}, "enable_moe_block needs num_experts"),
        ({"layer_types": [S, F, "chunked_attention", S, F]}, "layer_types \\['chunked_attention'\\]"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    from mlxcel_core.models.gemma4 import Model

    with pytest.raises(UnsupportedModelError, match=message):
        Model(ModelArgs.from_dict({**BASE, **change}))


def test_last_layer_attends_globally_and_defaults():
    """As Gemma4TextConfig: the last layer is full whatever layer_types says; 5 sliding per full by default; a
    'vision' bidirectional setting leaves text causal."""
    args = ModelArgs.from_dict({**BASE, "layer_types": [S, F, S, S, S], "use_bidirectional_attention": "vision"})
    assert args.layer_types == [S, F, S, S, F]
    args = ModelArgs.from_dict({k: v for k, v in BASE.items() if k != "layer_types"} | {"num_kv_shared_layers": 0})
    assert args.layer_types == [S, S, S, S, F]


def test_bench_shape_builds_scaled_down():
    """The gemma-4-e4b bench shape, scaled down (its real size is too big for this machine), builds and runs."""
    from mlxcel_core.loading import shapes

    shape = dict(shapes.SHAPES["gemma-4-e4b"])
    assert shape["num_hidden_layers"] == 42 and shape["num_kv_shared_layers"] == 18
    small = dict(shape, hidden_size=64, intermediate_size=128, vocab_size=512, vocab_size_per_layer_input=512)
    small.update(num_hidden_layers=12, num_kv_shared_layers=5, hidden_size_per_layer_input=8, head_dim=32)
    small.update(global_head_dim=64, layer_types=([S] * 5 + [F]) * 2)
    shapes.SHAPES["gemma-4-e4b-small"] = small
    try:
        model, _ = shapes.build_random_model("gemma-4-e4b-small", bits=4)
    finally:
        del shapes.SHAPES["gemma-4-e4b-small"]
    assert model.kv_sources[7:] == [6, 6, 6, 6, 5] and model(mx.array([[1, 2, 3]])).shape == (1, 3, 512)
