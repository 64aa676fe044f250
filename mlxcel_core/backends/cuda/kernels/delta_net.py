"""A gated delta-net layer's decode step (Qwen3-Next, Qwen3.5) as two launches that update the rows' state in place.

    use_delta_net_kernels(model)    # the CUDA backend's prepare step; restore_delta_net(model) undoes it

Why: a decode step of a delta-net layer in MLX ops (models/gated_delta.py) is some 30 launches after fusing (the state
gathered from the pool and scattered back, the convolution's taps, q/k L2 norms, the decay and beta, the recurrence's
products and sums), each a few microseconds of GPU work and more of the host's, in 3 of every 4 layers of a Qwen3.5.
Here, where the rows' state lives in the paged storage's state pool (engine/state_pool.py, `StateView.in_place`):

- "mlxcel_delta_conv": the causal depthwise convolution of one token per row over the K - 1 inputs kept in its slot,
  then SiLU; the slot's inputs shift by one in place. One thread per (channel, row).
- "mlxcel_delta_rule": per (value head, row), one thread per value column: q and k of the head's key head
  L2-normalized (q scaled by Dk**-0.5), beta = sigmoid(b) and the decay exp(-exp(A_log) softplus(a + dt_bias)) of
  the head, then S = S decay; S += k (beta (v - k S)); o = q S, the slot's float32 state [Dk, Dv] updated in place.
  A head's state is read twice (the decayed k S, then the update), 2 x 4 Dk Dv bytes, and written once.

The arithmetic is the ops path's, element for element, in the same dtypes (float32 products, the outputs rounded to
the activations' dtype, beta rounded to it as mx.sigmoid(b) is); the sums over Dk run in another order, so outputs
agree to float32 rounding, not bit for bit (tests/mlxcel_core/backends/cuda/kernels/test_delta_net.py). Prompts,
forwards over generated tokens (speculative verification and its re-run, whose checkpoint holds the pool's arrays),
rows without a state yet and other storages keep the ops path.

The layer's class is swapped, in place, to a subclass of its own with `mix` overridden (as fused_projections.py
does for attention blocks); parameters and every other path are unchanged.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxcel_core.backends.base import on_gpu
from mlxcel_core.models.qwen3_next import GatedDeltaNet

from ..small_arrays import float32_bits

CONV_THREADS = 256
CONV_SOURCE = """
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int b = blockIdx.y;
    if (c >= C) return;
    const int slot = slots[b];
    if (slot < 0 || slot >= pool_shape[0]) return;
    P* kept = const_cast<P*>(pool) + size_t(slot) * (K - 1) * C;
    const T newest = x[size_t(b) * C + c];
    const W* taps = w + size_t(c) * K;
    float acc = static_cast<float>(static_cast<T>(kept[c])) * static_cast<float>(taps[0]);
    for (int k = 1; k < K - 1; ++k) {
        acc = acc + static_cast<float>(static_cast<T>(kept[size_t(k) * C + c])) * static_cast<float>(taps[k]);
    }
    acc = acc + static_cast<float>(newest) * static_cast<float>(taps[K - 1]);
    for (int k = 0; k < K - 2; ++k) kept[size_t(k) * C + c] = kept[size_t(k + 1) * C + c];
    kept[size_t(K - 2) * C + c] = static_cast<P>(newest);
    const float conv = static_cast<float>(static_cast<T>(acc));
    const float gate = static_cast<float>(static_cast<T>(1.0f / (1.0f + expf(-conv))));
    y[size_t(b) * C + c] = static_cast<T>(gate * conv);
"""

RULE_SOURCE = """
    __shared__ float qs[DK];
    __shared__ float ks[DK];
    __shared__ float sums[2][32];
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int j = threadIdx.x;
    const int kh = h / (HV / HK);
    const int slot = slots[b];
    const T* row = conv + size_t(b) * C;
    float sq = 0.f, sk = 0.f;
    for (int i = j; i < DK; i += TPB) {
        const float qv = static_cast<float>(row[kh * DK + i]);
        const float kv = static_cast<float>(row[HK * DK + kh * DK + i]);
        qs[i] = qv;
        ks[i] = kv;
        sq += qv * qv;
        sk += kv * kv;
    }
    for (int o = 16; o > 0; o >>= 1) {
        sq += __shfl_xor_sync(0xffffffffu, sq, o);
        sk += __shfl_xor_sync(0xffffffffu, sk, o);
    }
    if ((j & 31) == 0) { sums[0][j >> 5] = sq; sums[1][j >> 5] = sk; }
    __syncthreads();
    float tq = 0.f, tk = 0.f;
    for (int w = 0; w < TPB / 32; ++w) { tq += sums[0][w]; tk += sums[1][w]; }
    const float rq = rsqrtf(tq + 1e-6f);
    const float rk = rsqrtf(tk + 1e-6f);
    const float scale = __int_as_float(SCALE_BITS);
    for (int i = j; i < DK; i += TPB) {
        qs[i] = (qs[i] * rq) * scale;
        ks[i] = ks[i] * rk;
    }
    __syncthreads();
    if (j >= DV || slot < 0 || slot >= pool_shape[0]) return;
    const float shifted = static_cast<float>(a[size_t(b) * HV + h]) + static_cast<float>(dt_bias[h]);
    const float softplus = fmaxf(shifted, 0.f) + log1pf(expf(-fabsf(shifted)));
    const float decay = expf(-expf(static_cast<float>(A_log[h])) * softplus);
    const float gate = static_cast<float>(bg[size_t(b) * HV + h]);
    const float beta = static_cast<float>(static_cast<T>(1.0f / (1.0f + expf(-gate))));
    const float v = static_cast<float>(row[2 * HK * DK + h * DV + j]);
    float* S = const_cast<float*>(pool) + (size_t(slot) * HV + h) * DK * DV + j;
    float remembered = 0.f;
    for (int i = 0; i < DK; ++i) remembered += (S[size_t(i) * DV] * decay) * ks[i];
    const float delta = (v - remembered) * beta;
    float o = 0.f;
    for (int i = 0; i < DK; ++i) {
        const float s = S[size_t(i) * DV] * decay + ks[i] * delta;
        S[size_t(i) * DV] = s;
        o += s * qs[i];
    }
    y[(size_t(b) * HV + h) * DV + j] = static_cast<T>(o);
"""

_kernels: dict[str, object] = {}


def _kernel(name: str):
    if name not in _kernels:
        from .cubin_cache import cuda_kernel

        if name == "conv":
            _kernels[name] = cuda_kernel(
                name="mlxcel_delta_conv",
                input_names=["x", "pool", "slots", "w"],
                output_names=["y"],
                source=CONV_SOURCE,
            )
        else:
            _kernels[name] = cuda_kernel(
                name="mlxcel_delta_rule",
                input_names=["conv", "bg", "a", "A_log", "dt_bias", "pool", "slots"],
                output_names=["y"],
                source=RULE_SOURCE,
            )
    return _kernels[name]


def conv_step(x: mx.array, pool: mx.array, slots: mx.array, weight: mx.array) -> mx.array:
    """SiLU(causal depthwise convolution) of x [B, 1, C] after the K - 1 inputs kept in `pool` [slots, K - 1, C] at
    the rows' `slots` [B], with `weight` [C, 1, K]; the kept inputs shift by one in place. Returns [B, 1, C]."""
    B, _, C = x.shape
    K = weight.shape[-1]
    (y,) = _kernel("conv")(
        inputs=[x, pool, slots, weight],
        template=[("T", x.dtype), ("P", pool.dtype), ("W", weight.dtype), ("C", C), ("K", K)],
        grid=(-(-C // CONV_THREADS) * CONV_THREADS, B, 1),
        threadgroup=(CONV_THREADS, 1, 1),
        output_shapes=[x.shape],
        output_dtypes=[x.dtype],
    )
    return y


def rule_step(layer: GatedDeltaNet, conv: mx.array, b: mx.array, a: mx.array, pool: mx.array, slots: mx.array):
    """The gated delta rule for one token per row: q, k, v side by side in `conv` [B, 1, conv_dim] (the convolution's
    output), b and a [B, 1, Hv], the rows' float32 states in `pool` [slots, Hv, Dk, Dv] at `slots`, updated in place.
    Returns [B, 1, Hv, Dv] in conv's dtype."""
    B = conv.shape[0]
    hv, hk, dk, dv = layer.num_v_heads, layer.num_k_heads, layer.head_k_dim, layer.head_v_dim
    threads = -(-dv // 32) * 32  # whole warps (the sums of squares reduce over warps), a thread per value column
    (y,) = _kernel("rule")(
        inputs=[conv, b, a, layer.A_log, layer.dt_bias, pool, slots],
        template=[
            ("T", conv.dtype),
            ("C", conv.shape[-1]),
            ("HV", hv),
            ("HK", hk),
            ("DK", dk),
            ("DV", dv),
            ("TPB", threads),
            ("SCALE_BITS", float32_bits(dk**-0.5)),
        ],
        grid=(hv * threads, B, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, 1, hv, dv)],
        output_dtypes=[conv.dtype],
    )
    return y


def takes(layer: GatedDeltaNet, mixed: mx.array, b: mx.array, a: mx.array, parts) -> bool:
    """Whether the kernels compute this call: one token per row, float activations, the state in the shapes and
    dtypes the kernels read, a value head of at most 1024 columns, on the GPU."""
    conv_pool, rule_pool = parts
    hv, dk, dv = layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    return (
        on_gpu()
        and mixed.shape[1] == 1
        and mixed.dtype in (mx.float32, mx.float16, mx.bfloat16)
        and b.dtype == mixed.dtype
        and a.dtype == mixed.dtype
        and mixed.shape[-1] == layer.conv_dim == 2 * layer.key_dim + layer.value_dim
        and conv_pool.shape[1:] == (layer.conv_kernel - 1, layer.conv_dim)
        and conv_pool.dtype == mixed.dtype
        and layer.conv1d.weight.shape == (layer.conv_dim, 1, layer.conv_kernel)
        and layer.conv_kernel >= 2
        and rule_pool.dtype == mx.float32
        and rule_pool.shape[1:] == (hv, dk, dv)
        and dv <= 1024
        and dk <= 4096
    )


class DeltaNetKernelsMixin:
    """`mix` on the two kernels where the storage lets them update the rows' state in place; the layer's own
    otherwise. Mixed into the layer's own class by use_delta_net_kernels."""

    def mix(self, mixed: mx.array, b: mx.array, a: mx.array, cache) -> mx.array:
        # (a forward over generated tokens, speculative verification or its re-run, may be taken back to a checkpoint
        # that holds the pool's arrays as they are: it writes new arrays)
        in_place = None if getattr(cache, "decode_tokens", False) else getattr(cache, "in_place", None)
        found = None if in_place is None else in_place()
        if found is None or not takes(self, mixed, b, a, found[0]):
            return super().mix(mixed, b, a, cache)
        (conv_pool, rule_pool), slots = found
        conv = conv_step(mixed, conv_pool, slots, self.conv1d.weight)
        out = rule_step(self, conv, b, a, rule_pool, slots)
        cache.wrote_in_place(out)
        return out


_kernel_classes: dict[type, type] = {}


def use_delta_net_kernels(model: nn.Module) -> int:
    """Swap every gated delta-net layer of `model` to its kernels' subclass, in place; returns how many."""
    swapped = 0
    for _, module in model.named_modules():
        cls = type(module)
        if isinstance(module, GatedDeltaNet) and not isinstance(module, DeltaNetKernelsMixin):
            if cls not in _kernel_classes:
                _kernel_classes[cls] = type(f"Kernel{cls.__name__}", (DeltaNetKernelsMixin, cls), {"_plain": cls})
            module.__class__ = _kernel_classes[cls]
            swapped += 1
    return swapped


def restore_delta_net(model: nn.Module) -> int:
    """Undo use_delta_net_kernels: the layers' own classes back."""
    restored = 0
    for _, module in model.named_modules():
        if isinstance(module, DeltaNetKernelsMixin):
            module.__class__ = module._plain
            restored += 1
    return restored
