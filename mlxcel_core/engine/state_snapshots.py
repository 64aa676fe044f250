"""The prefix cache of a model with recurrent layers: copies of the recurrent state at cached prefixes' ends.

A recurrent layer's state (state_pool.py) holds every token it has seen and cannot be cut back, so a cached prefix is
reusable only together with the state at its end. `StateSnapshots` keeps such states ("snapshots": a copy of every
recurrent layer's state of one sequence) at block boundaries, each under the prefix hash of the cached KV block that
ends there (kv/block_pool.py): a request whose prompt matches the cached blocks up to a boundary that has a snapshot
starts from there, its state slot loaded with the snapshot, and computes only the tokens after it.

Which boundaries, per sequence (a snapshot per block would cost a state's size every block_size tokens):
- its prompt's last boundary (the largest multiple of the block size below the prompt's length): the next turn of a
  chat, and any request repeating the prompt, starts there at least;
- the end of its longest run of cached blocks, where that run goes beyond the newest snapshot it can use: the point
  where it leaves a prompt computed before, such as a shared system prompt. The request that first diverges there
  computes it and keeps the state; the requests after it reuse it;
- while it decodes, the newest boundary its tokens reach (one, replaced as it goes), kept when it ends: the next turn
  of a chat reuses the previous reply too.
The state at a boundary exists only when a forward ends there: the scheduler ends a prompt's chunk at these
boundaries (the storage's `prefill_stops`), and a decode step ends at each. A snapshot is taken when the next forward
is prepared (`capture`), that is, after the forward that ended at the boundary was built and before anything writes
the state again, and only where that forward replaced every recurrent layer's state (a forward that raised part way
leaves some layer's arrays as they were, and its state is not kept). Prompt snapshots are kept (attached to their
cached block) when the prompt is done, decode ones when the sequence ends, where its tokens up to the boundary are
known (a token computed but never read, after a cancel, keeps its boundary out).

Bounds: at most `most` snapshots at once (make_storage: storage.SNAPSHOTS_PER_ROW per batch row), those of running
sequences included, and they count in the KV budget, as state slots do: each is a state's size in budget tokens
(budget.state_tokens_per_sequence), and at every forward the running sequences' KV blocks and state slots and the
snapshots together stay within the budget. Snapshots hold only what the sequences do not use, so they never delay a
request: as sequences take blocks (`fit`, after each allocation), the least recently used kept snapshots are evicted,
then running sequences' ones not kept yet (cached KV blocks give way to running sequences the same way), and a new
snapshot that finds no room once every kept one is gone is not taken. A kept snapshot also goes when its block leaves
the prefix cache (evicted or forgotten: BlockPool.on_forget).

vLLM's mamba prefix caching ("align" mode) and SGLang's Mamba radix cache keep states at block-aligned chunk ends and
at branching points in the same spirit.
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx

from ..kv.block_pool import BlockHash, BlockPool, BlockTable
from .state_pool import StatePool

State = list[list[mx.array] | None]  # per layer, the state parts [1, ...] (None: a layer without a state)


class StateSnapshots:
    def __init__(self, states: StatePool, pool: BlockPool, most: int, tokens: int = 1, budget: int | None = None):
        """`most`: snapshots held at once at most (>= 1); `tokens`: KV-budget tokens a snapshot (and a state slot)
        counts for; `budget`: the KV budget in tokens (None: only `most` bounds them)."""
        self.states, self.pool, self.most, self.tokens, self.budget = states, pool, most, max(tokens, 1), budget
        self._kept: OrderedDict[BlockHash, State] = OrderedDict()  # by the hash of the block they end; LRU first
        self._taken: dict[int, dict[int, State]] = {}  # per running sequence: position -> state there, not kept yet
        self._pending: list[tuple[int, int, list[int | None]]] = []  # (seq, position, its layers' versions)
        self._restore: dict[int, State] = {}  # per admitted sequence: the state its first forward starts from
        self._stops: dict[int, tuple[int, ...]] = {}
        self._prompt_len: dict[int, int] = {}
        pool.on_forget = self._forget

    # -- admission ---------------------------------------------------------------------------------
    def match(self, seq_id: int, table: BlockTable, prompt_ids: list[int]) -> int:
        """Start the sequence's (empty) table from the longest cached prefix of its prompt that ends at a snapshot;
        return the cached token count. Sets the boundaries its prompt's chunks end at (`stops`)."""
        longest = 0

        def usable(hashes: list[BlockHash]) -> int:
            nonlocal longest
            longest = len(hashes)
            for n in range(len(hashes), 0, -1):
                state = self._kept.get(hashes[n - 1])
                if state is not None:
                    self._kept.move_to_end(hashes[n - 1])
                    self._restore[seq_id] = state
                    return n
            return 0

        cached = table.match_prefix(prompt_ids, usable)
        bs = self.pool.block_size
        last = (len(prompt_ids) - 1) // bs * bs
        self._stops[seq_id] = tuple(sorted({p for p in (longest * bs, last) if p > cached}))
        self._prompt_len[seq_id] = len(prompt_ids)
        return cached

    def stops(self, seq_id: int) -> tuple[int, ...]:
        """Prompt positions a prefill chunk of the sequence must end at (a snapshot is taken there)."""
        return self._stops.get(seq_id, ())

    # -- forwards ----------------------------------------------------------------------------------
    def start(self, seq_id: int) -> None:
        """Before the sequence's first forward: its slot loaded with the snapshot its cached prefix ends at."""
        state = self._restore.pop(seq_id, None)
        if state is not None:
            self.states.load(seq_id, state)

    def expect(self, seq_id: int, position: int) -> None:
        """The forward being prepared leaves the sequence's state after `position` tokens, a boundary to keep."""
        self._pending.append((seq_id, position, self._versions()))

    def capture(self) -> None:
        """Copy the states that the forwards prepared since `expect` left; called before anything writes a state
        again (the storage's next forward, or a sequence's end)."""
        pending, self._pending = self._pending, []
        for seq_id, position, ids in pending:
            if seq_id not in self.states.slot_of or not self._replaced(ids):
                continue
            taken = self._taken.setdefault(seq_id, {})
            if position > self._prompt_len.get(seq_id, 0):  # a decode boundary: the newest one only
                for older in [p for p in taken if p > self._prompt_len.get(seq_id, 0)]:
                    del taken[older]
            if self._fit(1):
                taken[position] = self.states.copy(seq_id)

    # -- keeping, releasing ------------------------------------------------------------------------
    def keep(self, seq_id: int, tokens: list[int]) -> None:
        """Keep the sequence's snapshots at positions within `tokens` (its tokens whose state and KV were computed,
        their full blocks just offered to the prefix cache) under the hash of the cached block ending there."""
        taken = self._taken.get(seq_id, {})
        for position in [p for p in sorted(taken) if p <= len(tokens)]:
            state = taken.pop(position)
            block_hash = self.pool.prefix_hash(tokens, position // self.pool.block_size)
            if self.pool.holds(block_hash) and block_hash not in self._kept:
                self._kept[block_hash] = state

    def release(self, seq_id: int) -> None:
        """The sequence ended: what it did not keep goes."""
        for table in (self._taken, self._restore, self._stops, self._prompt_len):
            table.pop(seq_id, None)

    # -- accounting --------------------------------------------------------------------------------
    def used(self) -> int:
        """KV-budget tokens the admitted sequences use: their blocks and their state slots (each takes one)."""
        held = self.pool.num_blocks - self.pool.num_available()
        return held * self.pool.block_size + len(self._prompt_len) * self.tokens

    def fit(self) -> None:
        """Within the bounds again after the sequences took blocks or slots (the storage calls it after each
        allocation): kept snapshots go, least recently used first, then running sequences' ones not kept yet."""
        while not self._fits(0):
            if self._kept:
                self._kept.popitem(last=False)
            elif any(self._taken.values()):
                taken = next(t for t in self._taken.values() if t)
                del taken[min(taken)]
            else:
                return

    def _fit(self, new: int) -> bool:
        """Whether `new` more snapshots fit, after evicting the least recently used kept ones as far as needed."""
        while not self._fits(new) and self._kept:
            self._kept.popitem(last=False)
        return self._fits(new)

    def _fits(self, new: int) -> bool:
        count = self.count + new
        return count <= self.most and (self.budget is None or self.used() + count * self.tokens <= self.budget)

    @property
    def count(self) -> int:
        return len(self._kept) + sum(len(taken) for taken in self._taken.values())

    @property
    def nbytes(self) -> int:
        states = list(self._kept.values()) + [s for taken in self._taken.values() for s in taken.values()]
        return sum(a.nbytes for state in states for parts in state if parts for a in parts)

    def _forget(self, block_hash: BlockHash) -> None:
        self._kept.pop(block_hash, None)

    def _versions(self) -> list[int | None]:
        return [v if parts else None for v, parts in zip(self.states.versions, self.states.arrays)]

    def _replaced(self, ids: list[int | None]) -> bool:
        """Whether every recurrent layer's state changed since `ids` were taken (the pool's versions: a forward
        writes every layer's state, through new arrays or a kernel's in-place update)."""
        now = self._versions()
        return all(
            new is not None and new != old for new, old, recurrent in zip(now, ids, self.states.recurrent) if recurrent
        )
