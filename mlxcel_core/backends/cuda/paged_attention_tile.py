"""The CUDA text of the paged decode kernel's token loop (backends/cuda/paged_attention.py's docstring says why it is
tiled), which paged_attention_source.py puts in its kernel at /*TILE_LOOP*/. Imports nothing."""

from __future__ import annotations

# A lane group's tiles of UNROLL tokens kept as loaded (KV: half a float's registers at 16 bits), the next tile's loads
# issued before this tile's arithmetic (two tiles' buffers, used alternately), and one softmax maximum, one rescale of
# the accumulators and UNROLL exponentials a tile.
TILE_LOOP = r"""    constexpr int STEP = NVG * UNROLL;  // tokens a block's tile
    auto load_tile = [&](KV (&kr)[UNROLL][EPL], KV (&vr)[UNROLL][EPL], bool (&valid)[UNROLL], int base) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int t = base + u * NVG + vg;
            valid[u] = t < t1;
            if (valid[u]) {
                const bool fresh = NEW_KV && t == len - 1;  // (the step's own token: k_new / v_new)
                const size_t off = fresh ? (size_t(b) * HKV + kvh) * D + sub * EPL
                                         : ((size_t(table[t / BS]) * BS + (t % BS)) * HKV + kvh) * D + sub * EPL;
                const KV* kp = (fresh ? k_new : k_pool) + off;
                const KV* vp = (fresh ? v_new : v_pool) + off;
                if (aligned) {
#pragma unroll
                    for (int j = 0; j < int(EPL * sizeof(KV) / 16); ++j) {
                        reinterpret_cast<uint4*>(kr[u])[j] = reinterpret_cast<const uint4*>(kp)[j];
                        reinterpret_cast<uint4*>(vr[u])[j] = reinterpret_cast<const uint4*>(vp)[j];
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < EPL; ++i) {
                        const bool in = sub * EPL + i < D;
                        kr[u][i] = in ? kp[i] : static_cast<KV>(0.0f);
                        vr[u][i] = in ? vp[i] : static_cast<KV>(0.0f);
                    }
                }
            } else {
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    kr[u][i] = static_cast<KV>(0.0f);
                    vr[u][i] = static_cast<KV>(0.0f);
                }
            }
        }
    };
    // One tile into the lane group's online softmax (every lane takes part in the shuffles, valid or not).
    auto take_tile = [&](const KV (&kr)[UNROLL][EPL], const KV (&vr)[UNROLL][EPL], const bool (&valid)[UNROLL]) {
        float s[UNROLL][G];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                s[u][g] = 0.0f;
            }
        }
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const float kf = static_cast<float>(kr[u][i]);
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    s[u][g] = fmaf(qv[g][i], kf, s[u][g]);
                }
            }
        }
        float p[G][UNROLL];
        float corr[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
                for (int o = LPT / 2; o > 0; o >>= 1) {
                    s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], o);
                }
                if (SOFTCAP_BITS != 0) {  // Gemma 2's soft-capping: s = tanh(s / cap) * cap
                    const float cap = __int_as_float(SOFTCAP_BITS);
                    s[u][g] = tanhf(s[u][g] / cap) * cap;
                }
            }
            float mt = m[g];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                mt = valid[u] ? fmaxf(mt, s[u][g]) : mt;
            }
            corr[g] = mt == NEG_INF ? 1.0f : expf(m[g] - mt);  // 0 while m is still -inf; 1 with nothing seen yet
            float ps = 0.0f;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                p[g][u] = valid[u] ? expf(s[u][g] - mt) : 0.0f;
                ps += p[g][u];
            }
            l[g] = l[g] * corr[g] + ps;
            m[g] = mt;
        }
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            float vf[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                vf[u] = static_cast<float>(vr[u][i]);
            }
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float a = acc[g][i] * corr[g];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    a = fmaf(p[g][u], vf[u], a);
                }
                acc[g][i] = a;
            }
        }
    };
    alignas(16) KV ka[UNROLL][EPL], va[UNROLL][EPL], kb[UNROLL][EPL], vb[UNROLL][EPL];
    bool valid_a[UNROLL], valid_b[UNROLL];
    load_tile(ka, va, valid_a, t0);
    for (int base = t0; base < t1; base += 2 * STEP) {  // the same trip count for every thread of the block
        load_tile(kb, vb, valid_b, base + STEP);
        take_tile(ka, va, valid_a);
        load_tile(ka, va, valid_a, base + 2 * STEP);
        take_tile(kb, vb, valid_b);
    }"""
