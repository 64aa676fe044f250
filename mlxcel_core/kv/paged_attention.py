"""Decode attention over a paged KV pool, split along the key axis (flash-decoding style).

A pool holds ``num_blocks`` blocks of ``block_size`` token slots; each sequence owns a list of
block ids (its row of ``block_tables``). Decode attention gathers a row's blocks, cuts the key
axis into ``num_splits`` contiguous chunks, reduces each chunk independently (max, sum of exp,
weighted V) and merges the partials with log-sum-exp rescaling. ``num_splits`` only changes how
the work is partitioned, never the result (up to rounding), so a tuner may pick it freely. One split
(the default below 4096 keys) is one softmax over the whole key axis: no partials to merge, about half
the ops, which a decode step pays per layer on every backend that runs this path (the CPU; on CUDA
the calls no kernel takes: latent attention).
"""

from __future__ import annotations

import math
import numbers

import mlx.core as mx

RUNNER_OPS = "mlx-ops"  # the runner name of this implementation (autotune keys its results on runner names)


def _check_int(name: str, a: mx.array) -> None:
    if not mx.issubdtype(a.dtype, mx.integer):
        raise ValueError(f"{name} must be an integer array, got {a.dtype}")


def _check_pools(k_pool: mx.array, v_pool: mx.array) -> None:
    if k_pool.ndim != 4:
        raise ValueError(f"k_pool must be [num_blocks, block_size, Hkv, D], got shape {k_pool.shape}")
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool shape {v_pool.shape} != k_pool shape {k_pool.shape}")


def check_decode_arguments(q, k_pool, v_pool, block_tables, context_lens, num_splits) -> None:
    """The contract every paged decode attention implementation (MLX ops, CUDA kernel) validates."""
    _check_pools(k_pool, v_pool)
    if not (q.ndim == 3 or (q.ndim == 4 and q.shape[2] == 1)):
        raise ValueError(f"q must be [B, Hq, D] or [B, Hq, 1, D], got shape {q.shape}")
    B, Hq, D = q.shape[0], q.shape[1], q.shape[-1]
    Hkv, Dk = k_pool.shape[2], k_pool.shape[3]
    if Dk != D:
        raise ValueError(f"head dim mismatch: q has D={D}, pools have D={Dk}")
    if Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    if block_tables.ndim != 2 or block_tables.shape[0] != B:
        raise ValueError(f"block_tables must be [B={B}, max_blocks], got shape {block_tables.shape}")
    if context_lens.shape != (B,):
        raise ValueError(f"context_lens must be [B={B}], got shape {context_lens.shape}")
    _check_int("block_tables", block_tables)
    _check_int("context_lens", context_lens)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")


def check_limits(window, chunk, softcap) -> None:
    """A call's window and chunk (whole numbers >= 1, numpy's too) and soft-cap (a positive, finite number), where
    given: what the ops path and the CUDA kernel validate alike."""
    for name, n in (("window", window), ("chunk", chunk)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1):
            raise ValueError(f"{name} must be an int >= 1, got {n!r}")
    if softcap is not None and not (isinstance(softcap, numbers.Real) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive, finite number, got {softcap!r}")


def paged_decode_attention(
    q,
    k_pool,
    v_pool,
    block_tables,
    context_lens,
    num_splits: int = 1,
    scale: float | None = None,
    sinks: mx.array | None = None,
    values_in_keys: int | None = None,
    chunk: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> mx.array:
    """One decode step of attention for B rows. q: [B, Hq, D] (or [B, Hq, 1, D], the model's layout at one token);
    pools: [num_blocks, block_size, Hkv, D]; block_tables: int [B, max_blocks]; context_lens: int [B] (valid tokens,
    current one included). Returns q's shape and dtype. A row with context_len 0 yields zeros.

    `sinks` [Hq] (gpt-oss): a logit per query head that joins every row's softmax denominator and no value (merged
    with the splits' partials like one more split holding only that logit).

    `values_in_keys` n (multi-head latent attention, DeepSeek-V3): the values are the keys' first n dims, `v_pool` is
    not read (the paged storage has a key pool only and passes it again), and the output is [..., n]. Such calls are
    routed here, never to a kernel (Backend.paged_runner_for).

    `chunk` (Llama 4's chunked local attention): a row's query (at position context_len - 1) sees only the keys of its
    own chunk of `chunk` positions, from (context_len - 1) // chunk * chunk on.

    `window` (a sliding-window layer): a row's query sees its last `window` keys only, positions context_len - window
    on (causal_mask's q - k < window). `softcap` (Gemma 2): each score s becomes tanh(s / softcap) * softcap before
    the softmax. The CUDA kernel takes `chunk`, `window` and `softcap` too."""
    if values_in_keys is not None and not 0 < values_in_keys <= k_pool.shape[-1]:
        raise ValueError(f"values_in_keys must be in [1, {k_pool.shape[-1]}], got {values_in_keys}")
    check_decode_arguments(
        q, k_pool, v_pool if values_in_keys is None else k_pool, block_tables, context_lens, num_splits
    )
    check_limits(window, chunk, softcap)
    window, chunk = (None if n is None else int(n) for n in (window, chunk))
    softcap = None if softcap is None else float(softcap)
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [Hq={q.shape[1]}], got shape {sinks.shape}")
    B, D = q.shape[0], q.shape[-1]
    _, block_size, Hkv, _ = k_pool.shape
    scale = D**-0.5 if scale is None else scale

    # Gather each row's blocks into a dense token axis: [B, T, Hkv, D].
    T = block_tables.shape[1] * block_size
    k = k_pool[block_tables].reshape(B, T, Hkv, D)
    Dv = D if values_in_keys is None else values_in_keys
    v = v_pool[block_tables].reshape(B, T, Hkv, D) if values_in_keys is None else k[..., :Dv]
    if num_splits == 1:
        return _whole(q, k, v, context_lens, scale, sinks, chunk, window, softcap)
    return _split(q, k, v, context_lens, num_splits, scale, sinks, chunk, window, softcap)


def _split(q, k, v, context_lens, S: int, scale: float, sinks, chunk, window, softcap) -> mx.array:
    """paged_decode_attention over `S` splits of the gathered keys k [B, T, Hkv, D] and values v [B, T, Hkv, Dv]:
    each split's softmax partials in float32, merged by their maxima."""
    B, Hq, D = q.shape[0], q.shape[1], q.shape[-1]
    T, Hkv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    n_rep = Hq // Hkv
    # Pad T so it splits evenly; the padding is masked out below like any position >= context_len.
    span = max(1, -(-T // S))  # keys per split
    pad = span * S - T
    if pad:
        k = mx.pad(k, [(0, 0), (0, pad), (0, 0), (0, 0)])
        v = mx.pad(v, [(0, 0), (0, pad), (0, 0), (0, 0)])

    # float32 throughout: the partial sums and the rescaling are where low precision hurts.
    f32 = mx.float32
    # [B, Hkv, S, span, D]: one contiguous key span per split, per kv head.
    k = k.astype(f32).reshape(B, S, span, Hkv, D).transpose(0, 3, 1, 2, 4)
    v = v.astype(f32).reshape(B, S, span, Hkv, Dv).transpose(0, 3, 1, 2, 4)
    # GQA without repeating K/V: query heads of one kv head share its keys. [B, Hkv, 1, n_rep, D]
    qg = (q.astype(f32) * scale).reshape(B, Hkv, 1, n_rep, D)

    scores = _capped(qg @ k.swapaxes(-1, -2), softcap)  # [B, Hkv, S, n_rep, span]
    valid = _valid(context_lens, T, chunk, window)[0]
    valid = mx.pad(valid, [(0, 0), (0, pad)]).reshape(B, S, span) if pad else valid.reshape(B, S, span)
    scores = mx.where(valid.reshape(B, 1, S, 1, span), scores, -mx.inf)
    # Slots past a row's length (its last block's tail, the table's padding entries) hold whatever an earlier
    # sequence left there, NaN included: their weight is 0, but 0 * NaN is NaN, so their values are zeroed.
    v = mx.where(valid.reshape(B, 1, S, span, 1), v, 0.0)

    # Per-split partials. An all-masked split has max -inf; shift by 0 instead so exp() gives 0, not NaN.
    m = scores.max(axis=-1, keepdims=True)  # [B, Hkv, S, n_rep, 1]
    empty = m == -mx.inf
    p = mx.exp(scores - mx.where(empty, 0.0, m))
    l = p.sum(axis=-1, keepdims=True)  # [B, Hkv, S, n_rep, 1]
    o = p @ v  # [B, Hkv, S, n_rep, Dv]

    # Merge splits: rescale each partial by exp(m_s - M); empty splits get weight 0.
    M = m.max(axis=2, keepdims=True)
    if sinks is not None:  # the sink's logit counts towards the maximum, so exp(sink - M) <= 1 too
        sink = sinks.astype(f32).reshape(1, Hkv, 1, n_rep, 1)
        M = mx.maximum(M, sink)
    alpha = mx.where(empty, 0.0, mx.exp(m - mx.where(M == -mx.inf, 0.0, M)))
    L = (alpha * l).sum(axis=2)  # [B, Hkv, n_rep, 1]
    if sinks is not None:
        L = L + mx.exp(sink - M)[:, :, 0]
    O = (alpha * o).sum(axis=2)  # [B, Hkv, n_rep, Dv]
    out = mx.where(L > 0, O / mx.where(L > 0, L, 1.0), 0.0)
    return out.reshape(*q.shape[:-1], Dv).astype(q.dtype)


def _valid(context_lens: mx.array, T: int, chunk: int | None, window: int | None) -> tuple[mx.array, mx.array]:
    """(valid [B, T]: the key positions each row attends to; lens [B]: context_lens clamped to T, so a too-large one
    cannot pull padding into the softmax)."""
    lens = mx.minimum(context_lens.astype(mx.int32), T)
    positions = mx.arange(T)[None]
    valid = positions < lens[:, None]
    if chunk is not None:  # the keys of the query's own chunk only
        first = (context_lens.astype(mx.int32) - 1) // chunk * chunk
        valid = mx.logical_and(valid, positions >= first[:, None])
    if window is not None:  # the last `window` keys only
        valid = mx.logical_and(valid, positions >= (context_lens.astype(mx.int32) - window)[:, None])
    return valid, lens


def _capped(scores: mx.array, softcap: float | None) -> mx.array:
    """Gemma 2's attention-logit soft-capping of float32 scores (none without a cap)."""
    return scores if softcap is None else mx.tanh(scores / softcap) * softcap


def _whole(q, k, v, context_lens, scale: float, sinks, chunk, window, softcap) -> mx.array:
    """One split: the whole key axis in one softmax (the split path's result, in fewer ops: no partials to merge).
    k [B, T, Hkv, D], v [B, T, Hkv, Dv] gathered; float32 throughout."""
    B, T, Hkv, D = k.shape
    Dv, n_rep, f32 = v.shape[-1], q.shape[1] // Hkv, mx.float32
    valid, lens = _valid(context_lens, T, chunk, window)
    qg = (q.astype(f32) * scale).reshape(B, Hkv, n_rep, D)
    scores = _capped(qg @ k.astype(f32).transpose(0, 2, 3, 1), softcap)  # [B, Hkv, n_rep, T]
    scores = mx.where(valid[:, None, None, :], scores, -mx.inf)
    if sinks is not None:  # one more logit per query head in the denominator, with no value
        sink = mx.broadcast_to(sinks.astype(f32).reshape(1, Hkv, n_rep, 1), (B, Hkv, n_rep, 1))
        scores = mx.concatenate([scores, sink], axis=-1)
    p = mx.softmax(scores, axis=-1, precise=True)[..., :T]
    # Slots past a row's length may hold NaN (an earlier sequence's): weight 0, and 0 * NaN is NaN, so zeroed.
    v = mx.where(valid[:, None, :, None], v.astype(f32).transpose(0, 2, 1, 3), 0.0)  # [B, Hkv, T, Dv]
    out = mx.where((lens > 0)[:, None, None, None], p @ v, 0.0)  # (a row with no keys: zeros, not NaN)
    return out.reshape(*q.shape[:-1], Dv).astype(q.dtype)


def write_kv(k_pool, v_pool, slots, k, v) -> tuple[mx.array, mx.array]:
    """Scatter k/v [N, Hkv, D] into flat slots (block_id * block_size + offset); returns new pools."""
    _check_pools(k_pool, v_pool)
    nb, bs, Hkv, D = k_pool.shape
    _check_int("slots", slots)
    if slots.ndim != 1:
        raise ValueError(f"slots must be [N], got shape {slots.shape}")
    want = (slots.shape[0], Hkv, D)
    if k.shape != want or v.shape != want:
        raise ValueError(f"k and v must be {want}, got {k.shape} and {v.shape}")
    # Reshape makes a new array, so the assignment below leaves the caller's pools untouched.
    k_flat = k_pool.reshape(nb * bs, Hkv, D)
    v_flat = v_pool.reshape(nb * bs, Hkv, D)
    k_flat[slots] = k.astype(k_pool.dtype)
    v_flat[slots] = v.astype(v_pool.dtype)
    return k_flat.reshape(k_pool.shape), v_flat.reshape(v_pool.shape)


def gather_kv(k_pool, v_pool, block_table, length: int) -> tuple[mx.array, mx.array]:
    """One sequence's first `length` tokens as ([1, Hkv, length, D], same) for prefill attention."""
    _check_pools(k_pool, v_pool)
    _, bs, Hkv, D = k_pool.shape
    _check_int("block_table", block_table)
    if block_table.ndim == 2 and block_table.shape[0] == 1:
        block_table = block_table[0]
    if block_table.ndim != 1:
        raise ValueError(f"block_table must be [max_blocks], got shape {block_table.shape}")
    n = math.ceil(length / bs) if isinstance(length, int) and length >= 0 else -1
    if n < 0 or n > block_table.shape[0]:
        raise ValueError(f"length {length!r} needs to be in [0, {block_table.shape[0] * bs}]")
    ids = block_table[:n]

    def take(pool):
        return pool[ids].reshape(n * bs, Hkv, D)[:length].transpose(1, 0, 2)[None]

    return take(k_pool), take(v_pool)
