"""Rank 0 schedules, the others mirror (distributed/mirror.py): a batching engine with arrivals at different
steps, a cancel and sampled rows gives rank 0 exactly the single-process tokens, and every rank exits 0.
Also: byte broadcast, the leader's refusals, the per-rank environments of local ranks, and shard-aware random
model shapes (each rank's layers are exactly slices of the single-process model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import FakeGroup, save_tiny_llama

from mlxcel_core.errors import InputError

SCRIPT = Path(__file__).with_name("mirror_rank.py")
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("mirror-llama"))


def _ranks(llama, tmp_path, tp, storage):
    from mlxcel_core.distributed.group import _free_ports

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(tp)]))
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "MLX_HOSTFILE": str(hostfile), "MLXCEL_TP_BACKEND": "ring"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(llama), str(tp), storage],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "MLX_RANK": str(r)} if tp > 1 else env,
        )
        for r in range(tp)
    ]
    try:
        return [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_followers_mirror_a_batching_engine(llama, tmp_path, storage):
    [(single, err, code)] = _ranks(llama, tmp_path, 1, storage)
    assert code == 0, err
    ranks = _ranks(llama, tmp_path, 2, storage)
    assert [code for *_, code in ranks] == [0, 0], [err for _, err, _ in ranks]
    expected, got = json.loads(single), json.loads(ranks[0][0])
    assert got == expected
    assert 0 < len(expected["1"]) < 12  # the cancelled row stopped part-way
    assert all(len(expected[k]) == 12 for k in ("0", "2", "3", "5"))
    assert ranks[1][0] == ""  # followers print nothing


def _group_of_one():
    """A group of one (its all_sum is the identity): the leader's side of a broadcast, in process."""
    import mlx.core as mx

    return mx.distributed.init()


def test_broadcast_bytes_round_trips_any_length():
    from mlxcel_core.distributed.mirror import broadcast_bytes

    for payload in (b"", b"x", b"abcd", b"abcde", bytes(range(256)) * 3):
        assert broadcast_bytes(_group_of_one(), payload) == payload


def test_leader_fixes_seeds_and_refuses_processors():
    from mlxcel_core.distributed.mirror import LeaderMirror
    from mlxcel_core.sampling import SamplingParams

    mirror = LeaderMirror(_group_of_one())
    assert mirror.prepare(SamplingParams(temperature=0.7)).seed is not None
    assert mirror.prepare(SamplingParams(temperature=0.7, seed=3)).seed == 3
    assert mirror.prepare(SamplingParams()).seed is None  # greedy needs none
    with pytest.raises(InputError, match="logits processors cannot be used with tensor parallelism"):
        mirror.prepare(SamplingParams(logits_processors=(lambda ids, logits: logits,)))


def test_leader_records_opens_closes_and_forgotten_conversations(monkeypatch):
    import gc

    from mlxcel_core.distributed import mirror as mirror_module
    from mlxcel_core.engine import Conversation
    from mlxcel_core.sampling import SamplingParams

    sent = []
    monkeypatch.setattr(mirror_module, "broadcast_bytes", lambda group, payload: sent.append(payload))
    mirror = mirror_module.LeaderMirror(_group_of_one())
    conversation = Conversation()
    mirror.opened(0, [5, 6], SamplingParams(), conversation, 99)
    mirror.opened(1, [7], SamplingParams(), conversation, 99)
    mirror.before_step()
    mirror.before_step()  # nothing new: an empty payload
    mirror.closed(1)
    del conversation
    gc.collect()
    mirror.stop()
    mirror.stop()  # once only
    first, empty, last = sent
    from mlxcel_core.distributed.wire import decode

    opened = decode(first)
    assert [r[:3] + r[4:] for r in opened] == [("open", 0, [5, 6], 0, 99), ("open", 1, [7], 0, 99)]
    assert opened[0][3] == SamplingParams()
    assert empty == b""
    assert decode(last) == [("close", 1), ("forget", 0), ("stop",)]


def test_local_ranks_use_one_gpu_each_with_nccl(monkeypatch):
    from mlxcel_core.distributed.group import _rank_environments

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    envs = _rank_environments(2, "nccl", None)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3", "5"]
    assert {e["NCCL_HOST_IP"] for e in envs} == {"127.0.0.1"} and len({e["NCCL_PORT"] for e in envs}) == 1
    assert [(e["MLX_RANK"], e["MLX_WORLD_SIZE"]) for e in envs] == [("0", "2"), ("1", "2")]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(InputError, match="needs 2 GPUs"):
        _rank_environments(2, "nccl", None)
    monkeypatch.setenv("MLXCEL_TP_BACKEND", "gloo")
    from mlxcel_core.distributed.group import local_backend

    with pytest.raises(InputError, match="MLXCEL_TP_BACKEND must be ring or nccl"):
        local_backend()


@pytest.mark.parametrize("bits", [None, 4])
def test_random_shape_shards_are_slices_of_the_single_process_model(bits, monkeypatch):
    import mlx.core as mx

    from mlxcel_core.loading import shapes

    monkeypatch.setitem(
        shapes.SHAPES,
        "tiny-4h",
        {**shapes.SHAPES["tiny"], "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2},
    )
    full, _ = shapes.build_random_model("tiny-4h", bits=bits, dtype="float32", seed=3)
    part, _ = shapes.build_random_model("tiny-4h", bits=bits, dtype="float32", seed=3, group=FakeGroup(1, 2))
    fa, pa = full.layers[1].self_attn, part.layers[1].self_attn
    assert pa.n_heads == fa.n_heads // 2
    half = fa.q_proj.weight.shape[0] // 2
    assert mx.array_equal(pa.q_proj.weight, fa.q_proj.weight[half:])
    cols = fa.o_proj.weight.shape[1] // 2
    assert mx.array_equal(pa.o_proj.weight, fa.o_proj.weight[:, cols:])
    if bits:
        assert mx.array_equal(pa.o_proj.scales, fa.o_proj.scales[:, fa.o_proj.scales.shape[1] // 2 :])
    assert mx.array_equal(part.lm_head.weight, full.lm_head.weight)


def test_a_rank_keeps_only_its_share_of_memory(monkeypatch):
    """Slices are copied out: a view would keep each whole tensor alive (every rank holding the full model)."""
    import gc

    import mlx.core as mx

    from mlxcel_core.loading import shapes

    monkeypatch.setitem(
        shapes.SHAPES,
        "wide",
        {
            **shapes.SHAPES["tiny"],
            "hidden_size": 256,
            "intermediate_size": 1024,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 64,
        },
    )

    def settled_memory() -> int:
        # Arrays an earlier test dropped are freed when their last kernel is done: on a GPU, asynchronously.
        gc.collect()
        mx.synchronize()
        return mx.get_active_memory()

    def resident(group):
        before = settled_memory()
        model, _ = shapes.build_random_model("wide", dtype="float32", seed=1, group=group)
        used = settled_memory() - before
        del model
        return used

    full, half = resident(None), resident(FakeGroup(0, 2))
    assert half < 0.6 * full, (half, full)
