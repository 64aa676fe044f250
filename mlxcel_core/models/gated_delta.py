"""The gated delta rule and the causal depthwise convolution of gated delta-net layers (Qwen3-Next, Qwen3.5), in MLX
ops on every device.

Definitions follow transformers' torch paths (models/qwen3_next: `torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, `causal_conv1d_fn` / `causal_conv1d_update`): queries and keys L2-normalized in
float32, queries scaled by Dk**-0.5, the state S [B, Hv, Dk, Dv] in float32; per token t

    S = S * exp(g_t);  S = S + k_t (beta_t (v_t - k_t S));  o_t = q_t S

A prompt runs the chunked form (chunks of 64 positions: the intra-chunk delta updates as one unit-lower triangular
system, then a scan over chunks); a decode step (one token) runs the recurrence once. The triangular system's
inverse (I - N)^-1 of a strictly lower N is the product (I + N)(I + N^2)(I + N^4)...: a few matmuls where
transformers calls solve_triangular (which MLX has on the CPU only).
"""

from __future__ import annotations

import mlx.core as mx

CHUNK = 64  # transformers' chunk_size


def l2norm(x: mx.array, eps: float = 1e-6) -> mx.array:
    """x / sqrt(sum(x^2) + eps) along the last axis (transformers' l2norm, FLA's eps)."""
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def depthwise_taps(padded: mx.array, weight: mx.array) -> mx.array:
    """out[:, t] = sum_k padded[:, t + k] * weight[:, 0, k] for `padded` [B, L + K - 1, C] and `weight` [C, 1, K]:
    a depthwise convolution as K multiply-adds in float32, cast back to the input's dtype. Short kernels (K = 2..4)
    make this a few elementwise ops on every backend, where a grouped convolution is a library call with a plan per
    shape (one for every prefill chunk length) and a decode step's single position is the same sum
    (transformers' causal_conv1d_update)."""
    K = weight.shape[-1]
    length = padded.shape[1] - (K - 1)
    taps = weight[:, 0, :].astype(mx.float32)
    out = padded[:, 0:length, :].astype(mx.float32) * taps[:, 0]
    for k in range(1, K):
        out = out + padded[:, k : k + length, :].astype(mx.float32) * taps[:, k]
    return out.astype(padded.dtype)


def causal_conv(x: mx.array, state: mx.array | None, weight: mx.array) -> tuple[mx.array, mx.array]:
    """Depthwise causal convolution of x [B, L, C] with `weight` [C, 1, K] (torch's layout, as checkpoints store it)
    after the previous K - 1 inputs `state` [B, K - 1, C] (None: zeros), then SiLU; returns (output [B, L, C], the new
    state: the last K - 1 inputs)."""
    K = weight.shape[-1]
    if state is None:
        state = mx.zeros((x.shape[0], K - 1, x.shape[-1]), x.dtype)
    padded = mx.concatenate([state.astype(x.dtype), x], axis=1)
    out = depthwise_taps(padded, weight)
    return mx.sigmoid(out) * out, padded[:, padded.shape[1] - (K - 1) :, :]


def prepare(q: mx.array, k: mx.array, v: mx.array, beta: mx.array, g: mx.array):
    """[B, L, H*, D] inputs -> float32 [B, Hv, L, D]: key heads repeated over their value heads (each key head serves
    Hv / Hk consecutive value heads), q and k L2-normalized, q scaled by Dk**-0.5; beta and g [B, L, Hv] ->
    [B, Hv, L]."""
    n = v.shape[2] // k.shape[2]
    if n > 1:
        q, k = mx.repeat(q, n, axis=2), mx.repeat(k, n, axis=2)
    q, k, v, beta, g = (t.astype(mx.float32).swapaxes(1, 2) for t in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    return q * (q.shape[-1] ** -0.5), k, v, beta, g


def recurrent_step(q, k, v, beta, g, state: mx.array | None) -> tuple[mx.array, mx.array]:
    """One token per row (prepared inputs, L = 1): (output [B, Hv, 1, Dv], new state)."""
    q, k, v, beta, g = q[:, :, 0], k[:, :, 0], v[:, :, 0], beta[:, :, 0], g[:, :, 0]
    if state is None:
        state = mx.zeros((*k.shape, v.shape[-1]), mx.float32)
    state = state * mx.exp(g)[..., None, None]
    kv_mem = (state * k[..., None]).sum(axis=-2)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    out = (state * q[..., None]).sum(axis=-2)
    return out[:, :, None], state


def _unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + strictly_lower(a))^-1 for square [..., C, C] a: with N = -strictly_lower(a), nilpotent,
    (I - N)^-1 = (I + N)(I + N^2)(I + N^4)... up to N^(C/2)."""
    size = a.shape[-1]
    lower = mx.tril(mx.ones((size, size), mx.bool_), k=-1)
    n = mx.where(lower, -a, 0.0)
    inverse = mx.eye(size, dtype=a.dtype) + n
    power, span = n, 2
    while span < size:
        power = power @ power
        inverse = inverse + inverse @ power
        span *= 2
    return inverse


def chunked(q, k, v, beta, g, state: mx.array | None, chunk: int = CHUNK) -> tuple[mx.array, mx.array]:
    """Prepared inputs [B, Hv, L, D] of L tokens: (outputs [B, Hv, L, Dv], the state after them)."""
    B, H, L, Dk = k.shape
    Dv = v.shape[-1]
    pad = -L % chunk
    if pad:  # zero keys and values, no decay: the padded positions leave the state as it is
        q, k, v = (mx.pad(t, [(0, 0), (0, 0), (0, pad), (0, 0)]) for t in (q, k, v))
        beta, g = (mx.pad(t, [(0, 0), (0, 0), (0, pad)]) for t in (beta, g))
    n = (L + pad) // chunk
    q, k, v = (t.reshape(B, H, n, chunk, t.shape[-1]) for t in (q, k, v))
    k_beta = k * beta.reshape(B, H, n, chunk, 1)
    v_beta = v * beta.reshape(B, H, n, chunk, 1)
    cum = mx.cumsum(g.reshape(B, H, n, chunk), axis=-1)
    causal = mx.tril(mx.ones((chunk, chunk), mx.bool_))
    decay = mx.exp(mx.where(causal, cum[..., :, None] - cum[..., None, :], -mx.inf))
    inverse = _unit_lower_inverse((k_beta @ k.swapaxes(-1, -2)) * decay)
    values = inverse @ v_beta
    k_cumdecay = inverse @ (k_beta * mx.exp(cum)[..., None])
    intra = (q @ k.swapaxes(-1, -2)) * decay
    q_decayed = q * mx.exp(cum)[..., None]
    k_decayed = k * mx.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = mx.exp(cum[..., -1])[..., None, None]
    if state is None:
        state = mx.zeros((B, H, Dk, Dv), mx.float32)
    outs = []
    for i in range(n):
        v_new = values[:, :, i] - k_cumdecay[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_decayed[:, :, i].swapaxes(-1, -2) @ v_new
    out = mx.concatenate(outs, axis=2) if n > 1 else outs[0]
    return out[:, :, :L], state


def gated_delta(q, k, v, beta, g, state: mx.array | None) -> tuple[mx.array, mx.array]:
    """The gated delta rule over q, k [B, L, Hk, Dk], v [B, L, Hv, Dv], beta and g (log decay) [B, L, Hv], from
    `state` [B, Hv, Dk, Dv] (None: zeros): (outputs [B, L, Hv, Dv] in v's dtype, the float32 state after them)."""
    dtype = v.dtype
    prepared = prepare(q, k, v, beta, g)
    step = recurrent_step if q.shape[1] == 1 else chunked
    out, state = step(*prepared, state)
    return out.swapaxes(1, 2).astype(dtype), state
