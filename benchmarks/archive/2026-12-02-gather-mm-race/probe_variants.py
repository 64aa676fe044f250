"""Does a tiny gpt-oss prefill of 80 tokens give the same logits every time on the GPU, and which change makes it?

    MLXCEL_CUDA=0 python benchmarks/archive/2026-12-02-gather-mm-race/probe_variants.py 150 baseline "no sort"

argv: the forwards per variant, then the variants (default: all). MLXCEL_CUDA=0 keeps the CUDA backend's load-time
route around the race (kernels/mlx_workarounds.py) out, so "baseline" is MLX's sorted gather_mm. Run from the repo root.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path[:0] = ["tests", "."]  # run from the repo root

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from parity import load_quiet, prompt_ids, save_tiny_checkpoint  # noqa: E402
from tiny_configs import GPT_OSS, randomize_gpt_oss  # noqa: E402
from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402

from mlxcel_core.models import moe  # noqa: E402

tmp = Path(tempfile.mkdtemp())
path = randomize_gpt_oss(save_tiny_checkpoint(tmp, GptOssConfig, GptOssForCausalLM, **GPT_OSS))
model = load_quiet(path).model
ids = mx.array([prompt_ids(80, vocab=320, seed=80)])
orig_call = moe.SwitchGLU.__call__
act = model.model.layers[0].mlp.experts.activation


def act_plain(gate, up):
    gate = mx.minimum(gate, 0.5)
    up = mx.clip(up, -0.5, 0.5)
    return (up + 1) * (gate * mx.sigmoid(gate * 1.702))


def set_act(a):
    for layer in model.model.layers:
        layer.mlp.experts.activation = a


def contiguous_call(self, x, indices):
    return orig_call(self, mx.contiguous(x), mx.contiguous(indices))


def eval_each(self, x, indices):
    out = orig_call(self, x, indices)
    mx.eval(out)
    return out


orig_linear = moe.SwitchLinear.__call__


def unsorted_flag(self, x, indices, sorted_indices=False):
    return orig_linear(self, x, indices, False)


orig_argsort = mx.argsort


def cpu_argsort(a, *args, **kw):
    return orig_argsort(a, *args, stream=mx.cpu, **kw)


variants = {
    "sorted rows, gather_mm told unsorted": lambda: setattr(moe.SwitchLinear, "__call__", unsorted_flag),
    "argsort on the cpu": lambda: setattr(moe.mx, "argsort", cpu_argsort),
    "baseline": lambda: None,
    "contiguous inputs": lambda: setattr(moe.SwitchGLU, "__call__", contiguous_call),
    "no sort": lambda: setattr(moe, "SORT_THRESHOLD", 10**9),
    "plain activation": lambda: set_act(act_plain),
    "eval after glu": lambda: setattr(moe.SwitchGLU, "__call__", eval_each),
}
rng = np.random.default_rng(0)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 25
for name, apply in ((n, variants[n]) for n in (sys.argv[2:] or variants)):
    moe.SwitchGLU.__call__ = orig_call
    moe.SORT_THRESHOLD = 64
    set_act(act)
    moe.SwitchLinear.__call__ = orig_linear
    mx.argsort = orig_argsort
    apply()
    ref, bad = None, 0
    for r in range(N):
        mx.eval(model(mx.array([prompt_ids(int(rng.integers(1, 100)), vocab=320, seed=r)])))
        out = np.array(model(ids))
        if ref is None:
            ref = out
        elif not np.array_equal(out, ref):
            bad += 1
    print(f"{name}: {bad}/{N - 1} forwards differ from the first", flush=True)
