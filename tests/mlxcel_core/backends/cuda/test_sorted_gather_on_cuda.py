"""On CUDA an MoE prefill computes the same logits every time: MLX's gather_mm with the sorted-rows hint now and then
does not, so the CUDA backend's load drops the hint for float expert banks (kernels/mlx_workarounds.py). Without that
route a tiny gpt-oss prefill of 80 tokens came out different in 2-6 of 120-150 repeats on the H200."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from parity import load_quiet, prompt_ids, save_tiny_checkpoint
from tiny_configs import GPT_OSS, randomize_gpt_oss
from transformers import GptOssConfig, GptOssForCausalLM

from mlxcel_core.backends.cuda.kernels.mlx_workarounds import UnsortedHintSwitchLinear

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs CUDA")


def test_a_moe_prefill_gives_the_same_logits_every_time(tmp_path):
    path = randomize_gpt_oss(save_tiny_checkpoint(tmp_path, GptOssConfig, GptOssForCausalLM, **GPT_OSS))
    model = load_quiet(path).model
    assert type(model.model.layers[0].mlp.experts.gate_proj) is UnsortedHintSwitchLinear
    ids = mx.array([prompt_ids(80, vocab=320, seed=80)])  # 160 routed pairs: the sorted path
    first = np.array(model(ids))
    lengths = np.random.default_rng(0).integers(1, 100, 150)
    for i, n in enumerate(lengths):  # other prompts between, as a server's requests come
        mx.eval(model(mx.array([prompt_ids(int(n), vocab=320, seed=i)])))
        assert np.array_equal(np.array(model(ids)), first), f"repeat {i} differs"
