"""Whether MLX's CUDA gather_qmm with the sorted-rows hint shows the same race as gather_mm (4-bit
experts of the tiny gpt-oss, with and without the hint), and what the hint is worth in time at a real MoE prefill's
shape (bf16 gather_mm, 4-bit gather_qmm; 512 tokens, top 8 of 64 experts, 2048 -> 768).

    MLXCEL_CUDA=0 python benchmarks/archive/2026-12-02-gather-mm-race/probe_q.py 150

Run from the repo root. Its output on the H200: probe_q_output.txt (the README says what it shows).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = ["tests", "."]  # run from the repo root

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from parity import load_quiet, prompt_ids, save_tiny_checkpoint  # noqa: E402
from tiny_configs import GPT_OSS, randomize_gpt_oss  # noqa: E402
from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402

from mlxcel_core.models import moe  # noqa: E402

N = int(sys.argv[1])
tmp = Path(tempfile.mkdtemp())
path = randomize_gpt_oss(save_tiny_checkpoint(tmp, GptOssConfig, GptOssForCausalLM, **GPT_OSS))
model = load_quiet(path).model
nn.quantize(model, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, moe.SwitchLinear))
print("experts:", type(model.model.layers[0].mlp.experts.gate_proj).__name__)
ids = mx.array([prompt_ids(80, vocab=320, seed=80)])
orig = moe.QuantizedSwitchLinear.__call__


def unsorted_flag(self, x, indices, sorted_indices=False):
    return orig(self, x, indices, False)


rng = np.random.default_rng(0)
for name in ("baseline", "unsorted flag"):
    moe.QuantizedSwitchLinear.__call__ = orig if name == "baseline" else unsorted_flag
    ref, bad = None, 0
    for r in range(N):
        mx.eval(model(mx.array([prompt_ids(int(rng.integers(1, 100)), vocab=320, seed=r)])))
        out = np.array(model(ids))
        if ref is None:
            ref = out
        elif not np.array_equal(out, ref):
            bad += 1
    print(f"4-bit experts, {name}: {bad}/{N - 1} forwards differ from the first", flush=True)

T, k, E, D, I = 512, 8, 64, 2048, 768
w = (mx.random.normal((E, D, I)) * 0.02).astype(mx.bfloat16)
x = mx.random.normal((T * k, 1, 1, D)).astype(mx.bfloat16)
idx = mx.sort(mx.random.randint(0, E, (T * k,))).astype(mx.uint32)
qw, qs, qb = mx.quantize(w.swapaxes(-1, -2), group_size=64, bits=4)
for label, fn in (
    ("bf16 gather_mm", lambda s: mx.gather_mm(x, w, rhs_indices=idx, sorted_indices=s)),
    (
        "4-bit gather_qmm",
        lambda s: mx.gather_qmm(
            x, qw, qs, qb, rhs_indices=idx, transpose=True, group_size=64, bits=4, sorted_indices=s
        ),
    ),
):
    for s in (True, False, True, False):
        mx.eval(fn(s))
        t0 = time.perf_counter()
        for _ in range(20):
            mx.eval(fn(s))
        print(
            f"{label} T={T} k={k} E={E} D={D} I={I} sorted={s}: {(time.perf_counter() - t0) / 20 * 1e3:.3f} ms",
            flush=True,
        )
