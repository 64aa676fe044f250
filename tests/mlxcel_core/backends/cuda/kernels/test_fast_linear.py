"""The layer swap (mlxcel_core/backends/cuda/kernels/fast_linear.py): which layers become the kernel's, its gate and
row limits, a decode batch beyond one launch (kernels/qmm.py), the load_model / build_random_model hooks and greedy
tokens of a tiny quantized model with the swap. The kernel itself: test_qmv.py (whose helpers these use).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from test_qmv import check_close, greedy, make_operands, needs_cuda, reference

from mlxcel_core.backends.cuda.kernels import fast_linear, hmv, qmm, qmv
from mlxcel_core.backends.cuda.kernels.fast_linear import (
    FastQuantizedEmbedding,
    FastQuantizedLinear,
    enabled,
    maybe_use_fast_quantized_linear,
    restore_quantized_linear,
    use_fast_quantized_linear,
)
from mlxcel_core.backends.cuda.kernels.qmv import cuda_kernel_available


# -- the layer swap --------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _swap_every_layer(monkeypatch):
    """Tests swap every supported layer whatever its size and use the kernel up to MAX_ROWS rows (the tiny test
    models are far below MIN_WEIGHT); test_default_thresholds checks the defaults."""
    monkeypatch.setattr(fast_linear, "MIN_WEIGHT", 0)
    monkeypatch.setattr(fast_linear, "LAYER_MAX_ROWS", qmv.MAX_ROWS)


def test_default_thresholds(monkeypatch):
    monkeypatch.undo()
    assert fast_linear.LAYER_MAX_ROWS == qmv.MAX_ROWS and fast_linear.MIN_WEIGHT == 1 << 23
    small = nn.QuantizedLinear(4096, 1024, bias=False, group_size=64, bits=4)  # Llama-3-8B's k/v: 2^22
    large = nn.QuantizedLinear(4096, 4096, bias=False, group_size=64, bits=4)
    holder = nn.Module()
    holder.layers = [small, large]
    assert use_fast_quantized_linear(holder) == 1
    assert type(small) is nn.QuantizedLinear and type(large) is FastQuantizedLinear
    x = mx.random.normal((fast_linear.LAYER_MAX_ROWS + 1, 4096), key=mx.random.key(0))
    assert mx.array_equal(large(x), nn.QuantizedLinear.__call__(large, x)).item()  # more rows: MLX's own call


def test_a_decode_batch_beyond_the_kernel(monkeypatch):
    """A decode batch of more rows than one launch of the matvec kernel takes ([B, 1, K]), through a swapped layer and
    a tied LM head, and a fused projection where the kernels run it: one launch of kernels/qmm.py each (a stand-in
    here), the matvec kernel not at all. MLX's values every time; a prompt's rows go in as they come."""
    from mlxcel_core.backends.cuda.kernels.fused_projections import FusedProjection

    layer = nn.QuantizedLinear(256, 128, bias=True, group_size=64, bits=4)
    emb = nn.QuantizedEmbedding(96, 256, group_size=64, bits=4)
    holder = nn.Module()
    holder.layers = [layer, emb]
    assert use_fast_quantized_linear(holder) == 2
    rows = 2 * fast_linear.LAYER_MAX_ROWS + 3
    x = mx.random.normal((rows, 1, 256), key=mx.random.key(1)).astype(mx.bfloat16)  # (qmm.py takes 16-bit x)
    want = [nn.QuantizedLinear.__call__(layer, x), nn.QuantizedEmbedding.as_linear(emb, x)]
    fused = FusedProjection([layer, nn.QuantizedLinear(256, 64, bias=True, group_size=64, bits=4)])
    fused.kernel = True  # (as where the 4-bit kernels run it)
    p = fused.params
    want_fused = mx.quantized_matmul(
        x, p["weight"], scales=p["scales"], biases=p["biases"], transpose=True, group_size=64, bits=4
    )
    want_fused = want_fused + p["bias"]

    seen, launched = [], []
    real = mx.quantized_matmul

    def spy(x, *args, **kwargs):
        seen.append(x.shape)
        return real(x, *args, **kwargs)

    def stand_in(args, x, w, scales, biases, mode="plain", extra=()):  # the kernel's product, through MLX
        launched.append(x.shape)
        return real(x, w, scales=scales, biases=biases, transpose=True, group_size=64, bits=4)

    def mma_stand_in(x, w, scales, biases, group_size):
        launched.append(("mma", x.shape))
        return real(x, w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=4)

    monkeypatch.setattr(qmv, "kernel_ready", lambda: True)
    monkeypatch.setattr(qmv, "launch", stand_in)
    monkeypatch.setattr(qmm, "quantized_matmul", mma_stand_in)
    monkeypatch.setattr(mx, "quantized_matmul", spy)
    got = [layer(x), emb.as_linear(x), fused.matmul(x)]
    assert launched == [("mma", (rows, 1, 256))] * 3 and seen == []
    for g, w in zip(got, [*want, want_fused]):
        assert g.shape == w.shape and mx.array_equal(g, w).item()
    seen.clear()
    prompt = mx.random.normal((1, 3 * fast_linear.LAYER_MAX_ROWS, 256), key=mx.random.key(2))
    assert mx.array_equal(layer(prompt), nn.QuantizedLinear.__call__(layer, prompt)).item()
    assert seen[0] == prompt.shape


def test_mma_takes_a_batch_beyond_its_rows_in_launches_of_max_rows(monkeypatch):
    """A decode batch of more than qmm.MAX_ROWS rows: launches of that many rows, the last one short (a server batch
    may exceed one launch); MLX's values, in order."""
    most = qmm.MAX_ROWS
    layer = nn.QuantizedLinear(256, 128, bias=False, group_size=64, bits=4)
    holder = nn.Module()
    holder.layers = [layer]
    assert use_fast_quantized_linear(holder) == 1
    rows = 2 * most + 5
    x = mx.random.normal((rows, 1, 256), key=mx.random.key(3)).astype(mx.bfloat16)
    # MLX's product on the CPU stream, here and in the stand-in: exact MLX ops whatever the device, each row's value
    # independent of how many rows a call has (on CUDA, MLX's quantized_matmul picks its kernel by the rows, so 32
    # rows and 69 differ in the last bits, and what is checked here is the launches' rows and their order)
    with mx.stream(mx.cpu):
        want = nn.QuantizedLinear.__call__(layer, x)
        mx.eval(want)
    launched = []
    real = mx.quantized_matmul

    def mma_stand_in(x, w, scales, biases, group_size):
        launched.append(x.shape)
        return real(x, w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=4, stream=mx.cpu)

    monkeypatch.setattr(qmv, "kernel_ready", lambda: True)
    monkeypatch.setattr(qmv, "launch", lambda *args, **kwargs: None)  # never reached: more rows than it takes
    monkeypatch.setattr(qmm, "quantized_matmul", mma_stand_in)
    got = layer(x)
    assert launched == [(most, 1, 256), (most, 1, 256), (5, 1, 256)]
    assert got.shape == want.shape and mx.array_equal(got, want).item()


def test_decode_batches_of_six_rows_or_more_take_the_batch_kernel(monkeypatch):
    """Decode batches of DECODE_MATVEC_ROWS + 1 = 6 rows or more take kernels/qmm.py (a stand-in here) through a
    swapped layer, a tied LM head and a fused projection (its q/k/v and swiglu modes then decline); 5 rows keep the
    matvec kernel, and so do a lone row (the CUDA graph's step), a short prompt's rows up to 8 and a float32 batch
    (which the batch kernel does not take)."""
    from mlxcel_core.backends.cuda.kernels.fused_projections import FusedProjection
    from mlxcel_core.models.activations import swiglu

    layer = nn.QuantizedLinear(256, 128, bias=False, group_size=64, bits=4)
    emb = nn.QuantizedEmbedding(96, 256, group_size=64, bits=4)
    holder = nn.Module()
    holder.layers = [layer, emb]
    assert use_fast_quantized_linear(holder) == 2
    fused = FusedProjection([nn.QuantizedLinear(256, 64, bias=False, group_size=64, bits=4) for _ in range(2)])
    fused.kernel = True  # (as where the 4-bit kernels run it)
    launched = []
    real = mx.quantized_matmul

    def stand_in(args, x, w, scales, biases, mode="plain", extra=()):
        launched.append(("qmv", mode, x.shape[0]))
        return real(x, w, scales=scales, biases=biases, transpose=True, group_size=64, bits=4)

    def mma_stand_in(x, w, scales, biases, group_size):
        launched.append(("mma", x.shape[0]))
        return real(x, w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=4)

    monkeypatch.setattr(qmv, "kernel_ready", lambda: True)
    monkeypatch.setattr(qmv, "launch", stand_in)
    monkeypatch.setattr(qmm, "quantized_matmul", mma_stand_in)
    assert fast_linear.DECODE_MATVEC_ROWS == 5
    assert fast_linear.matvec_rows(mx.zeros((6, 1, 256), mx.bfloat16)) == 5
    assert fast_linear.matvec_rows(mx.zeros((6, 1, 256), mx.float32)) == 8
    assert fast_linear.matvec_rows(mx.zeros((1, 6, 256))) == fast_linear.matvec_rows(mx.zeros((1, 1, 256))) == 8
    for shape in [(6, 1, 256), (8, 1, 256), (5, 1, 256), (1, 1, 256), (1, 8, 256)]:
        x = mx.random.normal(shape, key=mx.random.key(shape[0])).astype(mx.bfloat16)
        rows = shape[0]  # (what the stand-ins record: x's first dimension)
        launched.clear()
        layer(x), emb.as_linear(x), fused.gated(x, swiglu)
        if shape[0] >= 6:
            assert launched == [("mma", rows)] * 3, shape
        else:  # the matvec kernel, in the fused swiglu mode too
            assert launched == [("qmv", "plain", rows), ("qmv", "plain", rows), ("qmv", "swiglu", rows)], shape


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        from mlxcel_core.distributed.shard import RowParallelQuantizedLinear

        self.a = nn.QuantizedLinear(128, 64, bias=True, group_size=64, bits=4)
        self.b = nn.QuantizedLinear(128, 64, bias=False, group_size=32, bits=4)
        self.eight = nn.QuantizedLinear(128, 64, bias=False, group_size=64, bits=8)
        self.dense = nn.Linear(128, 64)
        self.emb = nn.QuantizedEmbedding(100, 128, group_size=64, bits=4)
        self.row = nn.QuantizedLinear(128, 64, bias=False, group_size=64, bits=4)
        self.row.__class__ = RowParallelQuantizedLinear
        self.layers = [nn.QuantizedLinear(256, 32, bias=False, group_size=128, bits=4)]


def test_swap_touches_only_plain_supported_layers():
    from mlxcel_core.distributed.shard import RowParallelQuantizedLinear

    block = _Block()
    before = {k: v for k, v in block.parameters().items()}
    assert use_fast_quantized_linear(block) == 4
    assert type(block.a) is FastQuantizedLinear and type(block.b) is FastQuantizedLinear
    assert type(block.layers[0]) is FastQuantizedLinear and type(block.emb) is FastQuantizedEmbedding
    assert type(block.eight) is nn.QuantizedLinear and type(block.dense) is nn.Linear
    assert type(block.row) is RowParallelQuantizedLinear
    assert isinstance(block.a, nn.QuantizedLinear) and isinstance(block.emb, nn.QuantizedEmbedding)
    assert block.parameters().keys() == before.keys()
    assert use_fast_quantized_linear(block) == 0  # idempotent
    assert restore_quantized_linear(block) == 4
    assert type(block.a) is nn.QuantizedLinear and type(block.emb) is nn.QuantizedEmbedding


@pytest.mark.parametrize("width, rows", [(2048, 8), (4096, 2), (None, 2)])
def test_sixteen_bit_rows_follow_the_model_width(width, rows):
    """The 16-bit kernel takes 8 rows a call in models up to 2048 wide (1B bf16 b=8 on the H200: 3119 vs 1685 tok/s)
    and 2 in wider ones (8B bf16: 717 vs 1108), fused projections included."""
    from mlxcel_core.backends.cuda.kernels.fused_projections import fuse_projections, unfuse_projections
    from mlxcel_core.loading.shapes import build_random_model

    model, _ = build_random_model("tiny")
    # plain layers, unfused: on CUDA the backend's prepare step already swapped them (rows of the built model's own
    # width, 128: 8) and fused them, and neither swap nor fusion redoes what is done
    unfuse_projections(model)
    restore_quantized_linear(model)
    if width is None:  # no 16-bit embedding (a 4-bit one): the width is unknown
        model.model.embed_tokens = nn.QuantizedEmbedding(64, 64, group_size=64, bits=4)
    else:
        model.model.embed_tokens = nn.Embedding(8, width)
        model.model.embed_tokens.set_dtype(mx.bfloat16)
    assert fast_linear.use_fast_half_linear(model) > 0
    fuse_projections(model)
    attention = model.model.layers[0].self_attn
    assert type(attention.o_proj) is fast_linear.FastLinear and attention.fused_qkv.half_kernel
    assert attention.o_proj.kernel_rows == attention.fused_qkv.half_rows == rows


def test_fast_layers_compute_what_mlx_layers_do():
    """Decode shapes (kernel on CUDA), a prefill shape (always mx.quantized_matmul), embedding lookups."""
    block = _Block()
    shapes = [(1, 128), (1, 1, 128), (2, 4, 128), (4, 3, 128)]
    xs = [mx.random.normal(shape, key=mx.random.key(i)) for i, shape in enumerate(shapes)]
    ids = mx.array([[1, 5, 99]])

    def outputs():
        return [
            y
            for x in xs
            for y in (block.a(x), block.b(x), block.layers[0](mx.concatenate([x, x], -1)), block.emb.as_linear(x))
        ] + [block.emb(ids)]

    want = outputs()
    use_fast_quantized_linear(block)
    got = outputs()
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        if cuda_kernel_available():  # float32 here: both accurate to ~1e-6
            assert mx.allclose(g, w, rtol=1e-4, atol=1e-4).item()
        else:
            assert mx.array_equal(g, w).item()


def test_gate_is_on_where_the_cuda_kernel_is(monkeypatch):
    monkeypatch.setattr(qmv, "cuda_kernel_available", lambda: False)
    assert not enabled()  # no CUDA: never
    monkeypatch.setattr(qmv, "cuda_kernel_available", lambda: True)
    assert enabled()


def test_maybe_use_follows_the_gate(monkeypatch):
    block = _Block()
    monkeypatch.setattr(fast_linear, "enabled", lambda: False)
    assert maybe_use_fast_quantized_linear(block) == 0 and type(block.a) is nn.QuantizedLinear
    monkeypatch.setattr(fast_linear, "enabled", lambda: True)
    assert maybe_use_fast_quantized_linear(block) == 4 and type(block.a) is FastQuantizedLinear


PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 200, 31]


def test_swap_keeps_greedy_tokens_on_tiny_quantized_model(tiny_q4):
    """Here (no CUDA) the swapped layers are MLX's computation exactly: identical logits and tokens. On CUDA the
    kernel's arithmetic differs from MLX's (test_greedy_tiny_quantized_checkpoint_vs_float32_matvec)."""
    from mlxcel_core.loading import load_model

    model = load_model(str(tiny_q4), log=lambda m: None).model
    restore_quantized_linear(model)  # the plain model, whatever the gate gave it at load
    assert use_fast_quantized_linear(model) == 2 * 7 + 2  # 7 projections per layer, LM head, embedding
    if cuda_kernel_available():
        pytest.skip("with CUDA the kernel runs: see the CUDA tests on this checkpoint")
    restore_quantized_linear(model)
    want = greedy(model, PROMPT, 16)
    want_short = greedy(model, PROMPT[:3], 8)  # a short prompt: prefill has few rows too
    logits = model(mx.array([PROMPT[:3]]))
    use_fast_quantized_linear(model)
    assert greedy(model, PROMPT, 16) == want and greedy(model, PROMPT[:3], 8) == want_short
    assert mx.array_equal(model(mx.array([PROMPT[:3]])), logits).item()


def test_load_model_and_random_model_apply_the_swap(monkeypatch, tiny_q4):
    """Through the CUDA backend's preparation (made this process's backend here, on any machine)."""
    from mlxcel_core import backends
    from mlxcel_core.backends.cuda.backend import CudaBackend
    from mlxcel_core.loading import load_model
    from mlxcel_core.loading.shapes import build_random_model

    monkeypatch.setattr(backends, "_current", CudaBackend())
    for on in (True, False):
        monkeypatch.setattr(fast_linear, "enabled", lambda on=on: on)
        model = load_model(str(tiny_q4), log=lambda m: None).model
        expect = FastQuantizedLinear if on else nn.QuantizedLinear
        assert type(model.model.layers[0].self_attn.q_proj) is expect and type(model.lm_head) is expect
        random_model, _ = build_random_model("tiny", bits=4)
        assert type(random_model.model.layers[1].mlp.down_proj) is expect
        unquantized, _ = build_random_model("tiny")  # 16-bit layers: the 16-bit kernel's gate decides (hmv.enabled)
        half = fast_linear.FastLinear if hmv.enabled(128) else nn.Linear
        assert type(unquantized.model.layers[0].mlp.down_proj) is half


# -- CUDA ------------------------------------------------------------------------------------------------------
@needs_cuda
def test_a_decode_batch_on_the_gpu():
    """A decode batch of 19 rows ([19, 1, K]) through a swapped layer: kernels/qmm.py gives the float64 reference's
    values (its weights made in bf16 as the kernel makes them) within the kernel tests' tolerance."""
    x, w, scales, biases = make_operands(19, 1024, 4096, mx.bfloat16, seed=13)
    ref, mag = reference(x, w, scales, biases, weights_in=mx.bfloat16)
    layer = nn.QuantizedLinear(4096, 1024, bias=False, group_size=64, bits=4)
    layer.weight, layer.scales, layer.biases = w, scales, biases
    holder = nn.Module()
    holder.layers = [layer]
    assert use_fast_quantized_linear(holder) == 1
    y = layer(x[:, None, :])
    assert y.shape == (19, 1, 1024)
    check_close(y[:, 0], ref, mag, mx.bfloat16, "19 rows")


def test_engine_decode_batch_beyond_the_kernel(monkeypatch, tiny_q4):
    """The engine's decode batch of 12 sequences: its [12, 1, K] rows reach kernels/qmm.py (a stand-in computing MLX's
    product here) at once; every sequence's greedy tokens are those of the same batch on MLX's layers."""
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.loading import load_model
    from mlxcel_core.sampling import SamplingParams

    lm = load_model(str(tiny_q4), log=lambda m: None)
    lm.tokenizer.eos_token_ids = set()
    restore_quantized_linear(lm.model)
    use_fast_quantized_linear(lm.model)
    prompts = [[5 + i, 40 + 3 * i, 7, 90 - i][: 2 + i % 3] for i in range(12)]
    real = mx.quantized_matmul
    launched, multiplied = [], []

    def spy(x, *args, **kwargs):
        multiplied.append(x.shape[:-1])
        return real(x, *args, **kwargs)

    def run():
        # decode steps op by op: a compiled step (the default on a GPU) is traced once and its trace kept with the
        # model across engines, so the second run would replay the first run's products and never call the stand-ins
        # below; no recorded graph either (CUDA: a lone row's steps)
        config = EngineConfig(max_batch_size=12, compile_decode=False, decode_graph=False)
        engine = Engine(lm.model, lm.tokenizer, config)
        ids = [engine.open(p, SamplingParams(max_tokens=16)) for p in prompts]  # all 12 decode together
        out = {}
        while engine.has_work():
            for o in engine.step():
                assert o.error is None, o.error
                if o.token is not None:
                    out.setdefault(o.seq_id, []).append(o.token)
        return [out[i] for i in ids]

    def mma_stand_in(x, w, scales, biases, group_size):
        launched.append(("mma", *x.shape[:-1]))
        return real(x, w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=4)

    # MLX's products in both runs for every call of up to LAYER_MAX_ROWS rows (on CUDA the matvec kernel would take
    # those in the first run only); then the tiny model's float32 decode batches are MLX's quantized_matmul on the
    # same [12, 1, K] rows in both: in the first MLX's own call (kernels/qmm.py does not take float32), in the
    # second the stand-in's
    monkeypatch.setattr(fast_linear, "_kernel_matvec", lambda *args, **kwargs: None)
    want = run()
    monkeypatch.setattr(qmv, "kernel_ready", lambda: True)  # the layers' own kernel: the stand-in (None) above
    monkeypatch.setattr(qmm, "quantized_matmul", mma_stand_in)
    monkeypatch.setattr(qmm, "launch_args", lambda *args: {})  # (float32: the stand-in takes it)
    monkeypatch.setattr(mx, "quantized_matmul", spy)
    got = run()
    assert got == want and all(len(tokens) == 16 for tokens in got)
    assert ("mma", 12, 1) in launched and (12, 1) not in multiplied


def _batched_greedy(model, prompts: mx.array, steps: int, forced=None):
    """Greedy decoding of a batch of equal-length prompts [B, L] in one cache (decode steps are [B, 1] rows);
    with `forced` ([B, steps] tokens) those tokens are fed instead. Returns (tokens [B, steps], float32 logits
    [steps, B, vocab])."""
    import numpy as np

    from mlxcel_core.cache import make_cache

    cache = make_cache(len(model.layers))
    logits = model(prompts, cache)[:, -1]
    tokens, seen = [], []
    for i in range(steps):
        seen.append(np.array(logits.astype(mx.float32)))
        token = mx.argmax(logits, axis=-1) if forced is None else forced[:, i]
        tokens.append(token)
        logits = model(token[:, None], cache)[:, -1]
    return mx.stack(tokens, axis=1), np.stack(seen)


@needs_cuda
@pytest.mark.parametrize("n", [12, 6], ids=["12-rows", "6-rows"])
def test_mma_decode_batch_keeps_greedy_tokens_on_the_gpu(monkeypatch, n):
    """A random 4-bit llama-3.2-1b-shaped model (bf16) decoding n sequences at once (12; and 6, the fewest a decode
    batch takes the batch kernel from): every decode product runs on kernels/qmm.py and its greedy tokens are those
    of MLX's own layers, except at a near-tie: teacher-forced on MLX's tokens, every step's logits agree within 0.25
    x their std (test_qmv_models' bf16 bound) and where the argmaxes differ MLX's gap between them is within 2x that
    step's difference."""
    from mlxcel_core.loading.shapes import build_random_model

    monkeypatch.undo()  # the real thresholds: the layers a 1B model swaps by default
    model, _ = build_random_model("llama-3.2-1b", bits=4, dtype="bfloat16", seed=1)
    prompts = mx.array([[5 + i, 40 + 3 * i, 7, 90 - i] for i in range(n)])
    launched = []
    real = qmm.quantized_matmul
    real_batch = fast_linear.batch_product

    def counted(x, *args):
        launched.append(x.shape)
        return real(x, *args)

    # MLX's own products where the batch kernel would run (the layers' and the fused projections')
    monkeypatch.setattr(fast_linear, "batch_product", lambda *args: None)
    want, want_logits = _batched_greedy(model, prompts, 12)
    monkeypatch.setattr(fast_linear, "batch_product", real_batch)
    monkeypatch.setattr(qmm, "quantized_matmul", counted)
    got, _ = _batched_greedy(model, prompts, 12)
    _, forced_logits = _batched_greedy(model, prompts, 12, forced=want)
    assert (n, 1, 2048) in launched
    spread = float(want_logits.std())
    for step, (r_rows, f_rows) in enumerate(zip(want_logits, forced_logits)):
        for row, (r, f) in enumerate(zip(r_rows, f_rows)):
            diff = float(abs(r - f).max())
            assert diff <= 0.25 * spread, f"step {step}, sequence {row}: logits differ by {diff:.4g} (std {spread:.4g})"
            a, b = int(r.argmax()), int(f.argmax())
            assert a == b or r[a] - r[b] <= 2 * diff, f"step {step}, sequence {row}: argmax {a} vs {b}, not a near-tie"
    agree = int((got == want).all(axis=1).sum().item())
    print(f"mma vs mlx: {agree} of {n} sequences identical over 12 steps")
