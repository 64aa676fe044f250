"""`qmv-multirow`: the CUDA 4-bit matvec kernel's launch configuration as a tune op (autotune/qmv_op.py): its
candidates hold the untuned rule's choice, and the kernel's launches take a stored winner only where MLXCEL_AUTOTUNE
reads the cache. Measuring needs the CUDA kernel (the last test)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import autotune.ops as ops
from autotune import qmv_op
from autotune.qmv_op import OP, Cell, candidates, default_config, label, shapes_from_config
from autotune.store import Entry, Key, Store
from mlxcel_core.backends.cuda.kernels import qmv

CELL = Cell(4096, 4096, 1, 64)


@pytest.fixture(autouse=True)
def clean(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MLXCEL_AUTOTUNE", raising=False)
    qmv_op.reset()
    qmv.launch_args.cache_clear()
    yield
    qmv_op.reset()
    qmv.launch_args.cache_clear()


def store(cell: Cell, config, dtype="float16", tactic_label=None) -> None:
    params = dict(zip(("rows", "warps", "unroll"), config))
    Store().save(
        Entry(
            key=Key(OP, qmv_op.runner(), ops.device_identity(), cell.key(), dtype),
            tactic={"label": tactic_label or label(config), "params": params},
            latency_us=1.0,
            default_tactic={"label": label(default_config(cell)), "params": {}},
            default_latency_us=2.0,
            candidates=[label(c) for c in candidates(cell)],
            reps=5,
            spread=0.01,
            default_spread=0.01,
            required_improvement=0.02,
        )
    )


def test_the_rule_is_always_a_candidate_and_every_candidate_is_launchable():
    for n, k in [*qmv_op.LLAMA_3_8B_SHAPES, (576, 1536), (49152, 576), (64, 96), (300, 2048)]:
        for m in range(1, qmv_op.MAX_ROWS + 1):
            cell = Cell(n, k, m)
            assert default_config(cell) == qmv.launch_config(n, k, m) in candidates(cell)
            for config in candidates(cell):
                assert qmv.unpack_launch(config)[:3] == config and config[0] % 2 == 0  # (fused modes: even rows)


def test_shapes_from_a_config_json():
    config = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336}
    config["vocab_size"] = 128256
    assert shapes_from_config(config) == [
        (4096, 4096),
        (1024, 4096),
        (6144, 4096),
        (28672, 4096),
        (4096, 14336),
        (128256, 4096),
    ]
    assert shapes_from_config({"text_config": {**config, "head_dim": 256}})[:3] == [
        (8192, 4096),
        (2048, 4096),
        (12288, 4096),
    ]
    with pytest.raises(ValueError, match="hidden_size"):
        shapes_from_config({"num_attention_heads": 4})


def test_off_takes_the_rule_and_never_reads_the_cache(monkeypatch):
    store(CELL, (8, 1, 1))
    monkeypatch.setattr(Store, "load", lambda *a, **k: pytest.fail("read the cache while off"))
    assert qmv.chosen_config(4096, 4096, 1, 64, mx.float16) == qmv.launch_config(4096, 4096, 1)


@pytest.mark.parametrize("mode", ["cache", "1"])
def test_a_stored_winner_reaches_the_launch(monkeypatch, mode):
    store(CELL, (8, 1, 1))
    monkeypatch.setenv("MLXCEL_AUTOTUNE", mode)
    assert qmv.chosen_config(4096, 4096, 1, 64, mx.float16) == (8, 1, 1)
    assert qmv.chosen_config(4096, 4096, 1, 64, mx.bfloat16) == qmv.launch_config(4096, 4096, 1)  # other dtype
    assert qmv.chosen_config(4096, 4096, 2, 64, mx.float16) == qmv.launch_config(4096, 4096, 2)  # other rows
    args = qmv.launch_args((1, 4096), mx.float16, mx.float16, 4096, 64)
    assert args["threadgroup"] == (32, 1, 1) and args["grid"] == (4096 // 8 * 32, 1, 1)  # 1 warp a block, 8 rows


def test_a_bad_stored_tactic_warns_and_takes_the_rule(monkeypatch, capsys):
    store(CELL, (3, 1, 1), tactic_label=label((2, 1, 1)))
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "cache")
    assert qmv.chosen_config(4096, 4096, 1, 64, mx.float16) == qmv.launch_config(4096, 4096, 1)
    assert "bad tactic" in capsys.readouterr().err


def test_an_unknown_mode_warns_once(monkeypatch, capsys):
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "sometimes-" + str(id(capsys)))  # (a value no other test cached)
    for n in (4096, 1024, 6144):
        assert qmv.chosen_config(n, 4096, 1, 64, mx.float16) == qmv.launch_config(n, 4096, 1)
    assert capsys.readouterr().err.count("is not one of") == 1


@pytest.mark.skipif(not qmv.kernel_ready(), reason="needs MLX's CUDA backend and a CUDA device")
def test_tuning_a_cell_stores_a_winner_the_kernel_then_computes_with(monkeypatch):
    from autotune.profiler import ProfileSettings

    cell = Cell(1024, 4096, 2, 64)
    default, result = qmv_op.profile_cell(cell, "float16", ProfileSettings(sample_ms=20))
    assert result.usable and not result.dropped and default == qmv.launch_config(1024, 4096, 2)
    entry = qmv_op.entry_from_result(cell, ops.device_identity(), "float16", default, result)
    Store().save(entry)
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "cache")
    winner = tuple(entry.tactic["params"][k] for k in ("rows", "warps", "unroll"))
    assert qmv.chosen_config(1024, 4096, 2, 64, mx.float16) == winner
    w = (mx.random.normal((1024, 4096), key=mx.random.key(1)) * 0.02).astype(mx.float16)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((2, 4096), key=mx.random.key(2)).astype(mx.float16)
    got = qmv.quantized_matvec(x, wq, scales, biases, 64)
    want = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=4)
    np.testing.assert_allclose(np.array(got, np.float32), np.array(want, np.float32), atol=3e-2, rtol=1e-2)
