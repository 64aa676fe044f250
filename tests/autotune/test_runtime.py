"""How num_splits is chosen at run time: env > fixed > cache (per MLXCEL_AUTOTUNE) > heuristic, and that the
engine's paged decode attention really receives the chosen value."""

from __future__ import annotations

import functools

import pytest
from tiny_models import save_tiny_llama

import autotune.ops as ops
import autotune.profiler as profiler
from autotune import runtime
from autotune.ops import OP, Bucket, Geometry, candidates, default_splits, label
from autotune.runtime import SplitsChooser, env_splits
from autotune.store import Entry, Key, Store

GEO = Geometry(head_dim=32, q_heads=4, kv_heads=2, block_size=8)
SHAPE = dict(batch=3, context=50, q_heads=4, kv_heads=2, head_dim=32, block_size=8, dtype="float32", runner="mlx-ops")
BUCKET = Bucket.of(3, 50, GEO)  # b4 x c64: candidates 1, 2, 4, 8; heuristic 1


@pytest.fixture(autouse=True)
def clean(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MLXCEL_AUTOTUNE", raising=False)
    monkeypatch.delenv("MLXCEL_PAGED_DECODE_SPLITS", raising=False)
    runtime.reset()
    yield
    runtime.reset()


def store_tactic(bucket: Bucket, splits: int, runner="mlx-ops", dtype="float32") -> None:
    labels = [label(s) for s in candidates(bucket, runner)]
    Store().save(
        Entry(
            key=Key(OP, runner, ops.device_identity(), bucket.key(), dtype),
            tactic={"label": label(splits), "params": {"num_splits": splits}},
            latency_us=1.0,
            default_tactic={"label": "num_splits=1", "params": {"num_splits": 1}},
            default_latency_us=2.0,
            candidates=labels,
            reps=5,
            spread=0.0,
            default_spread=0.0,
            required_improvement=0.02,
        )
    )


def count_loads(monkeypatch) -> list:
    loads = []
    real = Store.load

    def spy(self, key, candidates=None):
        loads.append(key)
        return real(self, key, candidates)

    monkeypatch.setattr(Store, "load", spy)
    return loads


def test_bucket_rounding_candidates_and_heuristic():
    assert BUCKET == Bucket(4, 64, 4, 2, 32, 8)
    assert candidates(BUCKET, "mlx-ops") == [1, 2, 4, 8]
    assert candidates(Bucket.of(1, 20000, Geometry()), "mlx-ops") == [1, 2, 4, 8, 16, 32]
    assert candidates(Bucket.of(1, 20000, Geometry()), "cuda-kernel-x") == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert candidates(Bucket.of(1, 5, Geometry(block_size=32)), "cuda-kernel-x") == [1]
    assert candidates(Bucket(1, 96, 4, 2, 32, 32), "mlx-ops") == [1, 2, 3]  # the cap itself when not a power of two
    ops_defaults = [
        default_splits(Bucket.of(1, c, Geometry()), "mlx-ops", "bfloat16") for c in (1024, 4096, 8192, 16384)
    ]
    assert ops_defaults == [1, 2, 4, 8]
    cells = ((1, 1024), (1, 32768), (8, 4096), (8, 16384))
    cuda = [default_splits(Bucket.of(b, c, Geometry()), "cuda-kernel-x", "bfloat16") for b, c in cells]
    # The tensor-core body's head dims: batch 1: 8 kv heads x 16 splits (64 tokens each), 32 at 32k (256 blocks: one
    # wave); batch 8: 64 blocks x 4. The lane groups' (head dim 256): 16 and 64 splits, 8 at batch 8 (512 blocks).
    assert cuda == [16, 32, 4, 4]
    lanes = [default_splits(Bucket.of(b, c, Geometry(head_dim=256)), "cuda-kernel-x", "bfloat16") for b, c in cells]
    assert lanes == [16, 64, 8, 8]
    # A float32 model runs the lane groups at every head dim, and gets their rule.
    assert [default_splits(Bucket.of(b, c, Geometry()), "cuda-kernel-x", "float32") for b, c in cells] == lanes
    assert [default_splits(Bucket.of(b, c, Geometry()), "cuda-kernel-x", "float16") for b, c in cells] == cuda
    # One block a split (one kv head, one query head): the tensor-core body's splits stay within what its last block
    # merges in one launch, 2 x head dim.
    narrow = Bucket.of(1, 32768, Geometry(head_dim=32, q_heads=1, kv_heads=1))
    assert default_splits(narrow, "cuda-kernel-x", "float16") == 64
    for b in (1, 8):
        for c in (64, 1024, 16384):
            for runner in ("mlx-ops", "cuda-kernel-x"):
                bucket = Bucket.of(b, c, Geometry())
                for dtype in ("bfloat16", "float32"):
                    assert default_splits(bucket, runner, dtype) in candidates(bucket, runner)


def test_env_splits_parsing(capsys):
    assert env_splits("") is None and env_splits("4") == 4
    assert env_splits("0") is None and env_splits("x") is None
    assert capsys.readouterr().err.count("MLXCEL_PAGED_DECODE_SPLITS") == 2


def test_off_never_touches_the_cache(monkeypatch, tmp_path):
    store_tactic(BUCKET, 8)
    loads = count_loads(monkeypatch)
    for value in (None, "0", "off"):
        if value is not None:
            monkeypatch.setenv("MLXCEL_AUTOTUNE", value)
        assert SplitsChooser()(**SHAPE) == 1  # the heuristic, although the cache says 8
    assert loads == []


def test_off_creates_nothing(tmp_path):
    assert SplitsChooser()(**SHAPE) == 1
    assert not (tmp_path / "autotune").exists()


def test_cache_mode_reads_the_winner_and_never_writes(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "cache")
    assert SplitsChooser()(**SHAPE) == 1  # miss: heuristic
    assert not (tmp_path / "autotune").exists()  # a miss writes nothing
    runtime.reset()
    store_tactic(BUCKET, 8)
    assert SplitsChooser()(**SHAPE) == 8
    assert SplitsChooser()(**{**SHAPE, "batch": 4, "context": 64}) == 8  # same bucket
    assert SplitsChooser()(**{**SHAPE, "dtype": "float16"}) == 1  # another dtype: a miss


def test_lookup_happens_once_per_bucket_per_process(monkeypatch):
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "cache")
    store_tactic(BUCKET, 4)
    loads = count_loads(monkeypatch)
    chooser = SplitsChooser()
    for _ in range(5):
        assert chooser(**SHAPE) == 4
    assert SplitsChooser()(**{**SHAPE, "context": 60}) == 4  # another chooser, same bucket
    assert len(loads) == 1
    SplitsChooser()(**{**SHAPE, "context": 200})  # another bucket
    assert len(loads) == 2


def test_unknown_mode_warns_and_is_off(monkeypatch, capsys):
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "maybe")
    store_tactic(BUCKET, 8)
    assert SplitsChooser()(**SHAPE) == 1
    assert "MLXCEL_AUTOTUNE='maybe'" in capsys.readouterr().err


def test_tune_mode_profiles_a_miss_once_stores_it_and_logs(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "1")
    monkeypatch.setattr(
        profiler, "ProfileSettings", functools.partial(profiler.ProfileSettings, warmup_ms=1, sample_ms=10)
    )
    calls = []
    real = ops.profile_cell
    monkeypatch.setattr(ops, "profile_cell", lambda *a, **k: calls.append(a) or real(*a, **k))
    n = SplitsChooser()(**SHAPE)
    assert n in candidates(BUCKET, "mlx-ops")
    assert len(calls) == 1 and calls[0][:2] == (4, 64)  # measured at the bucket's shape
    err = capsys.readouterr().err
    assert "mlxcel: autotune: tuning paged-decode-splits b4xc64xhq4xhkv2xd32xbs8 float32" in err
    assert "saved to" in err
    files = list((tmp_path / "autotune").glob("*.json"))
    assert len(files) == 1
    SplitsChooser()(**SHAPE)
    assert len(calls) == 1  # once per bucket per process
    runtime.reset()
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "cache")
    assert SplitsChooser()(**SHAPE) == n  # a later process reads what was stored


def test_tune_mode_measures_nothing_in_a_dry_run_and_tunes_after_it(monkeypatch):
    """A dry run's kernels give zeros (backends/cuda/kernels/compile_ahead.py): a miss then takes the heuristic and
    is not remembered, so the first use after it tunes."""
    from mlxcel_core import backends
    from mlxcel_core.backends.base import Backend

    class Dry(Backend):
        dry = True

        def in_dry_run(self):
            return self.dry

    backend = Dry()
    monkeypatch.setattr(backends, "_current", backend)
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "1")
    calls = []
    monkeypatch.setattr(ops, "profile_cell", lambda *a, **k: calls.append(a) or (_ for _ in ()).throw(MemoryError()))
    assert SplitsChooser()(**SHAPE) == default_splits(BUCKET, "mlx-ops", SHAPE["dtype"]) and calls == []
    backend.dry = False
    SplitsChooser()(**SHAPE)
    assert len(calls) == 1


def test_tune_mode_failure_falls_back_to_the_heuristic(monkeypatch, capsys):
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "on")

    def boom(*a, **k):
        raise MemoryError("out of memory")

    monkeypatch.setattr(ops, "profile_cell", boom)
    assert SplitsChooser()(**SHAPE) == 1
    assert "tuning paged-decode-splits" in capsys.readouterr().err


def test_env_beats_fixed_and_cache(monkeypatch):
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "cache")
    store_tactic(BUCKET, 8)
    assert SplitsChooser(fixed=2)(**SHAPE) == 2
    monkeypatch.setenv("MLXCEL_PAGED_DECODE_SPLITS", "3")
    assert SplitsChooser()(**SHAPE) == 3
    assert SplitsChooser(fixed=2)(**SHAPE) == 3


# -- the engine ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mlxcel_core.loading import load_model

    lm = load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny"))), log=lambda m: None)
    lm.tokenizer.eos_token_ids = set()
    return lm


def run_engine(tiny, monkeypatch):
    """Decode 2 rows on paged storage (block 8); returns the num_splits each paged_decode_attention call got."""
    from mlxcel_core import backends
    from mlxcel_core.backends.base import Backend
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.sampling import SamplingParams

    seen = []

    class Spying(Backend):
        def paged_attention(self, runner):
            real = super().paged_attention(runner)

            def spy(*args, **kwargs):
                seen.append(kwargs["num_splits"])
                return real(*args, **kwargs)

            return spy

    previous = backends.use(Spying())
    engine = Engine(
        tiny.model, tiny.tokenizer, EngineConfig(max_batch_size=2, storage="paged", block_size=8, compile_decode=False)
    )
    for prompt in (list(range(5, 17)), list(range(20, 30))):  # > one block: at least 2 split candidates
        engine.open(prompt, SamplingParams(max_tokens=6))
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
    backends.use(previous)
    return seen


def engine_buckets(tiny, monkeypatch):
    """The (bucket, runner, dtype) the engine looks up, from a cache-mode run with an empty cache."""
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "cache")
    asked = []
    real = SplitsChooser._lookup
    monkeypatch.setattr(
        SplitsChooser, "_lookup", staticmethod(lambda b, r, d, t: asked.append((b, r, t)) or real(b, r, d, t))
    )
    seen = run_engine(tiny, monkeypatch)
    monkeypatch.setattr(SplitsChooser, "_lookup", staticmethod(real))
    runtime.reset()
    return sorted(set(asked), key=str), seen


def test_engine_passes_the_cached_tactic_to_paged_decode_attention(tiny, monkeypatch):
    buckets, seen = engine_buckets(tiny, monkeypatch)
    assert buckets and set(seen) == {1}  # empty cache: the heuristic
    for bucket, runner, dtype in buckets:
        assert runner == "mlx-ops" and candidates(bucket, runner)[-1] >= 2
        store_tactic(bucket, 2, runner, dtype)
    seen = run_engine(tiny, monkeypatch)
    assert seen and set(seen) == {2}  # every decode step of every layer got the stored tactic

    runtime.reset()
    monkeypatch.delenv("MLXCEL_AUTOTUNE")
    assert set(run_engine(tiny, monkeypatch)) == {1}  # unset: the cache is ignored

    runtime.reset()
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "cache")
    monkeypatch.setenv("MLXCEL_PAGED_DECODE_SPLITS", "3")
    assert set(run_engine(tiny, monkeypatch)) == {3}  # the env override beats the cache


def test_engine_tokens_do_not_depend_on_the_tactic(tiny, monkeypatch):
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.sampling import SamplingParams

    def tokens():
        engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_batch_size=2, storage="paged", block_size=8))
        ids = [engine.open(p, SamplingParams(max_tokens=8)) for p in ([5, 6, 7, 8, 9], [10, 11])]
        while engine.has_work():
            engine.step()
        return [engine.sequence(i).output_ids for i in ids]

    base = tokens()
    monkeypatch.setenv("MLXCEL_PAGED_DECODE_SPLITS", "4")
    assert tokens() == base


def test_the_tuner_times_the_inputs_decode_gives_the_kernel(monkeypatch):
    """The step's own keys and values at each row's last slot, and the combine counters, as decode passes them
    on the CUDA backend; the portable backend passes neither."""
    import mlx.core as mx

    from mlxcel_core import backends
    from mlxcel_core.backends.base import Backend
    from mlxcel_core.backends.cuda.backend import CudaBackend

    monkeypatch.setattr(backends, "_current", CudaBackend())  # (monkeypatch restores this process's own)
    geometry = Geometry(q_heads=8, kv_heads=2, head_dim=64, block_size=16)
    q, k_pool, _, tables, _ = ops.workload(3, 40, geometry, "float32")
    inputs = ops.decode_step_inputs(q, k_pool, tables, 40)
    k, v, blocks, offsets = inputs["new_kv"]
    assert k.shape == v.shape == (3, 2, 64) and k.dtype == k_pool.dtype
    assert blocks.tolist() == tables[:, 39 // 16].tolist() and offsets.tolist() == [39 % 16] * 3
    assert inputs["counters"].dtype == mx.int32 and not mx.any(inputs["counters"]).item()
    monkeypatch.setattr(backends, "_current", Backend())
    assert ops.decode_step_inputs(q, k_pool, tables, 40) == {}
