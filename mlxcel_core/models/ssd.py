"""The Mamba2 selective state-space scan (state-space duality, SSD) of Nemotron-H's Mamba2 layers, in MLX ops.

Definitions follow transformers' torch paths (models/nemotron_h: `mamba2_chunk_scan`, `mamba2_selective_state_update`):
per head h with A_h < 0, step size dt_t [h] (softplus already applied), inputs x_t [h, p], B_t and C_t [g, n] (each
group of state projections serves H / G consecutive heads), the state S [h, p, n] in float32; per token t

    S = S * exp(dt_t A) + (dt_t x_t) B_t^T;  y_t = S C_t + D x_t

A prompt runs the chunked form (chunks of `chunk` positions: the intra-chunk part as a masked "attention" of C
against B with the decays between positions, then a scan over chunks carrying S); a decode step (one token) runs the
recurrence once.
"""

from __future__ import annotations

import mlx.core as mx


def _heads(t: mx.array, heads: int) -> mx.array:
    """[B, L, G, N] group projections -> [B, L, H, N], each group repeated over its H / G consecutive heads."""
    n = heads // t.shape[2]
    return mx.repeat(t, n, axis=2) if n > 1 else t


def ssd_step(x, dt, A, B, C, D, state: mx.array | None) -> tuple[mx.array, mx.array]:
    """One token per row: x [B, 1, H, P], dt [B, 1, H], A and D [H], B and C [B, 1, G, N]; (y [B, 1, H, P] float32,
    the new state [B, H, P, N])."""
    heads = x.shape[2]
    x, dt = x[:, 0].astype(mx.float32), dt[:, 0].astype(mx.float32)
    B, C = (_heads(t, heads)[:, 0].astype(mx.float32) for t in (B, C))
    if state is None:
        state = mx.zeros((*x.shape, B.shape[-1]), mx.float32)
    decay = mx.exp(dt * A.astype(mx.float32))[..., None, None]
    state = state * decay + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = (state @ C[..., None])[..., 0] + x * D.astype(mx.float32)[:, None]
    return y[:, None], state


def ssd_chunked(x, dt, A, B, C, D, state: mx.array | None, chunk: int) -> tuple[mx.array, mx.array]:
    """L tokens: x [B, L, H, P], dt [B, L, H], A and D [H], B and C [B, L, G, N]; (y [B, L, H, P] float32, the state
    after them [B, H, P, N])."""
    batch, L, H, P = x.shape
    x, dt = x.astype(mx.float32), dt.astype(mx.float32)
    B, C = (_heads(t, H).astype(mx.float32) for t in (B, C))
    N = B.shape[-1]
    skip = x * D.astype(mx.float32)[:, None]
    pad = -L % chunk
    if pad:  # zero inputs and steps: the padded positions leave the state as it is
        x, B, C = (mx.pad(t, [(0, 0), (0, pad), (0, 0), (0, 0)]) for t in (x, B, C))
        dt = mx.pad(dt, [(0, 0), (0, pad), (0, 0)])
    n = (L + pad) // chunk
    # [B, H, n, chunk, .]: heads first, positions within each chunk last but one
    xs = (x * dt[..., None]).reshape(batch, n, chunk, H, P).transpose(0, 3, 1, 2, 4)
    Bs, Cs = (t.reshape(batch, n, chunk, H, N).transpose(0, 3, 1, 2, 4) for t in (B, C))
    cum = mx.cumsum((dt * A.astype(mx.float32)).reshape(batch, n, chunk, H).transpose(0, 3, 1, 2), axis=-1)
    causal = mx.tril(mx.ones((chunk, chunk), mx.bool_))
    decay = mx.exp(mx.where(causal, cum[..., :, None] - cum[..., None, :], -mx.inf))
    intra = ((Cs @ Bs.swapaxes(-1, -2)) * decay) @ xs  # [B, H, n, chunk, P]
    to_end = mx.exp(cum[..., -1:] - cum)[..., None]  # each position's decay to its chunk's end
    from_start = mx.exp(cum)[..., None]
    chunk_decay = mx.exp(cum[..., -1])[..., None, None]
    if state is None:
        state = mx.zeros((batch, H, P, N), mx.float32)
    outs = []
    for i in range(n):
        outs.append(intra[:, :, i] + (Cs[:, :, i] @ state.swapaxes(-1, -2)) * from_start[:, :, i])
        state = state * chunk_decay[:, :, i] + (xs[:, :, i] * to_end[:, :, i]).swapaxes(-1, -2) @ Bs[:, :, i]
    y = mx.concatenate(outs, axis=2) if n > 1 else outs[0]  # [B, H, L + pad, P]
    return y.transpose(0, 2, 1, 3)[:, :L] + skip, state
