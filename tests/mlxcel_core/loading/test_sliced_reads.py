"""Tensor-parallel loading reads only each rank's slices from safetensors (issue 10, loading/sliced.py).

In process with a fake group (no collective runs): every rank's parameters equal the matching slices of the
single-process model (fp32, bf16 sharded dir, MLX 4-bit, Mixtral per-expert and fused, Qwen2, Qwen3-MoE);
the bytes read for sharded tensors are exactly the rank's slices (counted at the reader and by the kernel).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from parity import save_tiny_checkpoint
from tiny_models import FakeGroup, save_tiny_llama

from mlxcel_core.loading import load_model, sliced

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output rows split (axis -2; a bias: -1)
ROW = ("o_proj", "down_proj")  # input columns split (axis -1; a bias stays whole)


def _model(path, group=None):
    return load_model(str(path), log=lambda m: None, group=group).model


def _split_axis(name: str) -> int | None:
    """Which axis tensor parallelism splits the parameter `name` along (None: replicated)."""
    parts = name.split(".")
    layer, param = parts[-2], parts[-1]
    if layer in COLUMN:
        return -1 if param == "bias" else -2
    if layer in ROW and param != "bias":
        return -1
    return None


def _expected(name: str, a: mx.array, rank: int, size: int) -> mx.array:
    axis = _split_axis(name)
    if axis is None:
        return a
    axis %= a.ndim
    step = a.shape[axis] // size
    return a[(slice(None),) * axis + (slice(rank * step, (rank + 1) * step),)]


def assert_ranks_are_slices(path, size=2):
    full = dict(tree_flatten(_model(path).parameters()))
    assert any(_split_axis(n) is not None for n in full)
    for rank in range(size):
        part = dict(tree_flatten(_model(path, FakeGroup(rank, size)).parameters()))
        assert part.keys() == full.keys()
        for name, a in part.items():
            want = _expected(name, full[name], rank, size)
            assert a.dtype == want.dtype and a.shape == want.shape, name
            assert mx.array_equal(a, want).item(), f"rank {rank}: {name}"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("sliced-llama"))


def _mixtral(path):
    from transformers import MixtralConfig, MixtralForCausalLM

    return save_tiny_checkpoint(
        path,
        MixtralConfig,
        MixtralForCausalLM,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        initializer_range=0.1,
    )


def _rewrite(src: Path, dst: Path, files: dict[str, dict[str, mx.array]]) -> Path:
    """Copy the directory `src` to `dst` with other weight files (and an index when there are several)."""
    dst.mkdir()
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith((".safetensors", ".index.json")):
            (dst / p.name).write_bytes(p.read_bytes())
    for name, arrays in files.items():
        mx.save_safetensors(str(dst / name), arrays, metadata={"format": "pt"})
    if len(files) > 1:
        weight_map = {k: name for name, arrays in files.items() for k in arrays}
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def test_llama_fp32_ranks_are_slices_of_the_single_process_model(llama):
    assert_ranks_are_slices(llama)


def test_llama_bf16_sharded_dir_ranks_are_slices(llama, tmp_path):
    weights = {k: v.astype(mx.bfloat16) for k, v in mx.load(str(llama / "model.safetensors")).items()}
    names = sorted(weights)
    half = len(names) // 2
    path = _rewrite(
        llama,
        tmp_path / "bf16",
        {
            "model-00001-of-00002.safetensors": {k: weights[k] for k in names[:half]},
            "model-00002-of-00002.safetensors": {k: weights[k] for k in names[half:]},
        },
    )
    assert _model(path).layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16
    assert_ranks_are_slices(path)


def test_llama_mlx_4bit_ranks_are_slices(llama, tmp_path):
    from mlxcel_core.quantize import quantize_checkpoint

    # group_size 32: o_proj's 64 input columns are 2 groups, one per rank.
    path = quantize_checkpoint(llama, tmp_path / "q4", bits=4, group_size=32)
    assert _model(path).layers[0].self_attn.o_proj.weight.dtype == mx.uint32
    assert_ranks_are_slices(path)


def test_mixtral_per_expert_ranks_are_slices(tmp_path):
    assert_ranks_are_slices(_mixtral(tmp_path))


def test_mixtral_4bit_stacked_experts_ranks_are_slices(tmp_path):
    from mlxcel_core.quantize import quantize_checkpoint

    path = quantize_checkpoint(_mixtral(tmp_path / "src"), tmp_path / "q4", bits=4, group_size=32)
    assert_ranks_are_slices(path)


def test_mixtral_fused_experts_ranks_are_slices(tmp_path):
    """transformers' fused layout (`mlp.experts.gate_up_proj` [E, 2I, H]) is split and sliced unread."""
    src = _mixtral(tmp_path / "src")
    weights = mx.load(str(src / "model.safetensors"))
    fused = {}
    for k, v in weights.items():
        if ".experts." not in k:
            fused[k.replace(".block_sparse_moe.", ".mlp.")] = v

    def expert(i, e, w):
        return weights[f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"]

    for i in range(2):
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = mx.stack(
            [mx.concatenate([expert(i, e, "w1"), expert(i, e, "w3")]) for e in range(4)]
        )
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = mx.stack([expert(i, e, "w2") for e in range(4)])
    path = _rewrite(src, tmp_path / "fused", {"model.safetensors": fused})
    full = _model(path)
    assert mx.array_equal(
        full.layers[1].block_sparse_moe.switch_mlp.up_proj.weight[2],
        weights["model.layers.1.block_sparse_moe.experts.2.w3.weight"],
    ).item()
    assert_ranks_are_slices(path)


def test_qwen2_biases_ranks_are_slices(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = save_tiny_checkpoint(
        tmp_path,
        Qwen2Config,
        Qwen2ForCausalLM,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        initializer_range=0.1,
    )
    assert "bias" in _model(path).layers[0].self_attn.q_proj
    assert_ranks_are_slices(path)


def test_qwen3_moe_ranks_are_slices(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = save_tiny_checkpoint(
        tmp_path,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        initializer_range=0.1,
    )
    assert_ranks_are_slices(path)


def _header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def _owners(path: Path, size: int) -> bytearray:
    """Per byte of the file: 0 if every rank reads it whole, else 1 + the rank whose slice holds it."""
    header, start = _header(path)
    owner = bytearray(path.stat().st_size)
    for name, entry in header.items():
        axis = None if name == "__metadata__" else _split_axis(name)
        if axis is None:
            continue
        shape, (begin, end) = entry["shape"], entry["data_offsets"]
        itemsize = (end - begin) // (shape[0] * shape[1])
        rows, cols = shape
        for r in range(rows):
            row = start + begin + r * cols * itemsize
            for rank in range(size):
                if axis == -2:  # whole rows per rank
                    if rank * rows // size <= r < (rank + 1) * rows // size:
                        owner[row : row + cols * itemsize] = bytes([1 + rank]) * (cols * itemsize)
                else:  # a run of columns of every row
                    width = cols // size * itemsize
                    owner[row + rank * width : row + (rank + 1) * width] = bytes([1 + rank]) * width
    return owner


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "4bit"])
def test_each_rank_reads_exactly_its_slices_bytes(llama, tmp_path, monkeypatch, quantized):
    """Every pread lies inside the rank's slices, and together they cover them exactly once: the other rank's
    rows and columns are never requested."""
    path = llama
    if quantized:
        from mlxcel_core.quantize import quantize_checkpoint

        path = quantize_checkpoint(llama, tmp_path / "q4", bits=4, group_size=32)
    weights_file = path / "model.safetensors"
    owner = _owners(weights_file, 2)
    requests = []
    real = sliced._pread_into

    def counting(fd, view, offset, src):
        requests.append((offset, len(view)))
        real(fd, view, offset, src)

    monkeypatch.setattr(sliced, "_pread_into", counting)
    for rank in (0, 1):
        requests.clear()
        _model(path, FakeGroup(rank, 2))
        mine = bytes([1 + rank])
        for offset, n in requests:
            assert owner[offset : offset + n].count(mine) == n, f"rank {rank} read outside its slices at {offset}"
        assert sum(n for _, n in requests) == owner.count(mine)  # all of them, each byte once
        assert len({o for o, _ in requests}) == len(requests)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts reads through /proc/self/io")
def test_kernel_counts_half_the_sharded_bytes_per_rank(tmp_path):
    """Bytes the process asked the kernel for (rchar), whatever code path reads them: a rank of 2 reads the
    replicated tensors plus half of the sharded ones; the single-process load reads every tensor."""
    path = save_tiny_llama(tmp_path, hidden_size=128, intermediate_size=512)
    weights_file = path / "model.safetensors"
    owner = _owners(weights_file, 2)
    tensors = weights_file.stat().st_size - _header(weights_file)[1]
    sharded = owner.count(1) + owner.count(2)
    other_files = sum(p.stat().st_size for p in path.iterdir() if p != weights_file)

    before = _rchar()
    _model(path)
    single = _rchar() - before
    before = _rchar()
    _model(path, FakeGroup(1, 2))
    rank1 = _rchar() - before

    assert single >= tensors
    assert rank1 <= tensors - sharded // 2 + other_files + 2 * _header(weights_file)[1] + 4096
    assert rank1 < 0.7 * single


def test_single_process_loading_makes_no_handles(llama, monkeypatch):
    monkeypatch.setattr(sliced, "open_tensors", lambda *a: pytest.fail("tp 1 must load with mx.load"))
    monkeypatch.setattr("mlxcel_core.loading.hf.open_tensors", lambda *a: pytest.fail("tp 1 must use mx.load"))
    _model(llama)
    _model(llama, FakeGroup(0, 1))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.uint32, mx.int8, mx.uint8])
def test_handles_read_boxes_of_every_dtype(tmp_path, dtype):
    a = (mx.random.uniform(shape=(3, 8, 12)) * 200).astype(dtype)
    file = tmp_path / "t.safetensors"
    mx.save_safetensors(str(file), {"a": a, "b": a[0], "c": a[2]})
    handles = sliced.open_tensors(file)
    t, b, c = handles["a"], handles["b"], handles["c"]
    assert t.shape == (3, 8, 12) and t.dtype == dtype
    for index in [
        (slice(None), slice(4, 8)),
        (..., slice(6, 12)),
        (slice(1, 3), slice(2, 5), slice(3, 9)),
        (slice(None), slice(None), slice(None, None, 2)),
        (1,),
        (slice(None),),
    ]:
        got = t[index]
        got = got.read() if isinstance(got, sliced._Lazy) else got
        assert got.dtype == dtype and mx.array_equal(got, a[index]).item(), index
    assert mx.array_equal(b[:, 6:].read(), a[0][:, 6:]).item()
    assert all(mx.array_equal(h.read(), w).item() for h, w in zip(t.split(2, axis=1), mx.split(a, 2, axis=1)))
    stacked = sliced._Lazy.stack([b, c, b])
    assert mx.array_equal(stacked[1:, 4:, 2:].read(), mx.stack([a[0], a[2], a[0]])[1:, 4:, 2:]).item()
    assert t.astype(mx.float32)[:, :2].read().dtype == mx.float32


def test_truncated_file_is_a_one_line_error(llama, tmp_path):
    from mlxcel_core.errors import CorruptModelError

    data = (llama / "model.safetensors").read_bytes()
    path = _rewrite(llama, tmp_path / "cut", {})
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptModelError, match="cannot read weights file .*model.safetensors"):
        _model(path, FakeGroup(1, 2))
