"""Rank 0 schedules, the other ranks follow: the engine's inputs are broadcast once per step.

Under tensor parallelism every rank holds a slice of each layer, so every rank must run exactly the same
forward passes in the same order. Rank 0 (the leader) owns the user-facing side (the chat prompt, the HTTP
server) and its Engine; a `LeaderMirror` attached to that Engine records what changes the engine's work
(sequences opened, with their prompt, sampling parameters and context cap; sequences closed) and, at the
start of every `step()`, broadcasts the records of that step to the other ranks. Each follower applies them
to its own Engine (`follow`) and runs the same `step()`. The scheduler is deterministic (plain data, no
clocks), the logits are identical on every rank (the all-sums give every rank the same bits) and sampling
seeds are fixed by the leader, so every rank's scheduler makes the same decisions: followers never
need the scheduled batch itself, only the inputs it was made from.

A step with nothing new costs one all-sum of a single int32; the leader sends ("stop",) when it is done.
Records travel as JSON with a fixed schema (distributed/wire.py), checked on arrival: whoever reaches a
follower's socket can at most stop it, never run code in it. Requests with custom Python logits processors
cannot be mirrored and are refused.
"""

from __future__ import annotations

import itertools
import os
import weakref
from dataclasses import replace

import mlx.core as mx

from ..errors import InputError, RuntimeFailure
from . import wire


def broadcast_bytes(group, payload: bytes | None) -> bytes:
    """Rank 0's `payload` on every rank (others pass None): an all-sum where only rank 0 contributes."""
    leader = group.rank() == 0
    size = mx.array([len(payload) if leader else 0], dtype=mx.int32)
    n = int(mx.distributed.all_sum(size, group=group).item())
    if n == 0:
        return b""
    words = (n + 3) // 4
    if leader:
        data = mx.array(memoryview(payload.ljust(words * 4, b"\0")).cast("i"), dtype=mx.int32)
    else:
        data = mx.zeros((words,), dtype=mx.int32)
    return bytes(memoryview(mx.distributed.all_sum(data, group=group)))[:n]


class LeaderMirror:
    """Attached to rank 0's Engine (`engine.mirror`): records its inputs and broadcasts them each step."""

    def __init__(self, group):
        self.group = group
        self._pending: list[tuple] = []
        self._keys: dict[int, int] = {}  # id(Conversation) -> key the followers know it by
        self._next_key = itertools.count()
        self.stopped = False

    def prepare(self, params):
        """The parameters every rank will use: refuse what cannot travel, fix the seed of sampled requests."""
        if params.logits_processors:
            raise InputError("custom logits processors cannot be used with tensor parallelism")
        if params.seed is None and params.temperature > 0:
            params = replace(params, seed=int.from_bytes(os.urandom(4), "little") >> 1)
        return params

    def opened(self, seq_id: int, prompt_ids: list[int], params, conversation, max_context: int) -> None:
        self._pending.append(("open", seq_id, list(prompt_ids), params, self._key(conversation), max_context))

    def closed(self, seq_id: int) -> None:
        self._pending.append(("close", seq_id))

    def before_step(self) -> None:
        records, self._pending = self._pending, []
        broadcast_bytes(self.group, wire.encode(records) if records else b"")

    def stop(self) -> None:
        """Tell the followers to return (once; safe to call again)."""
        if not self.stopped:
            self.stopped = True
            broadcast_bytes(self.group, wire.encode(self._pending + [("stop",)]))
            self._pending = []

    def _key(self, conversation) -> int | None:
        if conversation is None:
            return None
        key = self._keys.get(id(conversation))
        if key is None:
            key = self._keys[id(conversation)] = next(self._next_key)
            # When the leader drops a conversation, the followers drop theirs (with its KV caches).
            weakref.finalize(conversation, self._forget, id(conversation), key)
        return key

    def _forget(self, object_id: int, key: int) -> None:
        self._keys.pop(object_id, None)
        self._pending.append(("forget", key))


def follow(engine, group) -> None:
    """A follower's whole life: apply rank 0's records to `engine` and step it, until rank 0 says stop."""
    from ..engine import Conversation

    conversations: dict[int, Conversation] = {}
    while True:
        payload = broadcast_bytes(group, None)
        try:
            records = wire.decode(payload) if payload else []
        except wire.WireError as exc:
            raise wire.WireError(f"rank {group.rank()} refused a step from rank 0: {exc}") from None
        for record in records:
            kind = record[0]
            if kind == "stop":
                return
            if kind == "open":
                _, seq_id, prompt_ids, params, key, max_context = record
                engine.max_context = max_context
                conversation = None if key is None else conversations.setdefault(key, Conversation())
                mine = engine.open(prompt_ids, params, conversation)
                if mine != seq_id:
                    raise RuntimeFailure(
                        f"rank {group.rank()} is out of step with rank 0 (sequence {mine}, rank 0 has {seq_id})"
                    )
            elif kind == "close":
                engine.close(record[1])
            elif kind == "forget":
                conversations.pop(record[1], None)
        for out in engine.step():
            if out.finished:
                engine.release(out.seq_id)
