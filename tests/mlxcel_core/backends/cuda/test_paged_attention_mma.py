"""The tensor-core body of the paged decode kernel (mlxcel_core/backends/cuda/paged_attention_mma.py), emulated in
numpy lane by lane: no GPU is needed, so this runs everywhere (CI has no GPU) and checks the body's index mapping.

The emulation follows BODY statement by statement for the 32 lanes of each warp (lane = 4 r + c, r = lane // 4,
c = lane % 4), with 32-bit registers holding two float16 values (the lower index in the low half), and the PTX ISA's
fragment layouts:
- mma.m16n8k16.row.col: A 16 x 16: a0a1 at (r, 2c..2c+1), a2a3 at (r+8, 2c..), a4a5 at (r, 2c+8..), a6a7 at
  (r+8, 2c+8..); B 16 x 8: b0b1 at (2c..2c+1, r), b2b3 at (2c+8.., r); C/D 16 x 8: d0 d1 at (r, 2c..2c+1), d2 d3 at
  (r+8, 2c..).
- mma.m16n8k8.row.col: A 16 x 8: a0a1 at (r, 2c..2c+1), a2a3 at (r+8, 2c..); B 8 x 8: b0b1 at (2c..2c+1, r); C/D as
  above.
- movmatrix.m8n8.trans.b16: thread (r, c) holds M[r][2c..2c+1] and gets M[2c][r], M[2c+1][r].
Each product gathers its fragments from the 32 lanes into the logical matrices, multiplies in float32 and scatters
the result back. The warps' states are merged as paged_attention_source._MERGE does, normalized as its one-split
output, and compared with softmax(q k^T scale) v in float64 for each of the block's G heads.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel_core.backends.cuda.paged_attention_mma import BODY

LANE = np.arange(32)
LR, LC = LANE >> 2, LANE & 3  # the fragment row and column pair of each lane
NEG_INF = np.float32(-np.inf)
BS, HKV, NVG = 16, 2, 2  # block size, kv heads, warps a block (STEP = 16 tokens)


def pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """mlxcel_pa_pack<__half>: two floats rounded to float16 (to nearest even) in one 32-bit word, lo the low half."""
    lo16 = np.asarray(lo, np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)
    hi16 = np.asarray(hi, np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)
    return lo16 | (hi16 << 16)


def halves(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two float16 values of 32-bit words, as float32: (low half, high half)."""
    lo = (x & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)
    hi = (x >> 16).astype(np.uint16).view(np.float16).astype(np.float32)
    return lo, hi


def place(mat: np.ndarray, rows: np.ndarray, cols: np.ndarray, word: np.ndarray) -> None:
    """Each lane's word into mat at (row, col) and (row, col + 1), asserting every element is placed once."""
    assert np.isnan(mat[rows, cols]).all() and np.isnan(mat[rows, cols + 1]).all()
    mat[rows, cols], mat[rows, cols + 1] = halves(word)


def mma16(d: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32: d [32, 4] += a [32, 4] (16 x 16) * b [32, 2] (16 x 8)."""
    am, bm = np.full((16, 16), np.nan, np.float32), np.full((16, 8), np.nan, np.float32)
    place(am, LR, 2 * LC, a[:, 0])
    place(am, LR + 8, 2 * LC, a[:, 1])
    place(am, LR, 2 * LC + 8, a[:, 2])
    place(am, LR + 8, 2 * LC + 8, a[:, 3])
    place(bm.T, LR, 2 * LC, b[:, 0])  # b0b1: B[2c..2c+1][r]
    place(bm.T, LR, 2 * LC + 8, b[:, 1])  # b2b3: B[2c+8..2c+9][r]
    return scatter_cd(gather_cd(d) + am @ bm)


def mma8(d: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32: d [32, 4] += a [32, 2] (16 x 8) * b [32] (8 x 8)."""
    am, bm = np.full((16, 8), np.nan, np.float32), np.full((8, 8), np.nan, np.float32)
    place(am, LR, 2 * LC, a[:, 0])
    place(am, LR + 8, 2 * LC, a[:, 1])
    place(bm.T, LR, 2 * LC, b)  # b0b1: B[2c..2c+1][r]
    return scatter_cd(gather_cd(d) + am @ bm)


def gather_cd(d: np.ndarray) -> np.ndarray:
    """The 16 x 8 float32 accumulator matrix from the lanes' d [32, 4]."""
    cm = np.full((16, 8), np.nan, np.float32)
    cm[LR, 2 * LC], cm[LR, 2 * LC + 1], cm[LR + 8, 2 * LC], cm[LR + 8, 2 * LC + 1] = d.T
    assert not np.isnan(cm).any()
    return cm


def scatter_cd(cm: np.ndarray) -> np.ndarray:
    """The lanes' d [32, 4] from the 16 x 8 matrix: d0 d1 at (r, 2c..2c+1), d2 d3 at (r + 8, 2c..)."""
    return np.stack([cm[LR, 2 * LC], cm[LR, 2 * LC + 1], cm[LR + 8, 2 * LC], cm[LR + 8, 2 * LC + 1]], 1)


def trans(x: np.ndarray) -> np.ndarray:
    """movmatrix.sync.aligned.m8n8.trans.b16: lane (r, c) holds M[r][2c..2c+1], gets M[2c][r], M[2c+1][r]."""
    mat = np.full((8, 8), np.nan, np.float32)
    place(mat, LR, 2 * LC, x)
    return pack(mat[2 * LC, LR], mat[2 * LC + 1, LR])


def shfl_xor(x: np.ndarray, mask: int) -> np.ndarray:
    """__shfl_xor_sync(FULL, x, mask): lane i gets lane (i ^ mask)'s x."""
    return x[LANE ^ mask]


def shfl(x: np.ndarray, src: np.ndarray) -> np.ndarray:
    """__shfl_sync(FULL, x, src): lane i gets lane src[i]'s x."""
    return x[src]


def the_dim(lr: int, i: int, dpt: int) -> int:
    """BODY's store mapping: row lr of P.V product i is dim (lr / 2) DPT + 4 i + lr % 2 (row lr + 8: the same + 2)."""
    return (lr >> 1) * dpt + 4 * i + (lr & 1)


def emulate_warp(
    vg, sm, dim, *, t0, t1, length, q16, k_pool, v_pool, table, kvh, h0, g_heads, sc, softcap, k_new, v_new
):
    """BODY for warp vg of the block: its tiles of 8 tokens into the online softmax, its state into sm = (sm_m, sm_l,
    sm_o). The arrays hold the 16-bit values as uint16, flat, indexed as the kernel indexes them (one batch row)."""
    D = sm[2].shape[2]
    DPT, RPT, KS, STEP = D // 4, D // 8, D // 16, NVG * 8
    sm_m, sm_l, sm_o = sm
    qa = np.zeros((32, KS, 2), np.uint32)
    for s in range(KS):
        for lane in range(32):
            lr, lc = LR[lane], LC[lane]
            if lr < g_heads:
                at = (h0 + lr) * D + lc * DPT + 4 * s
                qp = q16[at : at + 4].view(np.float16).astype(np.float32)
                qa[lane, s] = pack(qp[0], qp[1]), pack(qp[2], qp[3])
    m = np.full(32, NEG_INF, np.float32)
    l = np.zeros(32, np.float32)
    o = np.zeros((32, KS, 4), np.float32)

    def load(base):
        kr, vr = np.zeros((32, RPT), np.uint32), np.zeros((32, RPT), np.uint32)
        for lane in range(32):
            tok = base + LR[lane]
            if tok < t1:
                fresh = k_new is not None and tok == length - 1
                if fresh:
                    off = kvh * D + LC[lane] * DPT
                else:
                    off = ((table[tok // BS] * BS + tok % BS) * HKV + kvh) * D + LC[lane] * DPT
                k16 = (k_new if fresh else k_pool)[off : off + DPT].astype(np.uint32)
                v16 = (v_new if fresh else v_pool)[off : off + DPT].astype(np.uint32)
                kr[lane] = k16[0::2] | (k16[1::2] << 16)  # the 16-byte loads' words on a little-endian GPU
                vr[lane] = v16[0::2] | (v16[1::2] << 16)
        return kr, vr

    def take(kr, vr, base):
        nonlocal m, l, o
        c = np.zeros((32, 4), np.float32)
        for s in range(KS):
            a = np.stack([qa[:, s, 0], np.zeros(32, np.uint32), qa[:, s, 1], np.zeros(32, np.uint32)], 1)
            c = mma16(c, a, kr[:, 2 * s : 2 * s + 2])
        ta = base + 2 * LC
        v0, v1 = ta < t1, ta + 1 < t1
        s0, s1 = c[:, 0] * np.float32(sc), c[:, 1] * np.float32(sc)
        if softcap:
            cap = np.float32(softcap)
            s0, s1 = np.tanh(s0 / cap) * cap, np.tanh(s1 / cap) * cap
        mt = np.fmax(np.where(v0, s0, NEG_INF), np.where(v1, s1, NEG_INF))
        mt = np.fmax(mt, shfl_xor(mt, 1))
        mt = np.fmax(mt, shfl_xor(mt, 2))
        mn = np.fmax(m, mt)
        corr = np.where(mn == NEG_INF, np.float32(1), np.exp(m - mn))
        p0 = np.where(v0, np.exp(s0 - mn), np.float32(0))
        p1 = np.where(v1, np.exp(s1 - mn), np.float32(0))
        l = l * corr + p0 + p1
        m = mn
        ca, cb = shfl(corr, 8 * LC), shfl(corr, 8 * LC + 4)
        ph = pack(p0, p1)
        h0_, h1_ = halves(ph)
        pl = pack(p0 - h0_, p1 - h1_)
        for i in range(KS):
            va = np.stack([trans(vr[:, 2 * i]), trans(vr[:, 2 * i + 1])], 1)
            o[:, i] *= np.stack([ca, cb, ca, cb], 1)
            o[:, i] = mma8(o[:, i], va, ph)
            o[:, i] = mma8(o[:, i], va, pl)

    first = t0 + vg * 8
    ka, va = load(first)
    base = first
    while base < t1:
        kb, vb = load(base + STEP)
        take(ka, va, base)
        ka, va = load(base + 2 * STEP)
        take(kb, vb, base + STEP)
        base += 2 * STEP

    l = l + shfl_xor(l, 1)
    l = l + shfl_xor(l, 2)
    for lane in range(32):
        lr, lc = LR[lane], LC[lane]
        if lc == 0 and lr < g_heads:
            sm_m[vg, lr], sm_l[vg, lr] = m[lane], l[lane]
        for i in range(KS):
            d = dim(lr, i, DPT)
            if 2 * lc < g_heads:
                sm_o[vg, 2 * lc, d], sm_o[vg, 2 * lc, d + 2] = o[lane, i, 0], o[lane, i, 2]
            if 2 * lc + 1 < g_heads:
                sm_o[vg, 2 * lc + 1, d], sm_o[vg, 2 * lc + 1, d + 2] = o[lane, i, 1], o[lane, i, 3]


def merge(sm_m: np.ndarray, sm_l: np.ndarray, sm_o: np.ndarray) -> np.ndarray:
    """_MERGE over the NVG warps' states, then one split's output (_WRITE_OUTPUT): os / ls per head and dim."""
    mx_ = sm_m.max(0)  # [G]
    a = np.where(mx_ != NEG_INF, np.exp(sm_m - mx_), np.float32(0))  # [NVG, G]: 0 for an empty warp
    ls = (a * sm_l).sum(0)
    os_ = (a[:, :, None] * sm_o).sum(0)
    return np.where(ls[:, None] > 0, os_ / np.where(ls > 0, ls, 1)[:, None], 0)


def make_case(d_head, g_heads, length, seed, new_kv=False):
    """Random float16 q [HQ, D] and pools [blocks, BS, HKV, D] (as flat uint16) behind a shuffled block table, and for
    new_kv the step's k_new, v_new [HKV, D] (the pools' slot of position length - 1 then holds garbage)."""
    rng = np.random.default_rng(seed)
    hq = HKV * 8
    blocks = -(-length // BS) + 2
    q = rng.standard_normal((hq, d_head)).astype(np.float16)
    k = rng.standard_normal((blocks, BS, HKV, d_head)).astype(np.float16)
    v = rng.standard_normal((blocks, BS, HKV, d_head)).astype(np.float16)
    table = rng.permutation(blocks)
    k_new = v_new = None
    if new_kv:
        k_new = rng.standard_normal((HKV, d_head)).astype(np.float16)
        v_new = rng.standard_normal((HKV, d_head)).astype(np.float16)
        pos = length - 1
        k[table[pos // BS], pos % BS] = 60.0  # must never be read
        v[table[pos // BS], pos % BS] = 60.0
    return q, k, v, table, k_new, v_new


def reference(q, k, v, table, k_new, v_new, kvh, h0, g_heads, t0, t1, length, sc, softcap):
    """softmax(q k^T sc) v in float64 for heads h0 .. h0 + G - 1 over positions t0 .. t1 - 1 of kv head kvh."""
    pos = np.arange(t0, t1)
    keys = k[table[pos // BS], pos % BS, kvh].astype(np.float64)
    vals = v[table[pos // BS], pos % BS, kvh].astype(np.float64)
    if k_new is not None and t1 == length:
        keys[-1], vals[-1] = k_new[kvh], v_new[kvh]
    s = q[h0 : h0 + g_heads].astype(np.float64) @ keys.T * sc
    if softcap:
        s = np.tanh(s / softcap) * softcap
    p = np.exp(s - s.max(1, keepdims=True))
    return (p / p.sum(1, keepdims=True)) @ vals


def run_block(d_head, g_heads, t0, t1, length, seed=0, kvh=1, h0=0, softcap=0.0, new_kv=False, dim=the_dim):
    """The block's NVG warps emulated and merged, and the reference: (output [G, D] float32, reference float64)."""
    q, k, v, table, k_new, v_new = make_case(d_head, g_heads, length, seed, new_kv)
    sc = 1.0 / np.sqrt(d_head)
    flat = lambda a: None if a is None else a.reshape(-1).view(np.uint16)
    sm = (
        np.full((NVG, g_heads), np.nan, np.float32),
        np.full((NVG, g_heads), np.nan, np.float32),
        np.full((NVG, g_heads, d_head), np.nan, np.float32),  # shared memory starts undefined
    )
    args = dict(t0=t0, t1=t1, length=length, table=table, kvh=kvh, h0=h0, g_heads=g_heads, sc=sc, softcap=softcap)
    args.update(q16=flat(q), k_pool=flat(k), v_pool=flat(v), k_new=flat(k_new), v_new=flat(v_new))
    with np.errstate(invalid="ignore", over="ignore"):  # (-inf) - (-inf), exp of masked lanes: discarded by where
        for vg in range(NVG):
            emulate_warp(vg, sm, dim, **args)
        out = merge(*sm)
    ref = reference(q, k, v, table, k_new, v_new, kvh, h0, g_heads, t0, t1, length, sc, softcap)
    return out, ref


TOL = 2e-4  # P.V takes P as hi + lo float16 terms (about 16 bits); the inputs are float16 values


@pytest.mark.parametrize("g_heads", [1, 4, 8])
@pytest.mark.parametrize("d_head", [64, 128])
def test_emulated_body_matches_the_reference(d_head, g_heads):
    """43 tokens (5 whole tiles and one of 3): warp 0 takes tiles 0, 16, 32; warp 1 tiles 8, 24 and 40 (tokens
    40..42 valid) and 56 (none valid). Every head's output at every dim within float32 rounding."""
    out, ref = run_block(d_head, g_heads, 0, 43, 43, seed=d_head + g_heads, h0=8)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_emulated_split_with_the_steps_kv(softcap):
    """A split starting off a tile boundary (positions 13..50 of 51, block table shuffled) whose last position comes
    from k_new / v_new, with and without soft-capping: the reference of the same positions."""
    out, ref = run_block(128, 4, 13, 51, 51, seed=7, kvh=0, h0=4, softcap=softcap, new_kv=True)
    np.testing.assert_allclose(out, ref, rtol=TOL, atol=TOL)


def test_emulated_context_shorter_than_a_tile():
    """5 tokens: warp 0's first tile holds them all, warp 1 starts past t1 and leaves m = -inf, l = 0, o = 0, which
    the merge weighs 0."""
    out, ref = run_block(64, 8, 0, 5, 5, seed=3)
    np.testing.assert_allclose(out, ref, rtol=TOL, atol=TOL)


def test_a_wrong_dim_mapping_fails():
    """The same emulation storing row lr of product i at dim (lr / 2) DPT + 2 i + lr % 2 (dims missed and others
    overwritten) is far from the reference: the comparison above can fail."""
    out, ref = run_block(64, 4, 0, 43, 43, dim=lambda lr, i, dpt: (lr >> 1) * dpt + 2 * i + (lr & 1))
    assert np.nan_to_num(np.abs(out - ref), nan=np.inf).max() > 0.1


def test_the_emulated_statements_are_bodys():
    """The lines the emulation follows are BODY's own (an edited body must be emulated again)."""
    for line in [
        "lc * DPT + 4 * s;",
        "const uint32_t a[4] = {qa[s][0], 0u, qa[s][1], 0u};",
        "const uint32_t kb[2] = {kr[2 * s], kr[2 * s + 1]};",
        "const int ta = base + 2 * lc;",
        "const float ca = __shfl_sync(FULL, corr, 8 * lc);",
        "const float cb = __shfl_sync(FULL, corr, 8 * lc + 4);",
        "const uint32_t ph = mlxcel_pa_pack<KV>(p0, p1);",
        "const uint32_t pl = mlxcel_pa_pack<KV>(p0 - hf.x, p1 - hf.y);",
        "mlxcel_pa_mma8<KV>(o[i], va, pl);",
        "const uint32_t va[2] = {mlxcel_pa_trans(vr[2 * i]), mlxcel_pa_trans(vr[2 * i + 1])};",
        "o[i][0] *= ca;",
        "o[i][1] *= cb;",
        "const int first = t0 + vg * 8;",
        "for (int base = first; base < t1; base += 2 * STEP) {",
        "const int d = (lr >> 1) * DPT + 4 * i + (lr & 1);",
        "sm_o[vg][2 * lc][d + 2] = o[i][2];",
        "sm_o[vg][2 * lc + 1][d + 2] = o[i][3];",
    ]:
        assert line in BODY, line


def _run_loop(loop: str, tiles: int, warps: int = 4) -> list[tuple[int, int]]:
    """Follow a register loop's loads and takes (tile units: STEP = the warps' count, a warp's first tile = its
    index): each take's (tile it names, tile its buffer holds), in order, for one warp over `tiles` of the split."""
    import re

    held: dict[str, int] = {}
    taken = []

    def run(statement: str, base: int) -> None:
        if not statement.startswith(("load(", "take(")):
            return  # (the buffers' declaration, the warp's first token)
        call = re.fullmatch(
            r"(load|take)\((k\d|ka|kb), (?:v\d|va|vb), (?:first|base)( \+ (?:(\d+) \* )?STEP)?\);", statement
        )
        assert call, statement
        tile = base + (int(call.group(4) or 1) if call.group(3) else 0) * warps
        if call.group(1) == "load":
            held[call.group(2)] = tile
        else:
            taken.append((tile, held[call.group(2)]))

    lines = [line.strip() for line in loop.strip().splitlines() if line.strip()]
    head = lines.index(next(line for line in lines if line.startswith("for (")))
    step = int(re.search(r"base \+= (\d+) \* STEP", lines[head]).group(1))
    first = 1  # (the warp's tile: vg = 1)
    for statement in lines[:head]:
        run(statement, first)
    for base in range(first, tiles, step * warps):
        for statement in lines[head + 1 : lines.index("}", head)]:
            run(statement, base)
    return taken


@pytest.mark.parametrize("depth", [2, 3, 4])
@pytest.mark.parametrize("tiles", [1, 2, 5, 12, 33])
def test_each_depths_loop_takes_every_tile_of_the_warp_once_in_order_from_the_buffer_that_holds_it(depth, tiles):
    from mlxcel_core.backends.cuda.paged_attention_mma import _register_loop

    taken = _run_loop(_register_loop(depth), tiles)
    assert all(named == held for named, held in taken)  # (a buffer is never taken before its tile is loaded into it)
    named = [tile for tile, _ in taken]
    assert named == sorted(named) and len(set(named)) == len(named)
    assert [t for t in named if t < tiles] == list(range(1, tiles, 4))  # the warp's tiles, each once
    assert len(named) % depth == 0 and all(t < tiles + depth * 4 for t in named)  # (tiles past the split: empty)


def test_the_depths_are_two_to_four():
    from mlxcel_core.backends.cuda.paged_attention_mma import body

    assert body(2) == BODY and "k3[RPT]" in body(4)
    with pytest.raises(ValueError, match="2 to 4"):
        body(5)
