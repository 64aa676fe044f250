"""A GraphDecoder whose CUDA driver is MLX (engine/graph_decode.py's bookkeeping on any backend): the graph's
engine tests and `mlxcel bench`'s graph_steps test."""

from __future__ import annotations

import mlx.core as mx

from mlxcel_core.backends.cuda.graph_decode import GraphDecoder, _Replay
from mlxcel_core.backends.cuda.kernels.greedy import greedy_tokens, masked_greedy_tokens
from mlxcel_core.engine.step_inputs import packed_ints


class StandInDecoder(GraphDecoder):
    """GraphDecoder's bookkeeping, MLX in place of the driver: each 'replay' is the step computed op by op."""

    def __init__(self, model, storage, engine):
        super().__init__(model, storage)
        self.engine, self.settles, self.alone = engine, 0, []

    def _build(self, seq_id, latest, caches, parts, launches, token, readout, pool_addresses, mask=None):
        _, spans = packed_ints(*parts)
        self.built_masked += mask is not None
        return _Replay(seq_id, None, token, 0, 0, 0, spans, [], [], masked="masked" if mask is not None else None)

    built_masked = 0  # recordings of a constrained row's step
    masked_replays = 0

    pools_moved = False  # whether MLX's pool writes "moved" the pools (new memory) or wrote into the old memory

    def _addresses(self, arrays):
        # "moved": every new pool array, and every recording (which may grow the pools), is new memory. (A step
        # of our kernels on CUDA writes the pools in place, so the arrays alone would not show a recording's move.)
        return [(id(a), self.recorded) for a in arrays] if self.pools_moved else [0] * len(arrays)

    def _adopt(self, replay, seq_id, latest):  # the real one copies `latest` into the graph's token buffer
        if replay.seq_id != seq_id and self.open_rows(replay.seq_id):
            return False
        replay.token, replay.seq_id = latest, seq_id
        self.adopted += 1
        return True

    def _launch(self, replay, parts, flat, masks=None):
        self.alone.append(sum(1 for _ in self.engine._live()))
        logits = self.model(replay.token[:, None], self.storage.decode_views(parts))[:, -1, :]
        if replay.masked is None:
            replay.token, readout = greedy_tokens(logits)
        else:  # the forward, then the mask the engine computes meanwhile, then the masked greedy
            mx.async_eval(logits)
            bitmask = masks()
            if bitmask is None:
                return None
            self.masked_replays += 1
            replay.token, readout = masked_greedy_tokens(logits, mx.array(bitmask))
        mx.eval(replay.token, readout)
        self._pool_addresses = self._addresses(self._kept())  # a replay's kernels write the pools in place
        self._pools_version = self.storage.pools_version
        return readout

    def settle(self):
        self.settles += 1


def attach_stand_in(engine) -> StandInDecoder:
    """Give `engine` a stand-in graph (as the engine makes a GraphDecoder on CUDA)."""
    engine.graph = stand_in = StandInDecoder(engine.runner.model, engine.storage, engine)
    stand_in.open_rows = lambda seq_id: seq_id in engine._latest
    return stand_in
