"""Tensor-parallel inference over MLX's own distributed engine (`mx.distributed`, launched by `mlx.launch`).

group.py   join the group (with a timeout), run N local ranks over the ring backend, silence ranks > 0,
           turn a lost peer into a one-line error
shard.py   shard a built model in place: column-parallel q/k/v/gate/up, row-parallel o/down (one all_sum
           each), MoE experts split along their intermediate dimension, embeddings and LM head replicated
"""

from .group import init_group, is_launched, lost_peer_errors, run_local_ranks, shared_seed
from .shard import check_shardable, shard_model

__all__ = [
    "init_group",
    "is_launched",
    "lost_peer_errors",
    "run_local_ranks",
    "shared_seed",
    "check_shardable",
    "shard_model",
]
