"""Fused decode projections (kernels/fused_projections.py) and the qmv kernel's "qkv" and "swiglu" modes.

Everywhere: fused == separate projections bit for bit (logits of prefill and decode steps, float32 and bf16, plain
and 4-bit), parameter names and values unchanged, what is fused and what is not, the blocks' class swap and its undoing,
and greedy tokens through `mlxcel generate` with the loaded model fused. CUDA only: the kernel modes against float64
references.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_qmv import check_close, make_operands, needs_cuda, reference

from mlxcel_core import cpu_blas
from mlxcel_core.backends.cuda.kernels import fast_linear, fused_projections, qmv
from mlxcel_core.backends.cuda.kernels.fused_projections import (
    FUSED_MAX_ROWS,
    FusedAttentionMixin,
    FusedGatedMLPMixin,
    FusedProjection,
    fuse_projections,
    unfuse_projections,
)
from mlxcel_core.cache import make_cache
from mlxcel_core.loading.shapes import build_random_model
from mlxcel_core.models.activations import geglu, swiglu
from mlxcel_core.models.transformer import Attention, GatedMLP


def _decode_logits(model, batch: int = 1, steps: int = 4) -> mx.array:
    """Prefill of 8 tokens per row (separate projections: more rows than FUSED_MAX_ROWS when batch > 1, else the
    fused path too), then `steps` one-token decode steps; every step's last logits."""
    caches = make_cache(len(model.layers))
    prompt = mx.array([[3 + r, 1, 4, 1, 5, 9, 2, 6] for r in range(batch)])
    out = [model(prompt, caches)[:, -1]]
    for t in range(steps):
        out.append(model(mx.array([[t + 7 + r] for r in range(batch)]), caches)[:, -1])
    return mx.concatenate(out)


# On a GPU the fused and the separate products are different kernels (CUDA: kernels/qmv.py's or hmv.py's fused
# modes against MLX's quantized_matmul or fast_linear's single-layer launches; a float32 matmul of the concatenated
# weight against one per layer, where cuBLAS picks by shape): the same values up to the order of the float32 sums and
# each side's rounding of its output, not bit for bit. Bounds per element: REL x |y| + MAG x (|x| @ |W|.T) for a
# projection; for logits REL x |separate| + MAG x std(separate). A wrong weight slice or row mapping is off by about
# |y| itself (random weights), a few hundred times MAG.
_GPU_BOUNDS = {"float32": (1e-4, 1e-4), "bfloat16": (2.0**-6, 2.0**-7)}  # (REL, MAG)
_LOGIT_BOUNDS = {"float32": (1e-4, 1e-4), "bfloat16": (2.0**-6, 0.05)}


def _on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


def _np64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def _weight64(layer: nn.Module) -> np.ndarray:
    """The layer's weight as float64 (4-bit: dequantized on the CPU stream, exact but for one rounding)."""
    if isinstance(layer, nn.QuantizedLinear):
        with mx.stream(mx.cpu):
            w = mx.dequantize(layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits)
            mx.eval(w)
        return _np64(w)
    return _np64(layer["weight"])


def _bitwise(dtype: str) -> bool:
    """Whether MLX's ops compute fused and separate projections bit for bit: on the CPU, but for float32 products on
    OpenBLAS (cpu_blas.py), whose rounding depends on a product's width (its tiles are rows, not columns), and a
    fused projection is wider than its parts; there the GPU's bounds apply."""
    return not _on_gpu() and not (dtype == "float32" and cpu_blas.active())


def _assert_agrees(got: mx.array, want: mx.array, mag: np.ndarray, dtype: str, what: str) -> None:
    """got == want bit for bit where MLX's CPU ops compute both; on a GPU within _GPU_BOUNDS (mag: |x| @ |W|.T of
    each element, or a scalar)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    if _bitwise(dtype):
        assert mx.array_equal(got, want).item(), what
        return
    g, w = _np64(got), _np64(want)
    assert np.isfinite(g).all(), what
    rel, mag_factor = _GPU_BOUNDS[dtype]
    excess = np.abs(g - w) - (rel * np.abs(w) + mag_factor * mag)
    assert excess.max() <= 0, f"{what}: off by {np.abs(g - w).max():.4g} (worst excess {excess.max():.4g})"


def _assert_projections_agree(model, batch: int, dtype: str) -> None:
    """Every fused projection's outputs, split by split, against its own separate layers on one decode-shaped input:
    q/k/v (FusedProjection.split: the kernel's "qkv" mode where it runs) and act(gate) * up (FusedProjection.gated:
    its "swiglu" mode). Each split is checked against the layer it replaces, so a wrong slice or row order fails."""
    hidden = model.args.hidden_size
    for i, layer in enumerate(model.layers):
        x = mx.random.normal((batch, 1, hidden), key=mx.random.key(100 + i)).astype(getattr(mx, dtype))
        x64 = np.abs(_np64(x)).reshape(batch, hidden)
        attn, mlp = layer.self_attn, layer.mlp
        separate = [attn.q_proj, attn.k_proj, attn.v_proj]
        outs = attn.fused_qkv.split(x)
        assert len(outs) == 3
        for name, out, proj in zip("qkv", outs, separate):
            mag = (x64 @ np.abs(_weight64(proj)).T).reshape(out.shape)
            _assert_agrees(out, proj(x), mag, dtype, f"layer {i} {name}")
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        want = mlp.activation(gate, up)
        # act(g) * u moves by about |act(g)| x (u's error) + |u| x (g's error): bound both by their layers' mag
        mag_g = (x64 @ np.abs(_weight64(mlp.gate_proj)).T).reshape(want.shape)
        mag_u = (x64 @ np.abs(_weight64(mlp.up_proj)).T).reshape(want.shape)
        mag = np.abs(_np64(want) / np.where(_np64(up) == 0, 1, _np64(up))) * mag_u + np.abs(_np64(up)) * mag_g
        _assert_agrees(mlp.fused_gate_up.gated(x, mlp.activation), want, mag, dtype, f"layer {i} act(gate) * up")


def _assert_logits_agree(got: mx.array, want: mx.array, dtype: str) -> None:
    """Decode logits: bit for bit where MLX's CPU ops compute both; on a GPU within _LOGIT_BOUNDS and with the same
    greedy token at every step and row, but where the separate logits' top two are nearer than the difference."""
    if _bitwise(dtype):
        assert mx.array_equal(got, want).item()
        return
    g, w = _np64(got), _np64(want)
    rel, std_factor = _LOGIT_BOUNDS[dtype]
    diff = np.abs(g - w)
    assert np.isfinite(g).all() and (diff <= rel * np.abs(w) + std_factor * w.std()).all(), diff.max()
    for row, (gr, wr) in enumerate(zip(g, w)):
        a, b = int(wr.argmax()), int(gr.argmax())
        assert a == b or wr[a] - wr[b] <= 2 * diff[row].max(), f"row {row}: argmax {b} vs {a}, not a near-tie"


@pytest.mark.parametrize("bits", [None, 4], ids=["plain", "q4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_equals_separate_bit_for_bit(bits, dtype, batch):
    """Bit for bit where MLX's ops compute both (the CPU); on a GPU (other kernels, other sums) within _GPU_BOUNDS,
    projection by projection, and the decode logits close with the same greedy tokens."""
    model, _ = build_random_model("tiny", bits=bits, dtype=dtype, seed=3)
    unfuse_projections(model)  # separate (where the backend's prepare step fused them: CUDA)
    names = {k: v.shape for k, v in tree_flatten(model.parameters())}
    separate = _decode_logits(model, batch)
    assert fuse_projections(model) == 2 * len(model.layers)  # every layer's q/k/v and gate/up
    # On CUDA a one-row fused launch also folds the norm and RoPE in (no bf16 rounding between them: close, not
    # equal; test_model_decode_with_folded_norms_agrees and ..._rope_folded_agrees bound that). The projections
    # alone are exact on the CPU, within _GPU_BOUNDS on a GPU.
    _without_folds(model)
    assert {k: v.shape for k, v in tree_flatten(model.parameters())} == names
    _assert_projections_agree(model, batch, dtype)
    _assert_logits_agree(_decode_logits(model, batch), separate, dtype)
    assert unfuse_projections(model) == 2 * len(model.layers)
    assert mx.array_equal(_decode_logits(model, batch), separate).item()  # the separate layers again: their values


def _without_folds(model) -> None:
    for layer in model.layers:
        for proj in (layer.self_attn.fused_qkv, layer.mlp.fused_gate_up):
            proj.fold_norm = proj.fold_rope = False


def test_layers_keep_their_values_as_views_of_the_fused_arrays():
    model, _ = build_random_model("tiny", bits=4, dtype="float32", seed=4)
    attn = model.layers[0].self_attn
    before = {
        name: [mx.array(attn[p][name]) for p in ("q_proj", "k_proj", "v_proj")]
        for name in ("weight", "scales", "biases")
    }
    fuse_projections(model)
    fused = attn.fused_qkv
    nq, nk = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    assert attn.v_proj.weight.shape[0] == nk and fused.bounds == [nq, nq + nk] and fused.qkv_split == (nq, nk)
    assert model.layers[0].mlp.fused_gate_up.qkv_split is None
    for name, parts in before.items():
        assert mx.array_equal(fused.params[name], mx.concatenate(parts)).item()
        for layer, part in zip((attn.q_proj, attn.k_proj, attn.v_proj), parts):
            assert mx.array_equal(layer[name], part).item()
    assert fuse_projections(model) == 0  # already fused: nothing twice


def test_what_is_not_fused():
    lin = [nn.Linear(8, 4), nn.Linear(8, 4, bias=False)]
    assert not fused_projections._fusable(lin)  # bias on one only
    assert not fused_projections._fusable([nn.Linear(8, 4), nn.Linear(6, 4)])  # other inputs
    q = [
        nn.QuantizedLinear(64, 32, bias=False, group_size=64, bits=4),
        nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=4),
    ]
    assert not fused_projections._fusable(q)  # other groups
    assert not fused_projections._fusable([nn.Linear(64, 32), q[0]])  # plain with quantized

    class Sharded(nn.Linear):  # a tensor-parallel subclass keeps its own call
        pass

    assert not fused_projections._fusable([Sharded(8, 4), nn.Linear(8, 4)])
    assert fused_projections._fusable([nn.Linear(8, 4), nn.Linear(8, 6), nn.Linear(8, 6)])


def test_the_kernel_gate_is_read_once_at_fusion_not_per_call(monkeypatch):
    from mlxcel_core.backends.cuda.kernels import fast_linear

    model, _ = build_random_model("tiny", bits=4, dtype="float32", seed=8)
    fuse_projections(model)
    monkeypatch.setattr(fast_linear, "enabled", lambda: pytest.fail("the kernel gate was read per call"))
    _decode_logits(model, 1, steps=2)


def test_rows_above_the_limit_use_the_separate_layers(monkeypatch):
    model, _ = build_random_model("tiny", dtype="float32", seed=5)
    fuse_projections(model)
    calls, split = [], FusedProjection.split
    monkeypatch.setattr(
        FusedProjection, "split", lambda self, x, norm=None: calls.append(x.shape) or split(self, x, norm)
    )
    x = mx.zeros((1, FUSED_MAX_ROWS + 1, model.args.hidden_size))
    model.layers[0].self_attn.project(x)
    assert calls == []
    model.layers[0].self_attn.project(x[:, :FUSED_MAX_ROWS])
    assert calls == [(1, FUSED_MAX_ROWS, model.args.hidden_size)]


def test_decode_batches_take_one_batch_product_a_fused_projection(monkeypatch):
    """A decode batch of more rows than FUSED_MAX_ROWS runs q/k/v and gate/up as one batch product each on the fused
    weights (kernels/qmm.py; here a stand-in on MLX's CPU product, the kernels' launches off on any device), the
    separate layers' values bit for bit; a prompt's rows keep the separate layers."""
    monkeypatch.setattr(qmv, "kernel_ready", lambda: False)
    model, _ = build_random_model("tiny", bits=4, dtype="bfloat16", seed=11)
    unfuse_projections(model)
    batch = FUSED_MAX_ROWS + 4
    with mx.stream(mx.cpu):
        separate = _decode_logits(model, batch, steps=2)
    fuse_projections(model)
    for layer in model.layers:  # (as where the CUDA kernels run these projections)
        layer.self_attn.fused_qkv.kernel = layer.mlp.fused_gate_up.kernel = True
    fused_weights = [
        p.params["weight"] for layer in model.layers for p in (layer.self_attn.fused_qkv, layer.mlp.fused_gate_up)
    ]
    calls = []

    def product_stand_in(x, w, scales, biases, group_size):
        if any(w is f for f in fused_weights):  # (not a separate layer's call)
            calls.append((x.shape, w.shape[0]))
        return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=4)

    monkeypatch.setattr(fast_linear, "batch_product", product_stand_in)
    with mx.stream(mx.cpu):
        got = _decode_logits(model, batch, steps=2)
    assert mx.array_equal(got, separate).item()
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    widths = (attn.fused_qkv.params["weight"].shape[0], mlp.fused_gate_up.params["weight"].shape[0])
    step = [((batch, 1, model.args.hidden_size), widths[0]), ((batch, 1, model.args.hidden_size), widths[1])]
    assert calls == step * len(model.layers) * 2  # (two decode steps; none for the prompt)


def test_other_activations_and_biases_take_the_matmul_path():
    gate, up = nn.Linear(16, 24), nn.Linear(16, 24)
    x = mx.random.normal((1, 2, 16), key=mx.random.key(0))
    want = geglu(gate(x), up(x))
    fused = FusedProjection([gate, up])
    # (one product of the joined weights against two: on a CPU, OpenBLAS's kernels for 48 and 24 columns may round
    # the last bit differently, by CPU model)
    assert mx.allclose(fused.gated(x, geglu), want, rtol=1e-6, atol=1e-6).item()
    assert mx.allclose(fused.gated(x, swiglu), swiglu(gate(x), up(x)), rtol=1e-6, atol=1e-6).item()
    assert not mx.allclose(fused.gated(x, geglu), swiglu(gate(x), up(x)), rtol=1e-3, atol=1e-3).item()


def test_fusion_swaps_the_blocks_classes_and_back():
    """Fused blocks become subclasses of their own classes (one per class, shared by every layer) that hold the
    fused projection; unfusing restores the classes and drops the projections. The models' classes stay as built."""
    model, _ = build_random_model("tiny", dtype="float32", seed=6)
    unfuse_projections(model)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert type(attn) is Attention and type(mlp) is GatedMLP and not hasattr(attn, "fused_qkv")
    names = sorted(k for k, _ in tree_flatten(model.parameters()))
    fuse_projections(model)
    assert isinstance(attn, FusedAttentionMixin) and isinstance(attn, Attention)
    assert isinstance(mlp, FusedGatedMLPMixin) and isinstance(mlp, GatedMLP)
    assert type(attn).__name__ == "FusedAttention" and type(mlp).__name__ == "FusedGatedMLP"
    assert all(type(layer.self_attn) is type(attn) and type(layer.mlp) is type(mlp) for layer in model.layers)
    assert isinstance(attn.fused_qkv, FusedProjection) and isinstance(mlp.fused_gate_up, FusedProjection)
    assert sorted(k for k, _ in tree_flatten(model.parameters())) == names  # not a module: no parameters added
    assert unfuse_projections(model) == 2 * len(model.layers)
    assert type(attn) is Attention and type(mlp) is GatedMLP
    assert not hasattr(attn, "fused_qkv") and not hasattr(mlp, "fused_gate_up")
    assert unfuse_projections(model) == 0
    fuse_projections(model)
    assert type(model.layers[0].self_attn).__name__ == "FusedAttention"  # the same class again (made once)
    assert type(model.layers[0].self_attn) is type(attn)


def test_blocks_that_cannot_fuse_keep_their_classes():
    """Phi-3's checkpoint layout (one qkv_proj, one gate_up_proj) has nothing to fuse: every class stays. Qwen3's q/k
    norms keep the RoPE out of the launch, but its projections fuse."""
    from mlxcel_core.models import model_class_for

    def build(**config):
        config = dict(
            hidden_size=64,
            num_hidden_layers=1,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=32,
            **config,
        )
        model_class, args_class = model_class_for(config)
        return model_class(args_class.from_dict(config))

    phi = build(model_type="phi3")
    classes = [type(m) for _, m in phi.named_modules()]
    assert fuse_projections(phi) == 0 and [type(m) for _, m in phi.named_modules()] == classes
    qwen = build(model_type="qwen3", head_dim=16)
    assert fuse_projections(qwen) == 2 and isinstance(qwen.layers[0].self_attn, FusedAttentionMixin)


def test_generate_cli_gives_the_same_tokens_fused(tiny_llama_dir, monkeypatch):
    """The loaded model fused (fuse_projections right after it is built, as the CUDA backend's prepare step does
    there) and separate: the same greedy tokens."""
    from typer.testing import CliRunner

    from mlxcel_cli.main import app
    from mlxcel_core.loading import load

    build, fused_counts = load.build_model, []

    def build_fused(*args, **kwargs):
        model = build(*args, **kwargs)
        fused_counts.append(fuse_projections(model))
        return model

    outputs = {}
    for fused in (False, True):
        if fused:
            monkeypatch.setattr(load, "build_model", build_fused)
        result = CliRunner().invoke(
            app, ["generate", "-m", str(tiny_llama_dir), "-p", "hello there", "-n", "24", "--temp", "0"]
        )
        assert result.exit_code == 0, result.output
        outputs[fused] = result.stdout
    assert fused_counts and fused_counts[0] > 0  # the loaded model's projections were fused
    assert outputs[False] == outputs[True]


def assert_swiglu_close(y: mx.array, ref: np.ndarray, inter: int) -> None:
    """y (bf16) against silu(gate) * up of the float64 [gate | up] products `ref`, gate and up first rounded to bf16
    as the kernel does. Off by the rounding of gate and up (one bf16 ulp each where the kernel's float32 sums
    straddle a rounding boundary) and the final rounding: at most ~3 bf16 ulps of the result."""
    g = np.array(mx.array(ref[:, :inter].astype(np.float32)).astype(mx.bfloat16).astype(mx.float32), np.float64)
    u = np.array(mx.array(ref[:, inter:].astype(np.float32)).astype(mx.bfloat16).astype(mx.float32), np.float64)
    want = g / (1 + np.exp(-g)) * u
    got = np.array(y.astype(mx.float32), np.float64)
    assert np.all(np.abs(got - want) <= 2.0**-6 * np.abs(want) + 1e-3 * np.abs(want).mean())


# -- CUDA: the kernel's fused modes ------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("nq,nk,k", [(4096, 1024, 4096), (2048, 512, 2048), (300, 36, 512)])
def test_qkv_mode_matches_reference(m, nq, nk, k):
    x, w, scales, biases = make_operands(m, nq + 2 * nk, k, mx.bfloat16, seed=nq + k)
    ref, mag = reference(x, w, scales, biases)
    args = qmv.launch_args(x.shape, x.dtype, scales.dtype, nq + 2 * nk, 64, mode="qkv", split=(nq, nk))
    q, kk, v = qmv.launch(args, x, w, scales, biases, "qkv")
    assert q.shape == (m, nq) and kk.shape == v.shape == (m, nk)
    check_close(q, ref[:, :nq], mag[:, :nq], mx.bfloat16, "q")
    check_close(kk, ref[:, nq : nq + nk], mag[:, nq : nq + nk], mx.bfloat16, "k")
    check_close(v, ref[:, nq + nk :], mag[:, nq + nk :], mx.bfloat16, "v")


@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("inter,k", [(14336, 4096), (8192, 2048), (301, 512)])
def test_swiglu_mode_matches_reference(m, inter, k):
    x, w, scales, biases = make_operands(m, 2 * inter, k, mx.bfloat16, seed=inter)
    ref, mag = reference(x, w, scales, biases)
    args = qmv.launch_args(x.shape, x.dtype, scales.dtype, 2 * inter, 64, mode="swiglu")
    y = qmv.launch(args, x, w, scales, biases, "swiglu")
    assert y.shape == (m, inter) and y.dtype == mx.bfloat16
    assert_swiglu_close(y, ref, inter)


@needs_cuda
def test_fused_model_decode_agrees_with_separate_on_cuda():
    """4-bit random model: the fused kernel path against the separate layers (MLX's kernels): logits close,
    float32 activations to keep the comparison tight."""
    model, _ = build_random_model("tiny", bits=4, dtype="float32", seed=7)
    unfuse_projections(model)
    separate = _decode_logits(model, 2)
    fuse_projections(model)
    fused = _decode_logits(model, 2)
    assert mx.allclose(fused, separate, rtol=1e-3, atol=1e-3).item(), mx.abs(fused - separate).max()


@needs_cuda
def test_fused_batches_agree_with_separate_launches_on_cuda(monkeypatch):
    """On the GPU a bf16 4-bit batch of FUSED_MAX_ROWS + 4 rows decodes through kernels/qmm.py on the fused weights,
    close to the separate layers' launches (another split of K)."""
    model, _ = build_random_model("tiny", bits=4, dtype="bfloat16", seed=7)
    batch = FUSED_MAX_ROWS + 4
    separate = _decode_logits(model, batch)
    fuse_projections(model)
    widths, real = [], fast_linear.batch_product
    monkeypatch.setattr(
        fast_linear, "batch_product", lambda x, w, *rest: widths.append(w.shape[0]) or real(x, w, *rest)
    )
    fused = _decode_logits(model, batch)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    fused_widths = {attn.fused_qkv.params["weight"].shape[0], mlp.fused_gate_up.params["weight"].shape[0]}
    assert fused_widths <= set(widths)  # the fused q/k/v and gate/up weights' products ran
    _assert_logits_agree(fused, separate, "bfloat16")
