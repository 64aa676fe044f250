"""Issue acceptance on CPU: batched == one-at-a-time (dense and paged), prefix reuse, row errors, KV quantization."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from engine_drive import drive
from tiny_models import save_tiny_llama

from mlxcel_core import backends
from mlxcel_core.backends.base import GPU_PREFILL_BATCH
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.loading import load_model
from mlxcel_core.sampling import SamplingParams

rng = np.random.default_rng(3)
PROMPTS = [rng.integers(3, 300, size=n).tolist() for n in (5, 17, 1, 40, 9, 33, 2, 64)]
ARRIVAL_STEP = [0, 0, 1, 3, 4, 4, 9, 12]
MAX_TOKENS = [12, 7, 10, 5, 16, 9, 11, 8]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    # head_dim 32 so that quantized KV (group 32) applies too
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-hd32"), num_attention_heads=2, num_key_value_heads=1)
    lm = load_model(str(path), log=lambda m: None)
    lm.tokenizer.eos_token_ids = set()
    return lm


def solo(loaded, config=None):
    result = {}
    for i, prompt in enumerate(PROMPTS):
        engine = Engine(loaded.model, loaded.tokenizer, config or EngineConfig(max_batch_size=1))
        result[i] = drive(engine, [prompt], [0], [SamplingParams(max_tokens=MAX_TOKENS[i])])[0]
    return result


@pytest.fixture(scope="module")
def reference(loaded):
    return solo(loaded)


@pytest.mark.parametrize("storage", ["dense", "paged"])
@pytest.mark.parametrize("chunk", [2048, 8])
def test_batched_equals_one_at_a_time(loaded, reference, storage, chunk):
    config = EngineConfig(
        max_batch_size=8, storage=storage, prefill_chunk_size=chunk, block_size=8, prefill_grant_interval=2
    )
    engine = Engine(loaded.model, loaded.tokenizer, config)
    params = [SamplingParams(max_tokens=n) for n in MAX_TOKENS]
    assert drive(engine, PROMPTS, ARRIVAL_STEP, params) == reference


def test_small_batch_limit_queues_and_still_matches(loaded, reference):
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=3, storage="paged", block_size=16))
    params = [SamplingParams(max_tokens=n) for n in MAX_TOKENS]
    assert drive(engine, PROMPTS, ARRIVAL_STEP, params) == reference


def test_prefix_cache_reuses_a_shared_prefix(loaded):
    prefix = rng.integers(3, 300, size=120).tolist()
    first, second = prefix + [7, 8, 9], prefix + [11, 12]
    config = EngineConfig(max_batch_size=4, storage="paged", block_size=16)

    cold = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=4, storage="paged", prefix_cache=False))
    expected = drive(cold, [second], [0], [SamplingParams(max_tokens=8)])[0]

    engine = Engine(loaded.model, loaded.tokenizer, config)
    drive(engine, [first], [0], [SamplingParams(max_tokens=4)])
    computed_before = engine.runner.prefill_tokens
    seq = engine.open(second, SamplingParams(max_tokens=8))
    tokens = []
    while engine.has_work():
        tokens += [o.token for o in engine.step() if o.token is not None]
    assert tokens == expected
    assert engine.sequence(seq).cached_tokens == 112  # 7 full blocks of 16
    assert engine.runner.prefill_tokens - computed_before == len(second) - 112
    assert engine.storage.stats()["prefix_hits"] == 1


def test_a_failing_row_ends_with_error_and_the_rest_finish(loaded, reference):
    calls = []

    def flaky(tokens, logits):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("processor exploded")
        return logits

    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=4, storage="paged"))
    good = [engine.open(PROMPTS[i], SamplingParams(max_tokens=MAX_TOKENS[i])) for i in (0, 1)]
    bad = engine.open(PROMPTS[4], SamplingParams(max_tokens=10, logits_processors=(flaky,)))
    nan = engine.open(PROMPTS[3], SamplingParams(max_tokens=10, logits_processors=(lambda t, x: x * mx.nan,)))
    out, ends = {}, {}
    while engine.has_work():
        for o in engine.step():
            if o.token is not None:
                out.setdefault(o.seq_id, []).append(o.token)
            if o.finished:
                ends[o.seq_id] = (o.finish_reason, o.error)
    assert ends[bad] == ("error", "sampling failed: RuntimeError: processor exploded")
    assert ends[nan] == ("error", "NaN logits (from the model or a logits processor)")
    assert [out[s] for s in good] == [reference[0], reference[1]]
    assert engine.storage.stats()["blocks_free"] == engine.storage.pool.num_blocks  # nothing leaked


def test_cancel_frees_paged_blocks(loaded):
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        EngineConfig(max_batch_size=2, storage="paged", block_size=8, prefix_cache=False),
    )
    seq = engine.open(PROMPTS[7], SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.storage.stats()["blocks_free"] < engine.storage.pool.num_blocks
    engine.close(seq)
    outputs = engine.step()
    assert [(o.seq_id, o.finish_reason) for o in outputs] == [(seq, "cancelled")]
    assert engine.storage.stats()["blocks_free"] == engine.storage.pool.num_blocks


def _greedy(loaded, prompt, steps, kv_bits):
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=1, kv_bits=kv_bits))
    return drive(engine, [prompt], [0], [SamplingParams(max_tokens=steps)])[0]


def _teacher_forced_logits(model, tokens, kv_bits):
    """Logits of each position, decoding `tokens` one at a time through a (quantized) dense cache."""
    from mlxcel_core.cache import make_cache

    cache = make_cache(len(model.layers), kv_bits=kv_bits)
    return mx.concatenate([model(mx.array([[t]]), cache)[0] for t in tokens])


@pytest.mark.parametrize("bits, tolerance", [(8, 0.05), (4, 0.8)])
def test_quantized_kv_logits_stay_close_and_agreement_is_reported(loaded, capsys, bits, tolerance):
    """Random tiny models have near-tied logits, so greedy paths can part on any perturbation;
    what quantized KV must guarantee is logits close to full precision on the same tokens."""
    agree, worst = [], 0.0
    for prompt in PROMPTS[:4]:
        reference = _greedy(loaded, prompt, 32, None)
        full = _teacher_forced_logits(loaded.model, prompt + reference, None)
        quant = _teacher_forced_logits(loaded.model, prompt + reference, bits)
        worst = max(worst, mx.abs(full - quant).max().item())
        q_tokens = _greedy(loaded, prompt, 32, bits)
        agree.append(next((i for i, (a, b) in enumerate(zip(reference, q_tokens)) if a != b), 32))
    with capsys.disabled():
        print(
            f"\n{bits}-bit KV: max-abs logit error {worst:.4f}; greedy tokens equal to full precision "
            f"before the first difference: {agree} (of 32)"
        )
    assert worst <= tolerance


def test_quantized_kv_round_trip_error_is_within_one_step():
    # MLX's affine quantizer snaps the scale so one end of each group is exact: error < 1 step (not 1/2).
    from mlxcel_core.cache import KVCache

    keys = mx.random.normal((2, 3, 40, 64), key=mx.random.key(0)) * 4
    for bits in (8, 4):
        cache = KVCache(kv_bits=bits)
        stored, _ = cache.update_and_fetch(keys[:, :, :39], keys[:, :, :39])
        stored, _ = cache.update_and_fetch(keys[:, :, 39:], keys[:, :, 39:])
        groups = keys.reshape(2, 3, 40, 1, 64)
        step = (groups.max(axis=-1) - groups.min(axis=-1)) / (2**bits - 1)
        error = mx.abs(stored - keys).reshape(2, 3, 40, 1, 64).max(axis=-1)
        assert mx.all(error <= step + 1e-5).item()
        assert mx.abs(stored - keys).mean().item() < mx.mean(step).item() / 3


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kv_batched_paged_equals_solo_dense(loaded, bits):
    """Both storages quantize each token the same way, so batching and paging change nothing."""
    solo_q = solo(loaded, EngineConfig(max_batch_size=1, kv_bits=bits))
    engine = Engine(
        loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=8, storage="paged", kv_bits=bits, block_size=8)
    )
    params = [SamplingParams(max_tokens=n) for n in MAX_TOKENS]
    assert drive(engine, PROMPTS, ARRIVAL_STEP, params) == solo_q


def test_quantized_kv_is_refused_up_front_for_heads_it_cannot_group(tiny_llama_dir):
    from mlxcel_core.errors import InputError

    lm = load_model(str(tiny_llama_dir), log=lambda m: None)  # head_dim 16
    with pytest.raises(InputError, match="divisible by 32, got 16"):
        Engine(lm.model, lm.tokenizer, EngineConfig(kv_bits=8))


# -- whole prompts prefilled together (EngineConfig.prefill_batch_size, the backend default) ----------------------
def _count_together(engine) -> list[int]:
    """Wrap the runner's prefill_together: the number of prompts of each call."""
    calls, real = [], engine.runner.prefill_together

    def counted(seq_ids, prompts, *lasts):
        calls.append(len(seq_ids))
        return real(seq_ids, prompts, *lasts)

    engine.runner.prefill_together = counted
    return calls


@pytest.mark.parametrize("arrivals", [[0] * 8, ARRIVAL_STEP], ids=["at-once", "staggered"])
@pytest.mark.parametrize("together", [2, 8])
def test_prompts_prefilled_together_equal_one_at_a_time(loaded, reference, arrivals, together):
    """Prompts of 1 to 64 tokens, left-padded into one forward: every sequence's greedy tokens are its solo run's."""
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        EngineConfig(
            max_batch_size=8, storage="paged", block_size=8, prefill_batch_size=together, prefill_chunk_size=2048
        ),  # (a chunk that takes all eight prompts padded, whatever the backend's default)
    )
    calls = _count_together(engine)
    params = [SamplingParams(max_tokens=n) for n in MAX_TOKENS]
    assert drive(engine, PROMPTS, arrivals, params) == reference
    assert calls and max(calls) <= together and (arrivals == ARRIVAL_STEP or max(calls) == together)
    assert engine.storage.stats()["blocks_free"] == engine.storage.pool.num_blocks  # nothing leaked


def test_prompts_together_logits_match_solo_prefill(loaded):
    """The first token's logits of each padded row against its prompt prefilled alone (float32 model)."""
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        EngineConfig(max_batch_size=4, storage="paged", block_size=8, prefix_cache=False),
    )
    prompts = [PROMPTS[i] for i in (0, 1, 2, 3)]  # 5, 17, 1 and 40 tokens
    seq_ids = tuple(range(4))
    for seq_id, prompt in zip(seq_ids, prompts):
        engine.storage.add(seq_id, prompt)
    together = engine.runner.prefill_together(seq_ids, prompts)
    for seq_id, prompt in zip(seq_ids, prompts):
        alone = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=4, storage="paged", block_size=8))
        alone.storage.add(0, prompt)
        want = alone.runner.prefill(0, prompt, 0, True)
        assert mx.allclose(together[seq_id], want[0], rtol=1e-4, atol=1e-4).item()


def test_prompts_together_respect_the_budget_and_the_prefix_cache(loaded):
    """Padded size (prompts x the longest) within prefill_chunk_size; a prompt whose start came from the prefix
    cache is prefilled on its own; tokens as one at a time."""
    shared = PROMPTS[7][:48]
    prompts = [shared + [5, 6], shared + [9], PROMPTS[0], PROMPTS[2]]
    solo_runs = [
        drive(
            Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=1)),
            [p],
            [0],
            [SamplingParams(max_tokens=6)],
        )[0]
        for p in prompts
    ]
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        EngineConfig(max_batch_size=4, storage="paged", block_size=16, prefill_batch_size=4, prefill_chunk_size=64),
    )
    calls = _count_together(engine)
    drive(engine, [prompts[0]], [0], [SamplingParams(max_tokens=6)])  # its blocks go to the prefix cache
    assert calls == []  # alone
    got = drive(engine, prompts, [0] * 4, [SamplingParams(max_tokens=6)] * 4)
    assert got == dict(enumerate(solo_runs))
    # prompts[0] and [1] start from cached blocks (alone each); [2] (5 tokens) and [3] (1) go together: 2 x 5 <= 64
    assert calls == [2] and engine.storage.stats()["prefix_hits"] == 2


def test_prefill_batch_setting():
    default = backends.current().prefill_batch()  # 8 on a GPU, 1 on CPU (the next test)
    assert EngineConfig(max_batch_size=8).resolved_prefill_batch == default
    assert EngineConfig(max_batch_size=8, prefill_batch_size=3).resolved_prefill_batch == 3
    assert EngineConfig(max_batch_size=8, storage="dense").resolved_prefill_batch == 1  # paged only
    assert EngineConfig(max_batch_size=8, kv_bits=8).resolved_prefill_batch == 1  # unquantized pools only


def test_prefill_batch_default_follows_the_backend(monkeypatch):
    """8 on a GPU (one pass of the weights for several prompts), 1 on CPU (compute-bound: each prompt would wait)."""
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    assert EngineConfig(max_batch_size=8).resolved_prefill_batch == 1
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert EngineConfig(max_batch_size=8).resolved_prefill_batch == GPU_PREFILL_BATCH == 8
    assert EngineConfig(max_batch_size=8, kv_bits=8).resolved_prefill_batch == 1


def test_a_tensor_parallel_rank_ignores_the_backend_default(loaded, monkeypatch):
    """Every rank must plan the same forwards; a rank on another host may not share the leader's backend."""
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))  # a default of 8
    config = EngineConfig(max_batch_size=8, storage="paged", compile_decode=False)
    assert Engine(loaded.model, loaded.tokenizer, config).scheduler.config.prefill_batch_size == 8
    monkeypatch.setenv("MLX_RANK", "0")
    assert Engine(loaded.model, loaded.tokenizer, config).scheduler.config.prefill_batch_size == 1
    explicit = EngineConfig(max_batch_size=8, storage="paged", prefill_batch_size=4)  # the same on every rank
    assert Engine(loaded.model, loaded.tokenizer, explicit).scheduler.config.prefill_batch_size == 4


def test_a_whole_batch_goes_as_its_two_arrays(loaded, reference, monkeypatch):
    """A decode step whose rows are all sampled greedily submits the batch's token and readout arrays, not a slice per
    row, and the next step takes that token array as it is; the tokens stay the rows' own."""
    from mlxcel_core.engine import engine as engine_module

    submitted, concatenated = [], []
    real_eval, real_concat = mx.async_eval, mx.concatenate
    monkeypatch.setattr(
        engine_module.mx, "async_eval", lambda arrays: submitted.append(len(arrays)) or real_eval(arrays)
    )

    def concatenate(xs, *args, **kwargs):  # (the engine's concatenations of rows: along the first axis)
        if not args and not kwargs:
            concatenated.append(len(xs))
        return real_concat(xs, *args, **kwargs)

    monkeypatch.setattr(engine_module.mx, "concatenate", concatenate)
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=4, storage="paged", block_size=8))
    params = [SamplingParams(max_tokens=12) for _ in range(4)]
    same = [PROMPTS[0]] * 4  # one length: every step after the prefill decodes all four rows together
    outputs = drive(engine, same, [0] * 4, params)
    assert all(out == reference[0] for out in outputs.values())  # (reference[0]: 12 tokens of PROMPTS[0] alone)
    # Rows that start or end apart (here: after the first prompt's prefill, its cached prefix serves the others)
    # still concatenate; the steps between take the batch's arrays.
    assert submitted.count(2) >= 8 and len(concatenated) < submitted.count(2), (submitted, concatenated)
