"""kernels/qembedding.py: 4-bit and 16-bit embedding lookups as one CUDA launch, against nn.QuantizedEmbedding's and
nn.Embedding's MLX ops.

The kernel tests are skipped where MLX has no usable CUDA backend; what runs elsewhere (MLX's own lookup) and the
compile check (where nvcc is installed) run everywhere. On the device:
python -m pytest tests/mlxcel_core/kernels/test_qembedding.py
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from cuda_compile import CUDA_TYPES, compile_sm90, kernel_file, needs_nvcc

from mlxcel_core.backends.cuda.kernels import qembedding
from mlxcel_core.backends.cuda.kernels.fast_linear import FastEmbedding, FastQuantizedEmbedding
from mlxcel_core.backends.cuda.paged_attention import cuda_kernel_available

needs_cuda = pytest.mark.skipif(not cuda_kernel_available(), reason="needs MLX's CUDA backend and a CUDA device")


def table(vocab: int, dims: int, dtype, group_size: int, seed: int = 0) -> nn.QuantizedEmbedding:
    layer = nn.QuantizedEmbedding(vocab, dims, group_size=group_size, bits=4)
    weight = mx.random.normal((vocab, dims), key=mx.random.key(seed)).astype(dtype)
    layer.weight, layer.scales, layer.biases = mx.quantize(weight, group_size=group_size, bits=4)
    mx.eval(layer.parameters())
    return layer


def test_supported_operands():
    ok = dict(
        ids_shape=(1, 1),
        ids_dtype=mx.uint32,
        w_shape=(1000, 256),
        w_dtype=mx.uint32,
        scales_dtype=mx.bfloat16,
        group_size=64,
        bits=4,
    )
    assert qembedding.shape_supported(**ok)
    assert qembedding.shape_supported(**{**ok, "ids_shape": (2, 4), "ids_dtype": mx.int32})
    for bad in (
        {"ids_shape": (1, qembedding.MAX_IDS + 1)},
        {"ids_shape": (0,)},
        {"ids_dtype": mx.int64},
        {"bits": 8},
        {"group_size": 16},
        {"w_dtype": mx.uint8},
        {"scales_dtype": mx.int32},
    ):
        assert not qembedding.shape_supported(**{**ok, **bad}), bad


def test_fast_embedding_is_mlxs_lookup_where_the_kernel_does_not_run():
    layer = table(300, 128, mx.bfloat16, 64)
    want = layer(mx.array([[5, 299, 0]]))
    layer.__class__ = FastQuantizedEmbedding
    ids = mx.array([[5, 299, 0]])
    assert qembedding.kernel_runs(ids, layer) == (cuda_kernel_available() and mx.default_device() == mx.gpu)
    assert mx.array_equal(layer(ids), want).item()
    many = mx.arange(qembedding.MAX_IDS + 1)[None]  # a prompt: MLX's lookup
    assert not qembedding.kernel_runs(many, layer)
    layer.__class__ = nn.QuantizedEmbedding
    want_many = layer(many)
    layer.__class__ = FastQuantizedEmbedding
    assert mx.array_equal(layer(many), want_many).item()


@needs_nvcc
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=["bf16", "fp16", "f32"])
@pytest.mark.parametrize("group_size", [32, 128])
def test_source_compiles_for_sm90_without_spills(tmp_path, dtype, group_size):
    t = CUDA_TYPES[dtype]
    params = [
        "    const uint32_t* ids",
        "    const uint32_t* w",
        "    const __grid_constant__ Shape w_shape",
        f"    const {t}* scales",
        f"    const {t}* biases",
        f"    {t}* out",
    ]
    template = {"T": dtype, "GS": group_size, "TPB": qembedding.THREADS}
    compile_sm90(tmp_path, kernel_file("mlxcel_qembedding", params, template, qembedding._SOURCE))


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=["bf16", "fp16", "f32"])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_kernel_rows_are_mlxs_bit_for_bit(dtype, group_size):
    """Every id layout a step hands the embedding (uint32 from the greedy kernel, int32 from the host; [1], [B, 1],
    [B, L]) gives exactly nn.QuantizedEmbedding's rows, also for a width that is not a multiple of the block."""
    for vocab, dims in ((1000, 2048), (77, 320)):
        layer = table(vocab, dims, dtype, group_size if dims % group_size == 0 else 32, seed=dims)
        fast = table(vocab, dims, dtype, layer.group_size, seed=dims)
        fast.__class__ = FastQuantizedEmbedding
        for ids in (
            mx.array([vocab - 1], mx.uint32),
            mx.array([[3], [vocab - 2]], mx.int32),
            mx.array([[0, 7], [11, 5], [2, vocab - 1]], mx.uint32),
            (mx.arange(qembedding.MAX_IDS, dtype=mx.uint32) * 37 % vocab).reshape(-1, 1),  # a batch of 64 rows
        ):
            assert qembedding.kernel_runs(ids, fast)
            got = fast(ids)
            want = layer(ids)
            assert got.dtype == want.dtype == dtype and got.shape == want.shape == (*ids.shape, dims)
            assert mx.array_equal(got, want).item(), (vocab, dims, ids.tolist())


@needs_cuda
def test_ids_outside_the_table_are_clamped():
    layer = table(50, 256, mx.bfloat16, 64)
    rows = qembedding.quantized_embedding(
        mx.array([-3, 50, 1000], mx.int32), layer.weight, layer.scales, layer.biases, 64
    )
    assert mx.array_equal(rows, layer(mx.array([0, 49, 49]))).item()


@needs_cuda
@pytest.mark.parametrize(
    "bits, fast, launch, mlx",
    [
        (4, FastQuantizedEmbedding, "quantized_embedding", nn.QuantizedEmbedding),
        (None, FastEmbedding, "embedding", nn.Embedding),
    ],
    ids=["4bit", "bf16"],
)
def test_a_models_decode_lookup_is_the_kernel(monkeypatch, bits, fast, launch, mlx):
    """build_random_model swaps the 1B shape's embedding (4-bit or bf16); a decode step's lookup then runs the
    kernel, with MLX's rows."""
    from mlxcel_core.loading.shapes import build_random_model

    model, _ = build_random_model("llama-3.2-1b", bits=bits, seed=3)
    embed = model.model.embed_tokens
    assert type(embed) is fast
    calls = []
    real = getattr(qembedding, launch)
    monkeypatch.setattr(qembedding, launch, lambda *a: calls.append(a[0].shape) or real(*a))
    ids = mx.array([[17]], mx.uint32)
    assert mx.array_equal(embed(ids), mlx.__call__(embed, ids)).item() and calls == [(1, 1)]


# -- the 16-bit lookup ---------------------------------------------------------------------------------------------


def half_table(vocab: int, dims: int, dtype, seed: int = 0) -> nn.Embedding:
    layer = nn.Embedding(vocab, dims)
    layer.weight = mx.random.normal((vocab, dims), key=mx.random.key(seed)).astype(dtype)
    mx.eval(layer.parameters())
    return layer


def test_half_supported_operands():
    ok = dict(ids_shape=(1, 1), ids_dtype=mx.uint32, w_shape=(1000, 256), w_dtype=mx.bfloat16)
    assert qembedding.half_shape_supported(**ok)
    assert qembedding.half_shape_supported(**{**ok, "ids_shape": (2, 4), "ids_dtype": mx.int32, "w_dtype": mx.float16})
    for bad in (
        {"ids_shape": (1, qembedding.MAX_IDS + 1)},
        {"ids_shape": (0,)},
        {"ids_dtype": mx.int64},
        {"w_dtype": mx.float32},
        {"w_shape": (1000, 260)},
        {"w_shape": (1000,)},
    ):
        assert not qembedding.half_shape_supported(**{**ok, **bad}), bad


def test_fast_half_embedding_is_mlxs_lookup_where_the_kernel_does_not_run():
    layer = half_table(300, 128, mx.bfloat16)
    ids = mx.array([[5, 299, 0]])
    want = layer(ids)
    layer.__class__ = FastEmbedding
    assert qembedding.half_kernel_runs(ids, layer) == (cuda_kernel_available() and mx.default_device() == mx.gpu)
    assert mx.array_equal(layer(ids), want).item()
    many = mx.arange(qembedding.MAX_IDS + 1)[None]  # a prompt: MLX's lookup
    assert not qembedding.half_kernel_runs(many, layer)
    assert mx.array_equal(layer(many), layer.weight[many]).item()


@needs_nvcc
@pytest.mark.parametrize("dtype", qembedding.HALF_TYPES, ids=["bf16", "fp16"])
def test_half_source_compiles_for_sm90_without_spills(tmp_path, dtype):
    t = CUDA_TYPES[dtype]
    params = [
        "    const uint32_t* ids",
        f"    const {t}* w",
        "    const __grid_constant__ Shape w_shape",
        f"    {t}* out",
    ]
    compile_sm90(
        tmp_path, kernel_file("mlxcel_embedding", params, {"TPB": qembedding.THREADS}, qembedding._HALF_SOURCE)
    )


@needs_cuda
@pytest.mark.parametrize("dtype", qembedding.HALF_TYPES, ids=["bf16", "fp16"])
def test_half_kernel_rows_are_mlxs_bit_for_bit(dtype):
    """Every id layout a step hands the embedding gives exactly nn.Embedding's rows, for a width that is not a multiple
    of the block, for ids outside the table (clamped), and for a table that is a view at an offset of 8 bytes (the
    copy a value at a time)."""
    for vocab, dims in ((1000, 2048), (77, 328)):
        layer = half_table(vocab, dims, dtype, seed=dims)
        for ids in (
            mx.array([vocab - 1], mx.uint32),
            mx.array([[3], [vocab - 2]], mx.int32),
            mx.array([[0, 7], [11, 5], [2, vocab - 1]], mx.uint32),
            (mx.arange(qembedding.MAX_IDS, dtype=mx.uint32) * 37 % vocab).reshape(-1, 1),  # a batch of 64 rows
        ):
            assert qembedding.half_kernel_runs(ids, layer)
            got = qembedding.embedding(ids, layer.weight)
            want = layer(ids)
            assert got.dtype == want.dtype == dtype and got.shape == want.shape == (*ids.shape, dims)
            assert mx.array_equal(got, want).item(), (vocab, dims, ids.tolist())
    rows = qembedding.embedding(mx.array([-3, 77, 1000], mx.int32), layer.weight)
    assert mx.array_equal(rows, layer(mx.array([0, 76, 76]))).item()
    flat = mx.random.normal((10 * 64 + 4,)).astype(dtype)
    shifted = flat[4:].reshape(10, 64)  # 8 bytes past a 16-byte boundary
    got = qembedding.embedding(mx.array([9, 0], mx.uint32), shifted)
    assert mx.array_equal(got, shifted[mx.array([9, 0])]).item()
