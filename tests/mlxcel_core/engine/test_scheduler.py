"""BatchScheduler policy, without a model: admission, chunked prefill, grant interval, budget."""

from __future__ import annotations

import pytest

from mlxcel_core.engine.scheduler import BatchScheduler, PrefillWork, SchedulerConfig
from mlxcel_core.errors import InputError


def make(**kw):
    return BatchScheduler(SchedulerConfig(**kw))


def test_single_request_prefills_in_chunks_then_decodes_to_its_limit():
    s = make(prefill_chunk_size=4)
    s.add(0, prompt_len=10, max_tokens=3)
    plans = [s.schedule() for _ in range(5)]
    assert [p.prefill for p in plans[:3]] == [
        PrefillWork(0, 0, 4, False),
        PrefillWork(0, 4, 8, False),
        PrefillWork(0, 8, 10, True),
    ]
    assert plans[0].admitted == (0,)
    assert [p.decode for p in plans] == [(), (), (), (0,), (0,)]
    assert s.schedule().decode == ()  # 3 tokens produced: 1 from prefill + 2 decodes
    s.finish(0)
    assert not s.has_work()


def test_new_arrival_gets_one_chunk_then_waits_for_the_grant_interval():
    s = make(prefill_chunk_size=4, prefill_grant_interval=3)
    s.add(0, prompt_len=2, max_tokens=100)
    s.schedule()  # prefill of request 0, whole prompt
    s.add(1, prompt_len=20, max_tokens=5)
    plans = [s.schedule() for _ in range(9)]
    prefills = [(i, p.prefill.start) for i, p in enumerate(plans) if p.prefill]
    # First chunk at once (new arrival), then one chunk after every 3 decode-only steps.
    assert prefills == [(0, 0), (4, 4), (8, 8)]
    assert all(p.decode[:1] == (0,) for p in plans)


def test_max_batch_size_and_fifo_admission():
    s = make(max_batch_size=2)
    for i in range(3):
        s.add(i, prompt_len=3, max_tokens=2)
    assert s.schedule().admitted == (0, 1)
    assert s.num_waiting == 1
    s.finish(0)
    assert s.schedule().admitted == (2,)


def test_kv_budget_refuses_the_impossible_and_queues_what_fits_later():
    s = make(max_batch_size=4, kv_budget_tokens=100)
    with pytest.raises(InputError, match="KV budget holds 100"):
        s.add(9, prompt_len=90, max_tokens=20)
    s.add(0, prompt_len=50, max_tokens=30)
    s.add(1, prompt_len=10, max_tokens=20)  # 80 + 30 > 100: waits
    assert s.schedule().admitted == (0,)
    assert s.schedule().admitted == ()
    s.finish(0)
    assert s.schedule().admitted == (1,)


def test_cancel_of_waiting_and_running_requests():
    s = make(max_batch_size=1)
    s.add(0, prompt_len=3, max_tokens=5)
    s.add(1, prompt_len=3, max_tokens=5)
    s.schedule()
    s.cancel(0)
    s.cancel(1)
    plan = s.schedule()
    assert sorted(plan.cancelled) == [0, 1]
    assert not s.has_work()


def test_prefix_cache_hits_skip_prompt_tokens_but_never_the_last():
    s = BatchScheduler(SchedulerConfig(), on_admit=lambda seq_id: {0: 64, 1: 96}[seq_id])
    s.add(0, prompt_len=100, max_tokens=1)
    s.add(1, prompt_len=96, max_tokens=1)
    assert s.schedule().prefill == PrefillWork(0, 64, 100, True)
    assert s.schedule().prefill == PrefillWork(1, 95, 96, True)


def test_whole_prompts_go_together_within_the_limit_and_the_padded_budget():
    s = make(max_batch_size=8, prefill_chunk_size=40, prefill_batch_size=3)
    for seq_id, length in enumerate([10, 12, 30, 5, 8]):
        s.add(seq_id, prompt_len=length, max_tokens=4)
    plan = s.schedule()
    # 0 first; 1: 2 x 12 <= 40; 2 (30 tokens): 3 x 30 > 40, skipped; 3: 3 x 12 <= 40; then the limit of 3
    assert plan.prefill == PrefillWork(0, 0, 10, True)
    assert plan.together == (PrefillWork(1, 0, 12, True), PrefillWork(3, 0, 5, True))
    assert plan.prefills == (plan.prefill, *plan.together)
    plan = s.schedule()  # the three decode; 2 is next (4: 2 x 30 > 40)
    assert plan.decode == (0, 1, 3) and plan.prefill == PrefillWork(2, 0, 30, True) and plan.together == ()
    plan = s.schedule()
    assert plan.decode == (0, 1, 2, 3) and plan.prefill == PrefillWork(4, 0, 8, True) and plan.together == ()


def test_no_prompts_together_by_default_nor_after_a_partial_chunk_or_a_prefix_hit():
    s = make(prefill_chunk_size=64)
    for seq_id in range(3):
        s.add(seq_id, prompt_len=4, max_tokens=2)
    assert s.schedule().together == ()  # prefill_batch_size 1
    s = make(prefill_chunk_size=8, prefill_batch_size=4)
    s.add(0, prompt_len=20, max_tokens=2)  # chunked: its first chunk is not a whole prompt
    s.add(1, prompt_len=3, max_tokens=2)
    assert s.schedule().together == ()
    s = BatchScheduler(
        SchedulerConfig(prefill_chunk_size=64, prefill_batch_size=4), on_admit=lambda seq_id: 16 if seq_id == 1 else 0
    )
    s.add(0, prompt_len=4, max_tokens=2)
    s.add(1, prompt_len=20, max_tokens=2)  # 16 tokens from the prefix cache: prefilled on its own
    s.add(2, prompt_len=6, max_tokens=2)
    plan = s.schedule()
    assert plan.prefill == PrefillWork(0, 0, 4, True) and plan.together == (PrefillWork(2, 0, 6, True),)
    assert s.schedule().prefill == PrefillWork(1, 16, 20, True)
    with pytest.raises(InputError, match="prefill_batch_size"):
        SchedulerConfig(prefill_batch_size=0)


def test_prefill_chunks_end_at_the_storage_stops_and_first_chunks_go_together():
    """A recurrent model's storage keeps the state at some prompt positions (engine/state_snapshots.py): a chunk ends
    at each. Prompts not started go together up to their first stop (or whole), within the padded budget, where no
    chunk that stops early is padded; the rests of those that stopped early there go next, granted at once while
    others decode, together where they start and end at the same positions; the rest of a prompt that went alone
    waits for the grant interval."""
    stops = {0: (16, 40), 1: (), 2: (8,), 3: (16,), 4: (24,), 5: ()}
    s = BatchScheduler(
        SchedulerConfig(prefill_chunk_size=64, prefill_batch_size=4), on_admit=lambda seq_id: (0, stops[seq_id])
    )
    for seq_id, length in enumerate([45, 5, 12, 40, 26, 20]):
        s.add(seq_id, prompt_len=length, max_tokens=10)
    plan = s.schedule()  # 2 (8 tokens to its stop) would be padded, 4 (24) would pad 0 and 3, 5 (20) too
    assert plan.prefill == PrefillWork(0, 0, 16, False)
    assert plan.together == (PrefillWork(1, 0, 5, True), PrefillWork(3, 0, 16, False))
    plan = s.schedule()  # 16 to 40: 0's next stop, 3's end
    assert plan.decode == (1,) and plan.prefill == PrefillWork(0, 16, 40, False)
    assert plan.together == (PrefillWork(3, 16, 40, True),)
    plan = s.schedule()
    assert plan.decode == (1, 3) and plan.prefill == PrefillWork(0, 40, 45, True) and plan.together == ()
    plan = s.schedule()  # 4 (24) would pad 2; 5 (whole, 20 tokens) too
    assert plan.decode == (0, 1, 3) and plan.prefill == PrefillWork(2, 0, 8, False) and plan.together == ()
    plan = s.schedule()  # its rest waits for the grant interval
    assert plan.decode == (0, 1, 3) and plan.prefill is None


def test_no_chunk_that_ends_at_a_stop_is_padded():
    """Whole prompts may be padded beside a chunk that ends at a stop, never the other way round, and a prompt whose
    end is a stop (its state there is kept) is not padded either."""
    stops = {0: (), 1: (16,), 2: (), 3: (12,), 4: (10,)}
    s = BatchScheduler(
        SchedulerConfig(prefill_chunk_size=100, prefill_batch_size=8), on_admit=lambda seq_id: (0, stops[seq_id])
    )
    for seq_id, length in enumerate([6, 20, 30, 12, 10]):
        s.add(seq_id, prompt_len=length, max_tokens=10)
    plan = s.schedule()  # 2 (whole, 30) would pad 1's chunk; 3 and 4 end at stops shorter than 16
    assert plan.prefill == PrefillWork(0, 0, 6, True) and plan.together == (PrefillWork(1, 0, 16, False),)
    assert s.schedule().prefill == PrefillWork(1, 16, 20, True)
    plan = s.schedule()
    assert plan.prefill == PrefillWork(2, 0, 30, True) and plan.together == ()
    plan = s.schedule()
    assert plan.prefill == PrefillWork(3, 0, 12, True) and plan.together == ()
