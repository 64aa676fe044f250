"""`qmv-multirow` / `hmv-multirow` / `qmm-splits`: the CUDA decode product kernels' launch configurations as tune
ops (autotune/matvec_ops.py): the candidates hold the untuned rules' choices, and the kernels' launches take a stored
winner only where MLXCEL_AUTOTUNE reads the cache (the 16-bit SwiGLU launches from cells of their own, the batch
product's from its rows' 8-row tiles). Measuring needs the CUDA kernels (the last tests)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import autotune.ops as ops
from autotune import matvec_ops
from autotune.matvec_ops import HMV, QMM, QMV, Cell, candidates, default_config, label, shapes_from_config
from autotune.store import Entry, Key, Store
from mlxcel_core.backends.cuda.kernels import hmv, qmm, qmv

Q_CELL = Cell(4096, 4096, 1, 64)
SHAPES = [(4096, 4096), (1024, 4096), (6144, 4096), (4096, 14336), (128256, 4096), (576, 1536), (49152, 576), (64, 96)]


@pytest.fixture(autouse=True)
def clean(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MLXCEL_AUTOTUNE", raising=False)
    clears = (matvec_ops.reset, qmv.launch_args.cache_clear, hmv.launch_args.cache_clear, qmm.launch_args.cache_clear)
    for clear in clears:
        clear()
    yield
    for clear in clears:
        clear()


def store(op: str, cell: Cell, config, dtype="float16", tactic_label=None) -> None:
    Store().save(
        Entry(
            key=Key(op, matvec_ops.runner(op, cell.mode), ops.device_identity(), cell.key(), dtype),
            tactic={
                "label": tactic_label or label(config, op),
                "params": dict(zip(matvec_ops.SPECS[op].fields, config)),
            },
            latency_us=1.0,
            default_tactic={"label": label(default_config(op, cell), op), "params": {}},
            default_latency_us=2.0,
            candidates=[label(c, op) for c in candidates(op, cell)],
            reps=5,
            spread=0.01,
            default_spread=0.01,
            required_improvement=0.02,
        )
    )


def test_the_rules_are_candidates_and_every_candidate_is_launchable():
    for n, k in SHAPES:
        for m in range(1, qmv.MAX_ROWS + 1):
            cells = [(QMV, Cell(n, k, m, 64)), (HMV, Cell(n, k, m)), (HMV, Cell(2 * n, k, m, 0, "swiglu"))]
            assert default_config(QMV, cells[0][1]) == qmv.launch_config(n, k, m)
            assert default_config(HMV, cells[2][1]) == hmv.launch_config(2 * n, k, m, "swiglu_norm")
            for op, cell in cells:
                assert default_config(op, cell) in candidates(op, cell)
                for config in candidates(op, cell):
                    assert qmv.unpack_launch(config)[:3] == config and config[0] % 2 == 0  # even: fused modes


def test_the_batch_products_split_rule_is_a_candidate():
    for n, k in SHAPES:
        for g in (32, 64, 128):
            if k % g == 0:
                cell = Cell(n, k, 16, g)
                assert default_config(QMM, cell) == (qmm.split_k(n, k // g)[1],)
                assert default_config(QMM, cell) in candidates(QMM, cell) and (k // g,) in candidates(QMM, cell)
    from mlxcel_core.backends.cuda.kernels import matvec_config  # (the rule reads it without importing MLX)

    assert qmm.ROWS_PER_BLOCK == matvec_config.QMM_ROWS_PER_BLOCK == 128


def test_a_stored_split_reaches_the_batch_products_launch(monkeypatch):
    store(QMM, Cell(4096, 4096, 24, 64), (16,))
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "cache")
    for m in (17, 24):  # rows 17..24: three 8-row tiles, one cell
        args = qmm.launch_args((m, 4096), mx.float16, mx.float16, 4096, 4096, 64)
        assert args["grid"][1] == 4 and ("GPS", 16) in args["template"]  # 64 groups in 4 splits of 16
    rule = qmm.split_k(4096, 64)
    args = qmm.launch_args((32, 4096), mx.float16, mx.float16, 4096, 4096, 64)  # another cell: the rule's
    assert args["grid"][1] == rule[0] and ("GPS", rule[1]) in args["template"]


def test_shapes_from_a_config_json():
    config = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336}
    assert shapes_from_config({**config, "vocab_size": 128256}) == list(matvec_ops.LLAMA_3_8B_SHAPES)
    nested = shapes_from_config({"text_config": {**config, "head_dim": 256}})
    assert nested[:3] == [(8192, 4096, "plain"), (2048, 4096, "plain"), (12288, 4096, "plain")]
    with pytest.raises(ValueError, match="hidden_size"):
        shapes_from_config({"num_attention_heads": 4})


def test_off_takes_the_rules_and_never_reads_the_cache(monkeypatch):
    store(QMV, Q_CELL, (8, 1, 1))
    monkeypatch.setattr(Store, "load", lambda *a, **k: pytest.fail("read the cache while off"))
    assert qmv.chosen_config(4096, 4096, 1, 64, mx.float16) == qmv.launch_config(4096, 4096, 1)
    assert hmv.chosen_config(4096, 4096, 1, "plain", mx.float16) == hmv.launch_config(4096, 4096, 1)


@pytest.mark.parametrize("mode", ["cache", "1"])
def test_a_stored_4_bit_winner_reaches_the_launch(monkeypatch, mode):
    store(QMV, Q_CELL, (8, 1, 1))
    monkeypatch.setenv("MLXCEL_AUTOTUNE", mode)
    assert qmv.chosen_config(4096, 4096, 1, 64, mx.float16) == (8, 1, 1)
    assert qmv.chosen_config(4096, 4096, 1, 64, mx.bfloat16) == qmv.launch_config(4096, 4096, 1)  # other dtype
    assert qmv.chosen_config(4096, 4096, 2, 64, mx.float16) == qmv.launch_config(4096, 4096, 2)  # other rows
    for kernel_mode in ("plain", "swiglu", "qkv"):  # one cell for every mode of the 4-bit kernel
        args = qmv.launch_args((1, 4096), mx.float16, mx.float16, 4096, 64, mode=kernel_mode, split=(2048, 1024))
        assert args["threadgroup"] == (32, 1, 1)  # 1 warp a block: the stored winner's


def test_the_16_bit_swiglu_launches_take_their_own_cell(monkeypatch):
    store(HMV, Cell(4096, 4096, 1), (4, 2, 1))
    store(HMV, Cell(4096, 4096, 1, 0, "swiglu"), (2, 1, 2))
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "cache")
    assert hmv.chosen_config(4096, 4096, 1, "plain", mx.float16) == (4, 2, 1)
    assert hmv.chosen_config(4096, 4096, 1, "residual", mx.float16) == (4, 2, 1)
    assert hmv.chosen_config(4096, 4096, 1, "swiglu_norm", mx.float16) == (2, 1, 2)
    assert hmv.launch_args((1, 4096), mx.float16, mx.float16, 4096, mode="swiglu")["threadgroup"] == (32, 1, 1)


def test_a_bad_stored_tactic_warns_and_takes_the_rule(monkeypatch, capsys):
    store(QMV, Q_CELL, (3, 1, 1), tactic_label=label((2, 1, 1)))
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "cache")
    assert qmv.chosen_config(4096, 4096, 1, 64, mx.float16) == qmv.launch_config(4096, 4096, 1)
    assert "bad tactic" in capsys.readouterr().err


def test_an_unknown_mode_warns_once(monkeypatch, capsys):
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "sometimes-" + str(id(capsys)))  # (a value no other test cached)
    for n in (4096, 1024, 6144):
        assert qmv.chosen_config(n, 4096, 1, 64, mx.float16) == qmv.launch_config(n, 4096, 1)
    assert capsys.readouterr().err.count("is not one of") == 1


@pytest.mark.skipif(not qmv.kernel_ready(), reason="needs MLX's CUDA backend and a CUDA device")
@pytest.mark.parametrize(
    "op, cell",
    [(QMV, Cell(1024, 4096, 2, 64)), (HMV, Cell(2048, 4096, 2, 0, "swiglu")), (QMM, Cell(4096, 4096, 16, 64))],
)
def test_tuning_a_cell_stores_a_winner_the_kernel_then_computes_with(monkeypatch, op, cell):
    from autotune.profiler import ProfileSettings

    default, result = matvec_ops.profile_cell(op, cell, "float16", ProfileSettings(sample_ms=20))
    assert result.usable and not result.dropped and default == default_config(op, cell)
    entry = matvec_ops.entry_from_result(op, cell, ops.device_identity(), "float16", default, result)
    Store().save(entry)
    monkeypatch.setenv("MLXCEL_AUTOTUNE", "cache")
    winner = tuple(entry.tactic["params"][k] for k in matvec_ops.SPECS[op].fields)
    w = (mx.random.normal((cell.n, cell.k), key=mx.random.key(1)) * 0.02).astype(mx.float16)
    x = mx.random.normal((cell.m, cell.k), key=mx.random.key(2)).astype(mx.float16)
    if op in (QMV, QMM):
        wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
        want = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=4)
        if op == QMV:
            assert qmv.chosen_config(cell.n, cell.k, cell.m, 64, mx.float16) == winner
            got = qmv.quantized_matvec(x, wq, scales, biases, 64)
        else:
            assert qmm.chosen_gps(cell.n, cell.k, cell.m, 64, mx.float16) == winner[0]
            got = qmm.quantized_matmul(x, wq, scales, biases, 64)
    else:
        assert hmv.chosen_config(cell.n, cell.k, cell.m, "swiglu", mx.float16) == winner
        got = hmv.launch(hmv.launch_args(x.shape, x.dtype, w.dtype, cell.n, mode="swiglu"), x, w, "swiglu")
        want = hmv.launch(hmv.launch_args(x.shape, x.dtype, w.dtype, cell.n, default, mode="swiglu"), x, w, "swiglu")
    np.testing.assert_allclose(np.array(got, np.float32), np.array(want, np.float32), atol=3e-2, rtol=1e-2)
