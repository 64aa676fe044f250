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
