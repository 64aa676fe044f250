"""Driving an Engine with requests that arrive at given steps (the engine tests' shared loop)."""

from __future__ import annotations


def drive(engine, prompts, arrivals, params) -> dict[int, list[int]]:
    """Open request i at step arrivals[i]; return each request's tokens (keyed by request index)."""
    ids, out, step = {}, {}, 0
    while len(ids) < len(prompts) or engine.has_work():
        for i, (prompt, at) in enumerate(zip(prompts, arrivals)):
            if at == step and i not in ids:
                ids[i] = engine.open(prompt, params[i])
        for o in engine.step():
            assert o.error is None, o.error
            if o.token is not None:
                out.setdefault(o.seq_id, []).append(o.token)
        step += 1
    return {i: out.get(s, []) for i, s in ids.items()}


def run_rows(engine, prompt: list[int], params) -> list[tuple[list[int], str | None, str | None]]:
    """Open one row per SamplingParams at once on `prompt`, run them out; per row (tokens, finish_reason, error). A
    finished row's grammar matcher (if any) goes with it."""
    ids = [engine.open(prompt, p) for p in params]
    tokens, ends = {i: [] for i in ids}, {}
    while engine.has_work():
        for out in engine.step():
            if out.token is not None:
                tokens[out.seq_id].append(out.token)
            if out.finished:
                ends[out.seq_id] = (out.finish_reason, out.error)
                assert engine.sequence(out.seq_id).constraint is None  # the matcher went with the row
    return [(tokens[i], *ends[i]) for i in ids]
