"""Soak: many greedy requests through one Engine -- shared prefixes (prefix-cache hits), random cancellations, rows
arriving and ending at every step so the batch keeps changing size, blocks evicted and reused under a small KV
budget, on pools whose fresh slots are NaN -- and every request's tokens are its prompt's alone.

Each distinct prompt runs once alone first (batch 1, no prefix cache, top-2 logprobs: the reference tokens and how
far the best token led the second). In the soak a finished request's tokens must equal the reference's; a cancelled
one's must be its beginning. Where batched maths rounds differently (a GPU's batched matmuls), a request may leave the
reference only at a near tie (the reference's lead under TIE there); after that its tokens are not compared. No row
may end with an error (NaN logits), and once the soak ends no KV block is held.

CPU: a tiny float32 Llama, exact (TIE 0), ~100 requests, compiled decode steps (as on a GPU) over pools that grow.
GPU (MLX's default device a GPU): a Llama-3.2-1B-shaped random 4-bit model, thousands of requests, with the backend's
defaults (compiled steps, decode kernels writing KV in place, the replayed CUDA graph of lone rows, prompts
prefilled together).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from nan_pools import use_nan_pools

from mlxcel_core.backends.base import on_gpu
from mlxcel_core.bench_model import RandomIdTokenizer
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.engine.paged import MIN_POOL_BLOCKS
from mlxcel_core.loading.shapes import build_random_model
from mlxcel_core.sampling import SamplingParams


@dataclass(frozen=True)
class Soak:
    shape: str
    bits: int | None
    dtype: str
    requests: int
    distinct: int  # distinct prompts (each has a reference)
    prefixes: int  # shared prefixes among them
    max_batch: int
    block_size: int
    max_tokens: tuple[int, int]  # a prompt's max_tokens range
    cancel_frac: float
    tie: float  # the reference's lead (logprob) under which a batched row may pick the other token
    compile_decode: bool | None  # None: the backend's default (compiled on a GPU)
    max_tie_frac: float  # of the requests, how many may leave the reference at a near tie (the rest compare whole)


# (CPU: blocks of 4, so the pools grow past their first 64 blocks during the run; compiled steps as on a GPU)
CPU = Soak("tiny", None, "float32", 100, 12, 3, 6, 4, (4, 40), 0.15, 0.0, True, 0.0)
# (random weights give flat logits, and a batch's bf16 kernels round otherwise than a lone row's: on the H200 most
# requests leave the lone run somewhere at a lead of one bf16 step (0.0625 at these logits), so any divergence at a
# lead under 4 steps counts as a tie; a wrong pool or graph read shows as a divergence at a clear lead, an error or
# a leaked block)
GPU = Soak("llama-3.2-1b", 4, "bfloat16", 2000, 64, 8, 32, 32, (8, 64), 0.1, 0.25, None, 1.0)


@dataclass
class Reference:
    tokens: list[int]
    leads: list[float]  # per token: its logprob minus the second best's


def prompts_of(soak: Soak, vocab: int, rng: random.Random) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per distinct prompt: most start with one of the shared prefixes (one to three blocks,
    often ending mid-block), the rest are unrelated."""
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.randint(soak.block_size, 3 * soak.block_size))]]
    prefixes += [[rng.randrange(3, vocab) for _ in range(len(prefixes[0]) + 7 * i)] for i in range(1, soak.prefixes)]
    out = []
    for i in range(soak.distinct):
        head = prefixes[i % len(prefixes)] if i % 4 else []
        tail = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 2 * soak.block_size))]
        out.append((head + tail, rng.randint(*soak.max_tokens)))
    return out


def references(model, tokenizer, prompts) -> list[Reference]:
    engine = Engine(model, tokenizer, EngineConfig(max_batch_size=1, prefix_cache=False))
    refs = []
    for prompt, max_tokens in prompts:
        seq = engine.open(prompt, SamplingParams(max_tokens=max_tokens, logprobs=2))
        ref = Reference([], [])
        while engine.has_work():
            for out in engine.step():
                assert out.error is None, f"reference run: {out.error}"
                if out.seq_id == seq and out.token is not None:
                    top = out.top_logprobs or []
                    ref.tokens.append(out.token)
                    ref.leads.append(top[0][1] - top[1][1] if len(top) > 1 else float("inf"))
        engine.release(seq)
        refs.append(ref)
    return refs


def check(tokens: list[int], ref: Reference, finished: bool, tie: float) -> str | None:
    """None when `tokens` agree with the reference (whole when `finished`, else its beginning); else why not.
    'tie' when they leave it at a near tie."""
    for i, token in enumerate(tokens):
        if i >= len(ref.tokens):
            return f"{len(tokens)} tokens, the reference has {len(ref.tokens)}"
        if token != ref.tokens[i]:
            return (
                "tie"
                if ref.leads[i] <= tie
                else f"token {i}: {token}, reference {ref.tokens[i]} (lead {ref.leads[i]:.3g})"
            )
    if finished and len(tokens) != len(ref.tokens):
        return f"finished with {len(tokens)} tokens, the reference has {len(ref.tokens)}"
    return None


def soak_run(engine: Engine, prompts, refs: list[Reference], soak: Soak, rng: random.Random) -> dict:
    """Open soak.requests requests (up to a target in flight that moves between 1 and 2 x max_batch), cancel some
    mid-way, and check each as it ends."""
    live: dict[int, tuple[int, list[int], int | None]] = {}  # seq -> (prompt index, tokens, cancel after n tokens)
    opened, tally = 0, {"finished": 0, "cancelled": 0, "ties": 0}
    failures: list[str] = []
    target = soak.max_batch
    while opened < soak.requests or engine.has_work():
        if rng.random() < 0.05:
            target = rng.randint(1, 2 * soak.max_batch)
        while opened < soak.requests and len(live) < target:
            index = rng.randrange(len(prompts))
            prompt, max_tokens = prompts[index]
            cut = rng.randint(0, max_tokens - 1) if rng.random() < soak.cancel_frac else None
            live[engine.open(prompt, SamplingParams(max_tokens=max_tokens))] = (index, [], cut)
            opened += 1
        for out in engine.step():
            index, tokens, cut = live[out.seq_id]
            if out.error is not None:
                failures.append(f"prompt {index}: {out.error} after {len(tokens)} tokens")
            if out.token is not None:
                tokens.append(out.token)
            if cut is not None and len(tokens) >= cut and not out.finished:
                engine.close(out.seq_id)
                live[out.seq_id] = (index, tokens, None)  # ends at the next step, "cancelled"
            if out.finished and out.error is not None:
                del live[out.seq_id]
                engine.release(out.seq_id)
            elif out.finished:
                del live[out.seq_id]
                engine.release(out.seq_id)
                finished = out.finish_reason != "cancelled"
                tally["finished" if finished else "cancelled"] += 1
                why = check(tokens, refs[index], finished, soak.tie)
                if why == "tie":
                    tally["ties"] += 1
                elif why is not None:
                    failures.append(f"prompt {index} ({out.finish_reason}): {why}")
    assert not failures, f"{len(failures)} wrong requests of {opened}, e.g. {failures[:3]} ({tally})"
    return tally


def run_soak(soak: Soak, monkeypatch) -> dict:
    model, config = build_random_model(soak.shape, bits=soak.bits, dtype=soak.dtype, seed=7)
    tokenizer = RandomIdTokenizer(config["vocab_size"])
    rng = random.Random(43)
    prompts = prompts_of(soak, config["vocab_size"], rng)
    refs = references(model, tokenizer, prompts)
    use_nan_pools(monkeypatch)
    longest = max(len(p) + n for p, n in prompts)
    engine = Engine(
        model,
        tokenizer,
        EngineConfig(
            max_batch_size=soak.max_batch,
            storage="paged",
            block_size=soak.block_size,
            kv_budget_tokens=soak.max_batch * longest,  # full: the prefix cache's blocks are evicted and reused
            compile_decode=soak.compile_decode,
        ),
    )
    tally = soak_run(engine, prompts, refs, soak, rng)
    assert engine.storage.pool.high_water > MIN_POOL_BLOCKS  # the pools grew while rows decoded
    stats = engine.storage.stats()
    assert stats["blocks_free"] == stats["blocks_total"], stats  # nothing held: cached prefixes are reclaimable
    assert stats["prefix_hits"] > soak.requests // 4, stats
    assert tally["cancelled"] > 0 and tally["finished"] > soak.requests // 2, tally
    assert tally["ties"] <= soak.max_tie_frac * soak.requests, tally  # the rest are compared to their end
    return tally


@pytest.mark.skipif(on_gpu(), reason="the GPU runs the large soak")
def test_soak_cpu(monkeypatch):
    run_soak(CPU, monkeypatch)


@pytest.mark.skipif(not on_gpu(), reason="a GPU soak (MLX's default device is not a GPU)")
def test_soak_gpu(monkeypatch):
    run_soak(GPU, monkeypatch)
