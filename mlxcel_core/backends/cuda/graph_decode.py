"""A lone greedy row's decode steps replayed as CUDA graphs of our own kernels (the CUDA backend's replayer).

Why: at batch 1 a small model's step is bound by the host, not the GPU: building the step's graph in Python and MLX,
and MLX encoding ~88 kernel nodes into CUDA graphs each token, take longer than the GPU's own work. Every launch of
that step is one of our cached kernels (kernels/cubin_cache.py), so it can be recorded once and replayed by the CUDA
driver with nothing of MLX's a token, giving the plain engine's greedy tokens (tests/mlxcel_core/backends/cuda/
test_graph_decode.py). Recordings are kept and adopted across requests, so a request's first token never waits for
one. EngineConfig.decode_graph=False builds an engine without it.

- record: one decode step of the row runs op by op through MLX, greedy included, inside
  `cubin_cache.record_launches` and `rms_norm.final_norm_as_kernel`. That step's token is the engine's, as from any
  MLX step; its arrays are evaluated and kept.
- check (`blockers`): every launch is a cached kernel. Every input must be one of: an array the model's modules hold,
  the KV pools or combine counters, an earlier launch's output, the step's ints, the RoPE positions or the input
  token. An input MLX would copy first is not allowed either (the replay would read the uncopied one). Otherwise
  the model keeps MLX steps (`usable` turns False, logged once).
- build: the graph copies the output token to the input token, then runs every launch.
- replay (`decode`): the host advances the storage (`decode_inputs`) and queues its ints and the RoPE position into
  their buffers from pinned memory. It then launches the graph and queues the readout's copy to the host. The engine
  reads that readout when it commits the step, one step behind, like an MLX step's.
- a constrained row (engine/constrained.py) is recorded and replayed in two graphs: the forward, then the masked
  greedy kernel. Between them the engine's `masks` callback reads the previous step and computes the row's allowed
  tokens on the host while the device runs the forward; the mask goes up from pinned memory into the recorded mask
  array, then the second graph runs. A row that ended meanwhile (its previous token was its last, or a dead end)
  gets no second graph and no token.
- A recording is kept per layout of the step's ints (the block table's padded width) and pool size, up to
  MAX_REPLAYS. Nothing else in it belongs to the row, so another row (the next request), or the same row after an
  MLX step, adopts it: its newest token is copied into the graph's token buffer. The buffer backs the newest token
  of the row that last replayed, so a row still open elsewhere (`open_rows`) is never adopted from.
- While nothing is recorded, a row's first decode step is the engine's own (`takes`): a recording waits for the
  GPU, and the engine reads the prompt's first token one step later, so that token would wait too (TTFT).

The graph runs on a stream of its own, which MLX does not order against its own. `settle` waits for the queued
graph steps, and the engine calls it before anything of MLX's runs. A replay that raises ends its row and turns the
graph off for the engine (`give_up`): later steps are MLX's. A dropped engine's graph gives its CUDA resources back
(`close`).
"""

from __future__ import annotations

import ctypes
import logging
import sys
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxcel_core.engine.step_inputs import packed_ints

from .kernels.cubin_cache import Launch, pdl_enabled, record_launches
from .kernels.greedy import greedy_tokens, masked_greedy_tokens
from .kernels.rms_norm import final_norm_as_kernel
from .kernels.rope_fold import last_positions

SLOTS = 4  # pinned buffers for steps in flight (the engine reads a step's readout one or two steps later)
MAX_REPLAYS = 8  # recordings kept (layouts of the step's ints, masked or not): each holds one step's buffers and graphs
MAX_INTS = 4096  # a step's ints (slots, block table, position, context length) at most
log = logging.getLogger("mlxcel.engine")


class NotReplayable(Exception):
    pass


def module_arrays(model) -> list[mx.array]:
    """Every array the model's modules hold, private ones too (a RoPE's cached frequencies, say)."""
    found = []
    for module in model.modules():
        for value in module.values():
            values = value if isinstance(value, (list, tuple)) else [value]
            found += [v for v in values if isinstance(v, mx.array)]
    return found


def blockers(
    launches: list[Launch],
    where: dict[int, int],
    held: set[int],
    step_ints: tuple[int, int],
    fresh: set[int],
    copied: set[int],
) -> list[str]:
    """Why the recorded step cannot be replayed (empty: it can). `where`: array id -> device address; `held`: the
    addresses of arrays that outlive the step (model, pools, counters); `step_ints`: the ints' [start, end) bytes;
    `fresh`: the addresses of the per-step inputs the replay rewrites (positions, input token: by address, as a
    launch may read a view of them, another array object); `copied`: ids of inputs MLX copies before a launch."""
    problems = []
    made: list[tuple[int, int]] = []
    for i, launch in enumerate(launches):
        if launch.func is None:
            problems.append(f"launch {i} is not a cached kernel (MLX's own, or with an init value)")
            continue
        for a in launch.inputs:
            at = where[id(a)]
            if id(a) in copied:
                problems.append(f"launch {i} ({launch.func}) reads a {a.shape} {a.dtype} array MLX copies first")
            elif not (
                at in held or at in fresh or step_ints[0] <= at < step_ints[1] or any(lo <= at < hi for lo, hi in made)
            ):
                problems.append(f"launch {i} ({launch.func}) reads a {a.shape} {a.dtype} array made by MLX in the step")
        made += [(where[id(o)], where[id(o)] + o.nbytes) for o in launch.outputs]
    return problems


class HostReadout:
    """A replayed step's readout (its token, -1 for NaN logits), as the engine reads an MLX step's: `tolist`."""

    def __init__(self, driver, event, host):
        self.driver, self.event, self.host = driver, event, host

    def tolist(self) -> list[int]:
        self.driver.wait(self.event)
        return [ctypes.c_int32.from_address(self.host.value).value]


@dataclass
class _Slot:
    ints: ctypes.c_void_p
    position: ctypes.c_void_p
    readout: ctypes.c_void_p
    event: ctypes.c_void_p
    used: bool = False
    mask: ctypes.c_void_p | None = None  # a constrained row's packed mask, allocated at its first use
    mask_bytes: int = 0


@dataclass
class _Replay:
    seq_id: int  # the row that replayed last: its newest token is `token`
    exe: ctypes.c_void_p | None
    token: mx.array  # the greedy launch's token output: the engine's latest token of the row after every replay
    token_at: int  # its device address (a row adopting the replay writes its newest token there)
    readout_at: int
    ints_at: int
    spans: list
    positions: list[tuple[int, float]]  # (device address, RoPE scale) of the positions the kernels read
    arrays: list  # the recorded step's arrays, kept alive (the graph points into their buffers)
    masked: object = None  # a constrained row's: the masked greedy's graph (`exe` is then the forward alone)
    mask_at: int = 0  # the mask array's device address


class GraphDecoder:
    def __init__(self, model, storage, open_rows=lambda seq_id: False):
        self.model, self.storage, self.open_rows = model, storage, open_rows
        self.usable = True
        self.replays: dict[tuple, _Replay] = {}  # (ints layout, pool rows) -> recording, oldest first
        self.driver = None
        self.slots: list[_Slot] = []
        self.replayed = 0  # steps replayed (tests, logs)
        self.recorded = 0
        self.adopted = 0  # replays taken over by another row or after an MLX step
        self.why_not: str | None = None  # why the step could not be replayed, once `usable` is False
        self._stepped: int | None = None  # the row whose first step `takes` left to the engine
        self._pools_version = -1  # the storage's pools_version when the replays' pool addresses were checked
        self._pool_addresses: list[int] = []
        self._held_model: set[int] | None = None

    def decode(self, seq_id: int, latest: mx.array, masks=None) -> tuple[mx.array | None, object]:
        """One decode step of the lone row `seq_id` whose newest token is `latest`: (token, readout). `masks`: a
        constrained row's, called once the forward is queued; it returns the row's packed mask (int32 [1, words]),
        or None where the row has ended, and then the step has no token: (None, None)."""
        parts = self.storage.decode_inputs((seq_id,))
        flat, spans = packed_ints(*parts)
        # (pool rows: a step whose blocks need more rows than the pools hold must be MLX's, which grows them)
        key = (tuple(spans), self.storage.pool_rows, masks is not None)
        if self.replays and self.storage.pools_version != self._pools_version:
            self._check_pools()
        replay = self.replays.get(key)
        if replay is not None and (latest is replay.token or self._adopt(replay, seq_id, latest)):
            readout = self._launch(replay, parts, flat, masks)
            self.replayed += 1
            return (replay.token, readout) if readout is not None else (None, None)
        return self._record(seq_id, latest, parts, key, masks)

    def takes(self, seq_id: int) -> bool:
        """Whether this step of the lone row `seq_id` is the graph's. Not a row's first step while nothing is
        recorded: that step is the engine's own, so a recording does not hold up the token before it."""
        if self.replays or seq_id == self._stepped:
            return True
        self._stepped = seq_id
        return False

    def settle(self) -> None:
        """Wait for the queued replays (before MLX touches the pools or the row's token)."""
        if self.driver is not None:
            self.driver.synchronize()

    def close(self) -> None:
        """Give back the CUDA graphs and the driver's buffers, events, cubins and stream (an engine that is dropped:
        `mlxcel bench` makes one a test, `serve` a throwaway one for its warm-up)."""
        if self.driver is None:
            self.replays.clear()  # (none was captured: recordings need the driver)
            return
        with self.driver.current():
            for key in list(self.replays):
                self._drop(key)
        self.driver.close()
        self.driver, self.slots = None, []

    def __del__(self):
        if self.driver is None or sys.is_finalizing():  # (at interpreter exit the CUDA library may be gone)
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing to report to from a finalizer
            pass

    # -- internals ----------------------------------------------------------------------------
    def _launch(self, replay: _Replay, parts: tuple, flat: list[int], masks=None) -> HostReadout | None:
        """Queue one replay: the step's ints and RoPE position uploaded, the graph (a constrained row's: the forward,
        its mask, the masked greedy), the readout's copy to the host. None: the constrained row ended meanwhile."""
        position = parts[3][0]
        slot = self.slots[self.replayed % SLOTS]
        driver = self.driver
        if slot.used:  # its pinned buffers may still feed a queued copy
            driver.wait(slot.event)
        (ctypes.c_int32 * len(flat)).from_address(slot.ints.value)[:] = flat
        driver.upload(replay.ints_at, slot.ints, 4 * len(flat))
        for i, (address, scale) in enumerate(replay.positions):
            host = slot.position.value + 4 * i
            ctypes.c_float.from_address(host).value = np.float32(position) * np.float32(scale)  # fold_positions' value
            driver.upload(address, host, 4)
        driver.launch_graph(replay.exe)
        ended = replay.masked is not None and not self._upload_mask(slot, replay, masks())
        if not ended:
            if replay.masked is not None:
                driver.launch_graph(replay.masked)
            driver.download(slot.readout, replay.readout_at, 4)
        driver.record(slot.event)  # (also when ended: the slot's pinned ints may still feed a queued copy)
        slot.used = True
        return None if ended else HostReadout(driver, slot.event, slot.readout)

    def _upload_mask(self, slot: _Slot, replay: _Replay, bitmask: np.ndarray | None) -> bool:
        """Queue the copy of a constrained row's mask into the replay's mask array; False: no mask (the row ended)."""
        if bitmask is None:
            return False
        nbytes = bitmask.nbytes
        if slot.mask_bytes < nbytes:
            slot.mask, slot.mask_bytes = self.driver.pinned(nbytes), nbytes
        ctypes.memmove(slot.mask.value, bitmask.ctypes.data, nbytes)
        self.driver.upload(replay.mask_at, slot.mask, nbytes)
        return True

    def _kept(self) -> list[mx.array]:
        """The arrays a replay reads that the storage owns: the KV pools and the combine counters."""
        kept = [a for pools in self.storage.pools if pools for a in pools]
        return kept + [c for c in self.storage.combine_counters if c is not None]

    def _check_pools(self) -> None:
        """The storage replaced pool arrays since the replays were checked (MLX wrote them: a prefill, an MLX
        step). Where MLX gave the new arrays the old memory (donation) the replays still hold; otherwise they
        point at freed memory and are dropped."""
        self.settle()
        if self._addresses(self._kept()) != self._pool_addresses:
            for key in list(self.replays):
                self._drop(key)
        self._pools_version = self.storage.pools_version

    def _addresses(self, arrays: list[mx.array]) -> list[int]:
        from .kernels.cuda_driver import addresses

        return addresses(arrays)

    def _adopt(self, replay: _Replay, seq_id: int, latest: mx.array) -> bool:
        """Make `replay` continue from `latest` (another row's, or this row's after an MLX step); False where it
        cannot: the row that replayed last is still open (the token buffer is its newest token), or `latest` is not
        one token of the graph's dtype."""
        if (
            (replay.seq_id != seq_id and self.open_rows(replay.seq_id))
            or latest.dtype != replay.token.dtype
            or latest.size != 1
        ):
            return False
        self.settle()
        mx.eval(latest)
        self.driver.copy_on_device(replay.token_at, self._addresses([latest])[0], latest.nbytes)
        replay.seq_id = seq_id
        self.adopted += 1
        return True

    def _record(self, seq_id: int, latest: mx.array, parts: tuple, key: tuple, masks=None) -> tuple:
        self.settle()
        storage = self.storage
        mask = None
        with record_launches() as launches, final_norm_as_kernel():
            caches = storage.decode_views(parts)
            logits = self.model(latest[:, None], caches)[:, -1, :]
            if masks is None:
                token, readout = greedy_tokens(logits)
            else:
                mx.async_eval(logits)  # (the host computes the mask meanwhile, as in a replay)
                bitmask = masks()
                if bitmask is None:
                    return None, None
                mask = mx.array(bitmask)
                token, readout = masked_greedy_tokens(logits, mask)
        self.recorded += 1
        try:
            pool_addresses = self._addresses(self._kept())
            replay = self._build(seq_id, latest, caches, parts, launches, token, readout, pool_addresses, mask)
            if pool_addresses != self._pool_addresses:  # this step moved the pools (grew them): the others are stale
                for stale in list(self.replays):
                    self._drop(stale)
            self._pool_addresses, self._pools_version = pool_addresses, storage.pools_version
            if len(self.replays) >= MAX_REPLAYS:
                self._drop(next(iter(self.replays)))
            self.replays[key] = replay
        except Exception as exc:  # noqa: BLE001 - this step's token is MLX's all the same; later steps stay MLX's
            self.give_up(exc, warn=False)
        return token, readout

    def give_up(self, exc: Exception, warn: bool = True) -> None:
        """No step is replayed from now on (`usable` False, `why_not` says why): the engine's MLX steps serve."""
        self.usable = False
        self.why_not = f"{type(exc).__name__}: {exc}"
        (log.warning if warn else log.info)(
            "mlxcel: decode steps are not replayed as a CUDA graph for this model (%s)", self.why_not
        )

    def _build(self, seq_id, latest, caches, parts, launches, token, readout, pool_addresses, mask=None) -> _Replay:
        """The step's recording as a replay: checked (`blockers`), its graphs captured. `mask`: a constrained row's
        mask array (the masked greedy's input the replay rewrites)."""
        from .kernels.cuda_driver import addresses, issue_launches

        greedy = "mlxcel_greedy_tokens" if mask is None else "mlxcel_masked_greedy_tokens"
        if not launches or not launches[-1].func or not launches[-1].func.startswith(greedy + "_"):
            raise NotReplayable(f"the step does not end in the {greedy} kernel")
        if launches[-1].outputs[0] is not token or launches[-1].outputs[1] is not readout:
            raise NotReplayable("the greedy kernel's outputs are not the step's token and readout")
        step_ints = caches[0].slots[0]  # a view at offset 0 of the step's ints (engine/step_inputs.py)
        roped = last_positions(caches[0].offset)
        rewritten = [a for a in (latest, roped[0] if roped else None, mask) if a is not None]  # by every replay
        arrays = {id(a): a for launch in launches for a in launch.inputs + launch.outputs}
        arrays.update({id(a): a for a in (step_ints, *rewritten)})
        arrays = list(arrays.values())
        mx.eval(arrays)
        mx.synchronize()
        where = dict(zip(map(id, arrays), addresses(arrays)))
        inputs = list({id(a): a for launch in launches for a in launch.inputs}.values())
        copied = {id(a) for a, at in zip(inputs, addresses(inputs, ensure_row_contiguous=True)) if at != where[id(a)]}
        if self._held_model is None:
            self._held_model = set(addresses(module_arrays(self.model)))
        held = self._held_model | set(pool_addresses)
        mx.synchronize()
        ints_at = where[id(step_ints)]
        flat, spans = packed_ints(*parts)
        if len(flat) > MAX_INTS:
            raise NotReplayable(f"{len(flat)} step ints")
        fresh = {where[id(a)] for a in rewritten}
        problems = blockers(launches, where, held, (ints_at, ints_at + 4 * len(flat)), fresh, copied)
        if problems:
            raise NotReplayable(f"{problems[0]} (and {len(problems) - 1} more)" if len(problems) > 1 else problems[0])
        driver, token_out, token_in = self._driver(), where[id(token)], where[id(latest)]
        forward = launches if mask is None else launches[:-1]

        def issue():
            driver.copy_on_device(token_in, token_out, 4)
            issue_launches(driver, forward, where, programmatic=pdl_enabled())

        exe = driver.capture(issue)
        masked = None if mask is None else driver.capture(lambda: issue_launches(driver, launches[-1:], where))
        positions = [(where[id(roped[0])], roped[1])] if roped else []
        # The storage's arrays are not held here: holding a pool would keep MLX from writing the next one into its
        # memory, and the replays would then be dropped at every prefill (_check_pools).
        kept_ids = {id(a) for a in self._kept()}
        arrays = [a for a in arrays if id(a) not in kept_ids]
        mask_at = 0 if mask is None else where[id(mask)]
        return _Replay(
            seq_id, exe, token, token_out, where[id(readout)], ints_at, spans, positions, arrays, masked, mask_at
        )

    def _driver(self):
        """The driver, its stream and the pinned buffers of the steps in flight, made at the first recording."""
        from .kernels.cuda_driver import Driver

        if self.driver is None:
            self.driver = driver = Driver()
            self.slots = [
                _Slot(driver.pinned(4 * MAX_INTS), driver.pinned(64), driver.pinned(4), driver.event())
                for _ in range(SLOTS)
            ]
        return self.driver

    def _drop(self, key: tuple) -> None:
        replay = self.replays.pop(key)
        if replay.exe is not None:
            self.settle()
            self.driver.destroy_graph(replay.exe)
            if replay.masked is not None:
                self.driver.destroy_graph(replay.masked)
