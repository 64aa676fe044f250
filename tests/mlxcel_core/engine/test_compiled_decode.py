"""Compiled decode steps (engine/compiled_decode.py) give exactly the tokens of steps built op by op."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from parity import save_tiny_checkpoint
from tiny_models import save_tiny_llama

from mlxcel_core.cache import KVCache
from mlxcel_core.engine import Engine, EngineConfig, compiled_decode
from mlxcel_core.engine.compiled_decode import StepKV, forget_traces, step_traces
from mlxcel_core.engine.paged import PagedStorage
from mlxcel_core.loading import load_model
from mlxcel_core.sampling import SamplingParams

rng = np.random.default_rng(11)
PROMPTS = [rng.integers(3, 300, size=n).tolist() for n in (5, 17, 1, 40)]
ARRIVALS = [0, 0, 2, 5]
MAX_TOKENS = [14, 9, 12, 10]


def _load(path):
    lm = load_model(str(path), log=lambda m: None)
    lm.tokenizer.eos_token_ids = set()  # random weights: every row runs to max_tokens
    return lm


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # head_dim 32, so quantized KV applies too
    return _load(save_tiny_llama(tmp_path_factory.mktemp("llama"), num_attention_heads=2, num_key_value_heads=1))


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """Sliding-window layers (window 8, shorter than the prompts) and attention-logit soft-capping."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return _load(
        save_tiny_checkpoint(
            tmp_path_factory.mktemp("gemma2"),
            Gemma2Config,
            Gemma2ForCausalLM,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            initializer_range=0.3,
            sliding_window=8,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=10.0,
            attn_implementation="eager",
            eos_token_id=2,
            bos_token_id=None,
            pad_token_id=0,
            tie_word_embeddings=False,
        )
    )


def run(loaded, config: EngineConfig, prompts=PROMPTS, arrivals=ARRIVALS, max_tokens=MAX_TOKENS):
    """Each request's tokens, and the engine (to see how many steps ran compiled)."""
    engine = Engine(loaded.model, loaded.tokenizer, config)
    ids, out, step = {}, {}, 0
    while len(ids) < len(prompts) or engine.has_work():
        for i, (prompt, at) in enumerate(zip(prompts, arrivals)):
            if at == step and i not in ids:
                ids[i] = engine.open(prompt, SamplingParams(max_tokens=max_tokens[i]))
        for o in engine.step():
            assert o.error is None, o.error
            if o.token is not None:
                out.setdefault(o.seq_id, []).append(o.token)
        step += 1
    return {i: out[s] for i, s in ids.items()}, engine


def compiles(storage: str) -> bool:
    """Dense decode steps stay op by op on CUDA by design (compiled_decode.dense_mask_is_slow)."""
    return storage == "paged" or not compiled_decode.dense_mask_is_slow()


def compiled_and_eager(loaded, **config):
    compiled, engine = run(loaded, EngineConfig(compile_decode=True, **config))
    eager, plain = run(loaded, EngineConfig(compile_decode=False, **config))
    assert plain.runner.compiled is None
    return compiled, eager, engine.runner.compiled.steps


@pytest.mark.parametrize("storage", ["dense", "paged"])
@pytest.mark.parametrize("batch", [1, 4])
def test_compiled_steps_give_the_eager_tokens(llama, storage, batch):
    compiled, eager, steps = compiled_and_eager(llama, max_batch_size=batch, storage=storage, block_size=8)
    assert compiled == eager
    assert (steps > 0) == compiles(storage)  # the compiled path really ran, where it runs


@pytest.mark.parametrize("storage", ["dense", "paged"])
def test_sliding_window_and_softcap_layers(gemma2, storage):
    compiled, eager, steps = compiled_and_eager(gemma2, max_batch_size=4, storage=storage, block_size=8)
    assert compiled == eager and (steps > 0) == compiles(storage)


def test_decoding_across_a_capacity_step(llama):
    """A 250-token prompt decoding 20 tokens crosses KVCache's 256-column growth step (a new trace)."""
    prompt = rng.integers(3, 300, size=250).tolist()
    compiled, _ = run(llama, EngineConfig(compile_decode=True), [prompt], [0], [20])
    eager, _ = run(llama, EngineConfig(compile_decode=False), [prompt], [0], [20])
    assert compiled == eager


def test_quantized_kv_is_not_compiled(llama):
    compiled, eager, steps = compiled_and_eager(llama, max_batch_size=4, storage="dense", kv_bits=8)
    assert compiled == eager and steps == 0


def test_dense_steps_are_not_compiled_where_the_mask_is_slow(llama, monkeypatch):
    """On CUDA (dense_mask_is_slow) dense caches decode op by op; paged decode views still run compiled."""
    monkeypatch.setattr(compiled_decode, "dense_mask_is_slow", lambda: True)
    _, _, dense_steps = compiled_and_eager(llama, max_batch_size=1, storage="dense")
    _, _, paged_steps = compiled_and_eager(llama, max_batch_size=1, storage="paged", block_size=8)
    assert dense_steps == 0 and paged_steps > 0


def test_config_turns_compiling_off_and_on(llama):
    _, engine = run(llama, EngineConfig(compile_decode=False), PROMPTS[:1], [0], [3])
    assert engine.runner.compiled is None
    _, engine = run(llama, EngineConfig(compile_decode=True), PROMPTS[:1], [0], [3])
    assert engine.runner.compiled is not None and engine.runner.compiled.steps > 0


def test_by_default_only_a_gpu_compiles(llama):
    """On CPU compiling gains nothing on real models and a machine's first run JIT-compiles its kernels."""
    _, engine = run(llama, EngineConfig(), PROMPTS[:1], [0], [3])
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    assert (engine.runner.compiled is not None) == on_gpu


@pytest.mark.parametrize("window", [None, 3])
def test_step_kv_attends_like_the_kv_cache(window):
    """StepKV (whole buffer, array column, mask) == KVCache.attend (used columns) for a left-padded batch."""
    B, H, D, columns = 3, 2, 8, 6
    old = mx.random.normal((B, H, columns, D), key=mx.random.key(0))
    new_k, new_v = (mx.random.normal((B, H, 1, D), key=mx.random.key(i)) for i in (1, 2))
    queries = mx.random.normal((B, 2 * H, 1, D), key=mx.random.key(3))
    cache = KVCache(left_padding=[0, 2, 5])
    cache.update_and_fetch(old, old * 0.5)
    offset = cache.offset.tolist()  # each row's position of the new token
    expected = cache.attend(queries, new_k, new_v, 0.3, window=window)

    buffer = mx.zeros((B, H, 16, D))
    keys, values = (mx.concatenate([a, buffer[..., columns:, :]], axis=2) for a in (old, old * 0.5))
    step = StepKV(keys, values, mx.array([columns], mx.int32), mx.array([0, 2, 5], mx.int32))
    assert step.offset.tolist() == offset
    got = step.attend(queries, new_k, new_v, 0.3, window=window)
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.array(step.keys[..., columns : columns + 1, :]), np.array(new_k))


def test_paged_block_tables_are_padded_to_a_power_of_two():
    storage = PagedStorage(1, block_size=4, kv_budget_tokens=256, pad_block_tables=True)
    for seq_id, length in ((0, 9), (1, 13)):  # 3 and 4 blocks with the decode token
        storage.add(seq_id, list(range(length)))
        storage.prefill_caches(seq_id, 0, length)
    (view,) = storage.decode_caches([0, 1])
    assert view.block_tables.shape == (2, 4)
    storage.add(2, list(range(17)))
    storage.prefill_caches(2, 0, 17)  # 5 blocks with its decode token: padded to 8
    (view,) = storage.decode_caches([2])
    assert view.block_tables.shape == (1, 8)
    assert view.offset.tolist() == [17]


def test_a_model_that_cannot_be_traced_decodes_op_by_op(llama, monkeypatch, caplog):
    """A forward that reads an array on the host (allowed eagerly, impossible inside mx.compile) falls back once,
    with a warning, and gives the eager tokens."""
    model = llama.model
    plain_call = type(model).__call__

    def host_reading_call(self, inputs, cache=None, last_only=False):
        if int(inputs.sum().item()) < 0:  # a host read: raises while tracing
            raise AssertionError("unreachable")
        return plain_call(self, inputs, cache, last_only)

    eager, _ = run(llama, EngineConfig(compile_decode=False, max_batch_size=4, storage="paged", block_size=8))
    monkeypatch.setattr(type(model), "__call__", host_reading_call)
    forget_traces(model)  # the model computes differently now: earlier tests' traces must not be replayed
    for storage in filter(compiles, ("dense", "paged")):
        tokens, engine = run(llama, EngineConfig(compile_decode=True, max_batch_size=4, storage=storage, block_size=8))
        assert tokens == eager
        assert engine.runner.compiled is None
    assert "decoding op by op" in caplog.text


def test_engines_on_one_model_share_its_traces(llama):
    """A second engine on the same model replays the first one's traces (no new trace inside its first request's
    TTFT); fusing the projections forgets them, and a model's traces go with the model."""
    import gc

    from mlxcel_core.backends.cuda.kernels.fused_projections import fuse_projections, unfuse_projections
    from mlxcel_core.engine import compiled_decode
    from mlxcel_core.loading.shapes import build_random_model

    model = llama.model
    forget_traces(model)
    config = EngineConfig(compile_decode=True, max_batch_size=2, storage="paged")
    first, engine = run(llama, config)
    made = step_traces(model).traced
    assert made > 0 and engine.runner.compiled.steps > 0
    again, engine = run(llama, config)
    assert step_traces(model).traced == made and engine.runner.compiled.steps > 0
    assert again == first
    fuse_projections(model)
    try:
        assert step_traces(model).traced == 0  # forgotten: the next step traces the fused model
        fused, _ = run(llama, config)
        assert step_traces(model).traced > 0 and fused == first
    finally:
        unfuse_projections(model)

    other, _ = build_random_model("tiny", dtype="float32", seed=9)
    key = id(other)
    step_traces(other)
    assert key in compiled_decode._TRACES
    del other
    gc.collect()
    assert key not in compiled_decode._TRACES  # the traces do not keep a model alive
