"""PagedStorage's prefill views: a sequence's first chunk attends over its own keys, later chunks gather."""

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_core.cache import kv_group_size
from mlxcel_core.engine.paged import PagedStorage
from mlxcel_core.models.base import causal_mask, scaled_dot_product_attention


def _qkv(length, seed, heads=4, kv_heads=2, dim=8):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    return (
        mx.random.normal((1, heads, length, dim), key=k1),
        mx.random.normal((1, kv_heads, length, dim), key=k2),
        mx.random.normal((1, kv_heads, length, dim), key=k3),
    )


def _gathered_reference(storage, view, queries, start, length, scale, window, softcap):
    """What a prefill chunk computed before the first-chunk shortcut: attend over the blocks read back."""
    keys, values = storage.gather(storage.pools[view.layer], view.blocks, queries.dtype)
    total = start + length
    mask = causal_mask(length, total, None, window)
    return scaled_dot_product_attention(queries, keys[:, :, :total], values[:, :, :total], scale, mask, softcap)


@pytest.mark.parametrize("window, softcap", [(None, None), (4, None), (None, 5.0)])
def test_first_and_later_chunks_equal_attention_over_the_blocks(window, softcap):
    storage = PagedStorage(num_layers=1, block_size=4, kv_budget_tokens=64)
    storage.add(0, list(range(16)))
    for start, length, seed in ((0, 10, 1), (10, 6, 2)):  # a first chunk of 10, then one of 6 (gathers)
        (view,) = storage.prefill_caches(0, start, length)
        q, k, v = _qkv(length, seed)
        out = view.attend(q, k, v, 0.5, window=window, softcap=softcap)
        expected = _gathered_reference(storage, view, q, start, length, 0.5, window, softcap)
        assert mx.array_equal(out, expected), (start, mx.abs(out - expected).max())
        keys, _ = storage.gather(storage.pools[0], view.blocks, q.dtype)
        assert mx.array_equal(keys[:, :, start : start + length], k)  # the blocks hold the chunk either way


def test_combine_counters_are_made_with_the_storage_and_a_prefill_syncs_nothing(monkeypatch):
    """The counters exist, evaluated, from construction (one mx.eval for all layers), so a first prefill makes no
    host sync of its own: made there, they cost one eval a layer in the request's TTFT."""
    from mlxcel_core import backends
    from mlxcel_core.backends.base import Backend
    from mlxcel_core.backends.cuda.backend import CudaBackend
    from mlxcel_core.backends.cuda.paged_attention import COUNTERS
    from mlxcel_core.engine import paged

    monkeypatch.setattr(backends, "_current", CudaBackend())  # as on CUDA: the kernel would run
    evals = []
    real_eval = paged.mx.eval
    monkeypatch.setattr(paged.mx, "eval", lambda *arrays: (evals.append(arrays), real_eval(*arrays)))
    storage = PagedStorage(num_layers=3, block_size=4, kv_budget_tokens=64)
    assert len(evals) == 1
    assert [(c.shape, c.dtype) for c in storage.combine_counters] == [((COUNTERS,), mx.int32)] * 3
    storage.add(0, list(range(6)))
    for seed, view in enumerate(storage.prefill_caches(0, 0, 6)):
        view.attend(*_qkv(6, seed), 0.5)
    assert len(evals) == 1
    monkeypatch.setattr(backends, "_current", Backend())  # the portable backend keeps none
    assert PagedStorage(num_layers=3).combine_counters == [None] * 3 and len(evals) == 1


def test_pools_start_small_and_grow_by_doubling():
    storage = PagedStorage(num_layers=1, block_size=2, kv_budget_tokens=1000)
    storage.add(0, list(range(10)))
    (view,) = storage.prefill_caches(0, 0, 10)
    q, k, v = _qkv(10, 3)
    view.attend(q, k, v, 0.5)
    assert storage.pool_rows == 64 and storage.pools[0][0].shape[0] == 64
    storage.add(1, list(range(200)))  # blocks 5..104: the pools double to 128 blocks, the old rows kept
    (view1,) = storage.prefill_caches(1, 0, 200)
    q1, k1, v1 = _qkv(200, 4)
    view1.attend(q1, k1, v1, 0.5)
    assert storage.pool_rows == 128 and [p.shape[0] for p in storage.pools[0]] == [128, 128]
    keys, _ = storage.gather(storage.pools[0], view.blocks, q.dtype)
    assert mx.array_equal(keys[:, :, :10], k)  # the first sequence's keys survived the growth
    assert storage.pool.num_blocks < 1024 and storage.pool_rows <= storage.pool.num_blocks


def test_decoding_across_a_pool_growth_gives_the_dense_tokens(tiny_llama_dir):
    """A 100-token prompt and 60 new tokens in 2-token blocks: the pools grow from 64 to 128 blocks mid-decode,
    op by op and compiled; greedy tokens equal dense storage's."""
    from mlxcel_core.api import stream_generate
    from mlxcel_core.engine import EngineConfig
    from mlxcel_core.loading import load_model
    from mlxcel_core.sampling import SamplingParams

    loaded = load_model(str(tiny_llama_dir), log=lambda m: None)
    loaded.tokenizer.eos_token_ids = set()
    prompt = [(7 * i) % 200 + 3 for i in range(100)]

    def tokens(**config):
        return [
            c.token
            for c in stream_generate(
                loaded, prompt, SamplingParams(max_tokens=60), EngineConfig(max_batch_size=1, **config)
            )
            if c.token is not None
        ]

    dense = tokens(storage="dense", compile_decode=False)
    assert len(dense) == 60
    for compiled in (False, True):
        assert tokens(storage="paged", block_size=2, compile_decode=compiled) == dense, compiled


def _flat_slot_write(pools, slots, parts):
    """The oracle: each part scattered into its pool viewed as flat slots [blocks * block_size, ...]."""
    out = []
    for pool, part in zip(pools, parts):
        flat = pool.reshape(-1, *pool.shape[2:])
        flat[slots] = part.astype(pool.dtype)
        out.append(flat.reshape(pool.shape))
    return out


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_writing_by_block_and_offset_equals_writing_by_flat_slot(kv_bits):
    """PagedStorage.write takes each row's slot as (block, offset); the pools must come out exactly as a flat-slot
    scatter leaves them, and the pools written over must stay as they were."""
    for slots in ([0], [13], [3, 4, 13]):
        storage = PagedStorage(num_layers=1, block_size=4, kv_budget_tokens=64, kv_bits=kv_bits)
        storage.pool_rows = 4
        keys, values = (mx.random.normal((len(slots), 2, 64), key=mx.random.key(i)) for i in (1, 2))
        # something already there (distinct slots: a GPU scatter of several rows into one slot keeps any of them)
        first = mx.arange(5, 5 + len(slots), dtype=mx.int32)
        before = storage.write(0, (first // 4, first % 4), keys, values)
        mx.eval(before)
        kept = [mx.array(np.array(p)) for p in before]
        at = mx.array(slots, dtype=mx.int32)
        written = storage.write(0, (at // 4, at % 4), keys * 2, values * 3)
        parts = [keys * 2, values * 3]
        if kv_bits is not None:
            parts = [p for x in parts for p in mx.quantize(x, group_size=kv_group_size(64), bits=kv_bits)]
        expected = _flat_slot_write(kept, at, parts)
        assert len(written) == len(expected)
        for got, want in zip(written, expected):
            assert mx.array_equal(got, want), slots
        assert all(mx.array_equal(a, b) for a, b in zip(before, kept))


def test_decode_views_carry_each_rows_block_and_offset():
    storage = PagedStorage(num_layers=1, block_size=4, kv_budget_tokens=64, max_batch_size=2)
    for seq, length in ((0, 6), (1, 9)):
        storage.add(seq, list(range(length)))
        storage.prefill_caches(seq, 0, length)
    (view,) = storage.decode_caches([0, 1])
    blocks, offsets = (a.tolist() for a in view.slots)
    expected = [divmod(storage.tables[s].slot(p), 4) for s, p in ((0, 6), (1, 9))]
    assert list(zip(blocks, offsets)) == expected and view.offset.tolist() == [6, 9]


def test_steps_that_wrote_in_place_are_submitted_before_the_next_views(monkeypatch):
    """The CUDA kernel's in-place KV writes are invisible to MLX's graph: PagedStorage submits the arrays of such
    steps (mx.async_eval) before handing out any prefill, extension or decode views, so a pool update built after
    them runs after them."""
    from mlxcel_core.engine import paged

    submitted = []
    monkeypatch.setattr(paged.mx, "async_eval", lambda arrays: submitted.append(list(arrays)))
    storage = PagedStorage(num_layers=1, block_size=4, kv_budget_tokens=64)
    storage.add(0, list(range(6)))
    storage.prefill_caches(0, 0, 6)
    assert submitted == []  # nothing written in place yet: no call
    for make_views in (
        lambda: storage.decode_caches([0]),
        lambda: storage.extend_caches(0, 2),
        lambda: storage.prefill_caches(0, 8, 1),
    ):
        step = mx.array([1.0])
        storage.written_in_place.append(step)
        make_views()
        assert len(submitted[-1]) == 1 and submitted[-1][0] is step and storage.written_in_place == []
    assert len(submitted) == 3


def test_a_compiled_paged_step_leaves_its_logits_to_submit_and_no_tracers(tiny_llama_dir):
    from mlxcel_core.engine.compiled_decode import CompiledDecoder
    from mlxcel_core.loading import load_model

    lm = load_model(str(tiny_llama_dir), log=lambda m: None)
    storage = PagedStorage(num_layers=len(lm.model.layers), block_size=4, kv_budget_tokens=64, pad_block_tables=True)
    storage.add(0, [3, 4, 5])
    lm.model(mx.array([[3, 4, 5]]), storage.prefill_caches(0, 0, 3))
    decoder = CompiledDecoder(lm.model)
    logits = decoder.decode(mx.array([6]), storage.decode_caches([0]))
    assert len(storage.written_in_place) == 1 and storage.written_in_place[0] is logits
    mx.eval(storage.written_in_place)  # real arrays, not tracers of the compiled trace


def test_decode_views_route_to_the_kernel_as_on_cuda(monkeypatch, tiny_llama_dir):
    """DecodeView's kernel branch, run on CPU with a backend whose kernel is a stand-in (the ops path, writing new_kv
    into the pools as the CUDA kernel does in place): the kernel gets the step's keys and values and the layer's
    counters; the greedy tokens are the ops path's."""
    from mlxcel_core import backends
    from mlxcel_core.backends.base import Backend
    from mlxcel_core.backends.cuda.backend import CudaBackend
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.kv.paged_attention import paged_decode_attention
    from mlxcel_core.loading import load_model
    from mlxcel_core.sampling import SamplingParams

    def run():
        # A model of its own per run: on CUDA decode steps are compiled, and a trace made by the reference run
        # would replay the ops path without calling the stand-in.
        lm = load_model(str(tiny_llama_dir), log=lambda m: None)
        greedy = SamplingParams(max_tokens=12, suppress_tokens=tuple(lm.tokenizer.eos_token_ids))
        engine = Engine(lm.model, lm.tokenizer, EngineConfig(max_batch_size=1, storage="paged"))
        seq = engine.open(list(range(3, 23)), greedy)
        while engine.has_work():
            engine.step()
        return engine.sequence(seq).output_ids

    monkeypatch.setattr(backends, "_current", Backend())  # on CUDA too: the reference is the ops path
    want = run()
    calls = []

    def kernel_stand_in(q, k_pool, v_pool, tables, lens, num_splits=1, scale=None, new_kv=None, counters=None):
        calls.append((new_kv is not None, counters))
        if new_kv is not None:  # in place: the storage's pool arrays themselves take the step's keys and values
            k, v, blocks, offsets = new_kv
            k_pool[blocks, offsets] = k
            v_pool[blocks, offsets] = v
        return paged_decode_attention(q, k_pool, v_pool, tables, lens, num_splits=num_splits, scale=scale)

    class StandIn(Backend):
        kv_written_in_kernel = True
        combine_counters = CudaBackend.combine_counters

        def paged_runner(self, head_dim):
            return "cuda-kernel-stand-in"

        def paged_attention(self, runner):
            return kernel_stand_in

    monkeypatch.setattr(backends, "_current", StandIn())
    assert run() == want
    assert calls and all(writes for writes, _ in calls)
    assert all(c is not None and c.dtype == mx.int32 and not mx.any(c).item() for _, c in calls)
