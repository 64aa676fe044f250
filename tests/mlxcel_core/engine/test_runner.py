"""ModelRunner.prefill: a prompt's last chunk runs its last layer past the attention on the last position only
(`last_only`), so the logits and the caches must be those of the full forward."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_core.engine.runner import ModelRunner
from mlxcel_core.engine.storage import make_storage
from mlxcel_core.engine.types import EngineConfig
from mlxcel_core.loading.shapes import build_random_model

PROMPT = [5, 17, 3, 99, 42, 7, 7, 150, 2, 64, 31]


def _prefill_then_decode(model, storage_kind: str, chunks: list[int]):
    """Logits after the prompt (prefilled in `chunks`), then after one decode step; the prompt tokens counted."""
    storage = make_storage(model, EngineConfig(storage=storage_kind, max_batch_size=1))
    runner = ModelRunner(model, storage)
    storage.add(0, PROMPT)
    start, logits = 0, None
    for i, size in enumerate(chunks):
        logits = runner.prefill(0, PROMPT[start : start + size], start, last=i == len(chunks) - 1)
        start += size
    after_prompt = np.array(logits.astype(mx.float32))
    step = runner.decode((0,), mx.argmax(logits, axis=-1))
    return after_prompt, np.array(step.astype(mx.float32)), runner.prefill_tokens


def _full_forward(model):
    """The whole prompt's logits in one forward without a cache, then a decode step over the prompt plus its token."""
    full = model(mx.array([PROMPT]))[0].astype(mx.float32)
    token = int(mx.argmax(full[-1]).item())
    step = model(mx.array([PROMPT + [token]]))[0, -1].astype(mx.float32)
    return np.array(full[-1:]), np.array(step[None])


@pytest.mark.parametrize("storage_kind", ["dense", "paged"])
@pytest.mark.parametrize("chunks", [[11], [4, 7], [10, 1]], ids=["one chunk", "two chunks", "last chunk of one"])
def test_last_only_prefill_gives_the_full_forwards_logits(storage_kind, chunks):
    model, _ = build_random_model("tiny", dtype="float32", seed=11)
    want, want_step = _full_forward(model)
    got, got_step, count = _prefill_then_decode(model, storage_kind, chunks)
    assert count == len(PROMPT)
    assert got.argmax() == want.argmax() and got_step.argmax() == want_step.argmax()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_step, want_step, rtol=1e-4, atol=1e-4)  # the caches hold every position's keys


def test_last_only_is_the_full_forwards_last_position():
    model, _ = build_random_model("tiny", dtype="float32", seed=12)
    prompt = mx.array([PROMPT, PROMPT[::-1]])
    full = model(prompt)
    last = model(prompt, last_only=True)
    assert last.shape == (2, 1, full.shape[-1])
    np.testing.assert_allclose(np.array(last[:, 0]), np.array(full[:, -1]), rtol=1e-4, atol=1e-4)
