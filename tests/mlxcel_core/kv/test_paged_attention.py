"""Paged decode attention vs dense SDPA on each row, for every num_splits a tuner may pick."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_core.kv.paged_attention import gather_kv, paged_decode_attention, write_kv

SPLITS = [1, 2, 4, 8, 16, 32]
D = 64


def make_case(lens, block_size, hq, hkv, dtype=mx.float32, seed=0):
    """Random pools and shuffled, non-overlapping block tables; unused table entries are 0."""
    rng = np.random.default_rng(seed)
    max_blocks = max(math.ceil(n / block_size) for n in lens) + 1  # +1: trailing padding entries
    need = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(need) + 5
    k_pool = rng.standard_normal((num_blocks, block_size, hkv, D)).astype(np.float32)
    v_pool = rng.standard_normal((num_blocks, block_size, hkv, D)).astype(np.float32)
    ids = rng.permutation(num_blocks)
    table = np.zeros((len(lens), max_blocks), np.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = ids[start : start + n]
        start += n
    q = rng.standard_normal((len(lens), hq, D)).astype(np.float32)
    as_mx = lambda a: mx.array(a).astype(dtype)  # noqa: E731
    return (as_mx(q), as_mx(k_pool), as_mx(v_pool), mx.array(table), mx.array(np.array(lens, np.int32)))


def reference(q, k_pool, v_pool, table, lens):
    """SDPA in float32 over each row's dense keys/values, gathered with numpy (independent of the code)."""
    kp, vp, tb = np.array(k_pool.astype(mx.float32)), np.array(v_pool.astype(mx.float32)), np.array(table)
    outs = []
    for b, n in enumerate(np.array(lens).tolist()):
        rows = math.ceil(n / kp.shape[1])
        k = np.concatenate([kp[i] for i in tb[b, :rows]])[:n]  # [n, Hkv, D]
        v = np.concatenate([vp[i] for i in tb[b, :rows]])[:n]
        kk = mx.array(k.transpose(1, 0, 2))[None]
        vv = mx.array(v.transpose(1, 0, 2))[None]
        qq = q[b].astype(mx.float32)[None, :, None, :]
        outs.append(mx.fast.scaled_dot_product_attention(qq, kk, vv, scale=D**-0.5)[0, :, 0, :])
    return mx.stack(outs)


def max_err(a, b):
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


@pytest.mark.parametrize("block_size", [32, 16])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
def test_matches_dense_every_split_fp32(block_size, hq, hkv):
    case = make_case([1, 37, 200], block_size, hq, hkv)
    ref = reference(*case)
    for s in SPLITS:
        out = paged_decode_attention(*case, num_splits=s)
        assert out.shape == (3, hq, D) and out.dtype == mx.float32
        err = max_err(out, ref)
        assert err <= 1e-5, f"num_splits={s}: max abs err {err}"


def test_more_splits_than_tokens():
    # One 16-slot block and a single valid token: most of the 32 splits are empty or pure padding.
    case = make_case([1, 3], 16, 8, 2)
    ref = reference(*case)
    for s in SPLITS:
        assert max_err(paged_decode_attention(*case, num_splits=s), ref) <= 1e-5


@pytest.mark.parametrize("splits", [1, 3])
def test_a_row_without_keys_yields_zeros_beside_the_others(splits):
    """context_len 0 (a row with nothing to attend to): zeros, not NaN, also with sinks; its neighbour's values are
    unchanged. NaN in the pools' unused slots reaches neither."""
    q, kp, vp, table, lens = make_case([0, 37], 16, 8, 2)
    used = np.zeros(kp.shape[0], bool)
    used[np.array(table)[1, :3]] = True  # row 1's 37 tokens: 3 blocks of 16; every other block NaN
    kp, vp = (mx.where(mx.array(used)[:, None, None, None], p, mx.nan) for p in (kp, vp))
    ref = reference(q[1:], kp, vp, table[1:], lens[1:])
    for sinks in (None, mx.linspace(-1.0, 1.0, 8)):
        out = paged_decode_attention(q, kp, vp, table, lens, num_splits=splits, sinks=sinks)
        assert mx.all(out[0] == 0).item() and mx.all(mx.isfinite(out)).item()
        if sinks is None:
            assert max_err(out[1:], ref) <= 1e-5


def test_float16_every_split():
    case = make_case([1, 37, 200], 16, 8, 2, dtype=mx.float16, seed=1)
    ref = reference(*case)
    for s in SPLITS:
        out = paged_decode_attention(*case, num_splits=s)
        assert out.dtype == mx.float16
        assert max_err(out, ref) <= 1e-3, f"num_splits={s}"


def test_custom_scale():
    case = make_case([5, 70], 16, 4, 4)
    a = paged_decode_attention(*case, num_splits=4, scale=0.3)
    b = paged_decode_attention(*case, num_splits=1, scale=0.3)
    c = paged_decode_attention(*case, num_splits=1)
    assert max_err(a, b) <= 1e-5 and max_err(b, c) > 1e-3


def test_write_then_gather_roundtrip_exact():
    rng = np.random.default_rng(2)
    nb, bs, hkv = 10, 16, 2
    k_pool = mx.zeros((nb, bs, hkv, D))
    v_pool = mx.zeros((nb, bs, hkv, D))
    table = mx.array([7, 2, 9, 4], dtype=mx.int32)
    length = 40  # not a multiple of block_size
    k = mx.array(rng.standard_normal((length, hkv, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((length, hkv, D)).astype(np.float32))
    pos = np.arange(length)
    slots = mx.array((np.array(table)[pos // bs] * bs + pos % bs).astype(np.int32))
    k2, v2 = write_kv(k_pool, v_pool, slots, k, v)
    assert mx.all(k_pool == 0).item()  # functional: the inputs are not modified
    gk, gv = gather_kv(k2, v2, table, length)
    assert gk.shape == (1, hkv, length, D)
    assert mx.array_equal(gk[0].transpose(1, 0, 2), k).item()
    assert mx.array_equal(gv[0].transpose(1, 0, 2), v).item()
    # Unwritten slots stay zero: exactly `length` rows of the pool changed.
    assert int((mx.abs(k2).sum(axis=(2, 3)) > 0).sum().item()) == length


def test_write_then_decode_matches_dense():
    # The caller's flow: write the current token's k/v, then attend over context_len including it.
    q, k_pool, v_pool, table, lens = make_case([20, 33], 16, 8, 2, seed=3)
    new_k = mx.array(np.random.default_rng(4).standard_normal((2, 2, D)).astype(np.float32))
    slots = mx.array([int(table[b, n // 16].item()) * 16 + n % 16 for b, n in enumerate([20, 33])])
    k_pool, v_pool = write_kv(k_pool, v_pool, slots, new_k, new_k)
    lens = lens + 1
    ref = reference(q, k_pool, v_pool, table, lens)
    for s in SPLITS:
        assert max_err(paged_decode_attention(q, k_pool, v_pool, table, lens, num_splits=s), ref) <= 1e-5


def test_one_token_query_layout_gives_the_same_values():
    """q [B, Hq, 1, D] (the model's layout at one token) is the same memory as [B, Hq, D]: same output, its shape."""
    q, kp, vp, table, lens = make_case([5, 40], 16, 8, 2)
    flat = paged_decode_attention(q, kp, vp, table, lens, num_splits=4)
    out = paged_decode_attention(q[:, :, None, :], kp, vp, table, lens, num_splits=4)
    assert out.shape == (2, 8, 1, D) and mx.array_equal(out.reshape(flat.shape), flat).item()
    with pytest.raises(ValueError, match="q must be"):
        paged_decode_attention(mx.concatenate([q[:, :, None]] * 2, axis=2), kp, vp, table, lens)


def test_bad_arguments():
    q, kp, vp, table, lens = make_case([5, 9], 16, 8, 2)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, kp, vp, table, lens, num_splits=0)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, kp, vp, table, lens, num_splits=2.0)
    with pytest.raises(ValueError, match="q must be"):
        paged_decode_attention(q[0], kp, vp, table, lens)
    with pytest.raises(ValueError, match="v_pool"):
        paged_decode_attention(q, kp, vp[:, :8], table, lens)
    with pytest.raises(ValueError, match="head dim"):
        paged_decode_attention(q[..., :32], kp, vp, table, lens)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q[:, :3], kp, vp, table, lens)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, kp, vp, table[:1], lens)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, kp, vp, table.astype(mx.float32), lens)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention(q, kp, vp, table, lens[:1])
    slots = mx.array([0, 1], dtype=mx.int32)
    with pytest.raises(ValueError, match="k and v"):
        write_kv(kp, vp, slots, kp[0, :3], kp[0, :3])
    with pytest.raises(ValueError, match="slots"):
        write_kv(kp, vp, slots.astype(mx.float32), kp[0, :2], kp[0, :2])
    with pytest.raises(ValueError, match="length"):
        gather_kv(kp, vp, table[0], 10_000)
