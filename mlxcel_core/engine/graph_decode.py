"""A lone greedy row's decode steps replayed as one CUDA graph of our own kernels (MLXCEL_CUDA_GRAPH=1, CUDA only).

Why: on the H200 a 1B 4-bit step is 0.89 ms of GPU work in 1.35-1.5 ms a token. The rest is the host building
the step's graph in Python and MLX, and MLX encoding ~88 kernel nodes into CUDA graphs each token. Every launch of
that step is one of our cached kernels (kernels/cubin_cache.py). Recorded once and replayed by the CUDA driver, with
nothing of MLX's a token, benchmarks/graph_replay.py decoded 1238-1250 tok/s, with greedy tokens identical to the
engine's (benchmarks/RESULTS.md, nineteenth session). This module's own first GPU run replayed nothing (a view of
the input token was taken for an MLX-made array, since fixed); it is off by default until a GPU run validates it.

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
  A step whose ints change layout (the block table's padded width doubles) or whose pools grow is an MLX step,
  recorded again.

The graph runs on a stream of its own, which MLX does not order against its own. `settle` waits for the queued
graph steps, and the engine calls it before anything of MLX's runs.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..kernels.cubin_cache import Launch, record_launches
from ..kernels.greedy import greedy_tokens
from ..kernels.rms_norm import final_norm_as_kernel
from ..models.rope import last_positions
from .step_inputs import packed_ints

ENV = "MLXCEL_CUDA_GRAPH"
SLOTS = 4  # pinned buffers for steps in flight (the engine reads a step's readout one or two steps later)
MAX_INTS = 4096  # a step's ints (slots, block table, position, context length) at most
log = logging.getLogger("mlxcel.engine")


def requested() -> bool:
    return os.environ.get(ENV, "").strip() == "1"


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


def blockers(launches: list[Launch], where: dict[int, int], held: set[int], step_ints: tuple[int, int],
             fresh: set[int], copied: set[int]) -> list[str]:
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
            elif not (at in held or at in fresh or step_ints[0] <= at < step_ints[1]
                      or any(lo <= at < hi for lo, hi in made)):
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


@dataclass
class _Replay:
    seq_id: int
    exe: ctypes.c_void_p | None
    token: mx.array  # the greedy launch's token output: the engine's latest token of the row after every replay
    readout_at: int
    ints_at: int
    spans: list
    pool_rows: int
    positions: list[tuple[int, float]]  # (device address, RoPE scale) of the positions the kernels read
    arrays: list  # the recorded step's arrays, kept alive (the graph points into their buffers)


class GraphDecoder:
    def __init__(self, model, storage):
        self.model, self.storage = model, storage
        self.usable = True
        self.replay: _Replay | None = None
        self.driver = None
        self.slots: list[_Slot] = []
        self.replayed = 0  # steps replayed (tests, logs)
        self.recorded = 0
        self.why_not: str | None = None  # why the step could not be replayed, once `usable` is False
        self._held_model: set[int] | None = None

    def decode(self, seq_id: int, latest: mx.array) -> tuple[mx.array, object]:
        """One decode step of the lone row `seq_id` whose newest token is `latest`: (token, readout)."""
        replay = self.replay
        if replay is not None and replay.seq_id == seq_id and latest is replay.token:
            parts = self.storage.decode_inputs((seq_id,))
            flat, spans = packed_ints(*parts)
            if spans == replay.spans and self.storage.pool_rows == replay.pool_rows:
                readout = self._launch(replay, parts, flat)
                self.replayed += 1
                return replay.token, readout
            return self._record(seq_id, latest, parts)
        return self._record(seq_id, latest, None)

    def settle(self) -> None:
        """Wait for the queued replays (before MLX touches the pools or the row's token)."""
        if self.driver is not None:
            self.driver.synchronize()

    # -- internals ----------------------------------------------------------------------------
    def _launch(self, replay: _Replay, parts: tuple, flat: list[int]) -> HostReadout:
        """Queue one replay: the step's ints and RoPE position uploaded, the graph, the readout's copy to the host."""
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
        driver.download(slot.readout, replay.readout_at, 4)
        driver.record(slot.event)
        slot.used = True
        return HostReadout(driver, slot.event, slot.readout)

    def _record(self, seq_id: int, latest: mx.array, parts: tuple | None) -> tuple[mx.array, mx.array]:
        self.settle()
        self._drop()
        storage = self.storage
        parts = parts if parts is not None else storage.decode_inputs((seq_id,))
        with record_launches() as launches, final_norm_as_kernel():
            caches = storage.decode_views(parts)
            logits = self.model(latest[:, None], caches)[:, -1, :]
            token, readout = greedy_tokens(logits)
        self.recorded += 1
        try:
            self.replay = self._build(seq_id, latest, caches, parts, launches, token, readout)
        except Exception as exc:  # noqa: BLE001 - this step's token is MLX's all the same; later steps stay MLX's
            self.usable = False
            self.why_not = f"{type(exc).__name__}: {exc}"
            log.warning("mlxcel: decode steps are not replayed as a CUDA graph for this model (%s: %s)",
                        type(exc).__name__, exc)
        return token, readout

    def _build(self, seq_id, latest, caches, parts, launches, token, readout) -> _Replay:
        from ..kernels.cuda_driver import Driver, addresses, issue_launches

        if not launches or not launches[-1].func or not launches[-1].func.startswith("mlxcel_greedy_tokens"):
            raise NotReplayable("the step does not end in the greedy kernel")
        if launches[-1].outputs[0] is not token or launches[-1].outputs[1] is not readout:
            raise NotReplayable("the greedy kernel's outputs are not the step's token and readout")
        step_ints = caches[0].slots[0]  # a view at offset 0 of the step's ints (engine/step_inputs.py)
        roped = last_positions(caches[0].offset)
        arrays = {id(a): a for launch in launches for a in launch.inputs + launch.outputs}
        arrays.update({id(a): a for a in (latest, step_ints, *(roped[:1] if roped else ()))})
        arrays = list(arrays.values())
        mx.eval(arrays)
        mx.synchronize()
        where = dict(zip(map(id, arrays), addresses(arrays)))
        inputs = list({id(a): a for launch in launches for a in launch.inputs}.values())
        copied = {id(a) for a, at in zip(inputs, addresses(inputs, ensure_row_contiguous=True)) if at != where[id(a)]}
        if self._held_model is None:
            self._held_model = set(addresses(module_arrays(self.model)))
        kept = [a for pools in self.storage.pools if pools for a in pools]
        kept += [c for c in self.storage.combine_counters if c is not None]
        held = self._held_model | set(addresses(kept))
        mx.synchronize()
        ints_at = where[id(step_ints)]
        flat, spans = packed_ints(*parts)
        if len(flat) > MAX_INTS:
            raise NotReplayable(f"{len(flat)} step ints")
        fresh = {where[id(latest)]} | ({where[id(roped[0])]} if roped else set())
        problems = blockers(launches, where, held, (ints_at, ints_at + 4 * len(flat)), fresh, copied)
        if problems:
            raise NotReplayable(f"{problems[0]} (and {len(problems) - 1} more)" if len(problems) > 1 else problems[0])
        if self.driver is None:
            self.driver = Driver()
            self.slots = [_Slot(self.driver.pinned(4 * MAX_INTS), self.driver.pinned(64), self.driver.pinned(4),
                                self.driver.event()) for _ in range(SLOTS)]
        driver, token_out, token_in = self.driver, where[id(token)], where[id(latest)]

        def issue():
            driver.copy_on_device(token_in, token_out, 4)
            issue_launches(driver, launches, where)

        exe = driver.capture(issue)
        positions = [(where[id(roped[0])], roped[1])] if roped else []
        return _Replay(seq_id, exe, token, where[id(readout)], ints_at, spans, self.storage.pool_rows, positions,
                       arrays)

    def _drop(self) -> None:
        if self.replay is not None and self.replay.exe is not None:
            self.driver.destroy_graph(self.replay.exe)
        self.replay = None

