"""ModelRunner.prefill: a prompt's last chunk as one forward, or (split_last_token, the CPU default) as its body with
caches only and then its last token. Both must give the same next-token logits and leave the same caches."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_core.engine.engine import make_storage
from mlxcel_core.engine.runner import ModelRunner
from mlxcel_core.engine.types import EngineConfig
from mlxcel_core.models.shapes import build_random_model

PROMPT = [5, 17, 3, 99, 42, 7, 7, 150, 2, 64, 31]


def _prefill_then_decode(model, storage_kind: str, split: bool, chunks: list[int]):
    """Logits after the prompt (prefilled in `chunks`), then after one decode step; the prompt tokens counted."""
    storage = make_storage(model, EngineConfig(storage=storage_kind, max_batch_size=1))
    runner = ModelRunner(model, storage)
    runner.split_last_token = split
    storage.add(0, PROMPT)
    start, logits = 0, None
    for i, size in enumerate(chunks):
        logits = runner.prefill(0, PROMPT[start:start + size], start, last=i == len(chunks) - 1)
        start += size
    after_prompt = np.array(logits.astype(mx.float32))
    step = runner.decode((0,), mx.argmax(logits, axis=-1))
    return after_prompt, np.array(step.astype(mx.float32)), runner.prefill_tokens


@pytest.mark.parametrize("storage_kind", ["dense", "paged"])
@pytest.mark.parametrize("chunks", [[11], [4, 7], [10, 1]], ids=["one chunk", "two chunks", "last chunk of one"])
def test_split_last_token_gives_the_same_logits(storage_kind, chunks):
    model, _ = build_random_model("tiny", dtype="float32", seed=11)
    one, one_step, one_count = _prefill_then_decode(model, storage_kind, False, chunks)
    split, split_step, split_count = _prefill_then_decode(model, storage_kind, True, chunks)
    assert one_count == split_count == len(PROMPT)
    assert one.argmax() == split.argmax() and one_step.argmax() == split_step.argmax()
    np.testing.assert_allclose(split, one, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(split_step, one_step, rtol=1e-4, atol=1e-4)  # the caches hold the same keys


def test_the_last_token_has_its_own_forward_only_on_the_cpu():
    model, _ = build_random_model("tiny", dtype="float32", seed=11)
    runner = ModelRunner(model, make_storage(model, EngineConfig(storage="dense")))
    assert runner.split_last_token == (mx.default_device() == mx.cpu)
