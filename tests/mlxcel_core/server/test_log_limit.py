"""server/log_limit.py: a warning repeated by a flood passes `burst` times a window; the next one let through says
how many were dropped; other kinds and INFO lines are untouched."""

from __future__ import annotations

import logging

from mlxcel_core.server.log_limit import RepeatFilter


def record(msg: str, *args, level=logging.WARNING, name="mlxcel.server") -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_repeats_are_dropped_then_counted():
    now = [0.0]
    limit = RepeatFilter(burst=3, window=60.0, clock=lambda: now[0])
    passed = [limit.filter(record("closed the connection of %s", f"10.0.0.{i}:1")) for i in range(1000)]
    assert passed[:3] == [True] * 3 and not any(passed[3:])
    assert limit.filter(record("another warning"))  # another kind
    assert all(limit.filter(record("seq %d done", i, level=logging.INFO)) for i in range(100))
    now[0] = 61.0
    later = record("closed the connection of %s", "10.0.0.9:1")
    assert limit.filter(later)
    assert later.getMessage() == "closed the connection of 10.0.0.9:1 (997 more like this were not logged)"


def test_a_message_whose_first_line_repeats_is_one_kind():
    limit = RepeatFilter(burst=1, window=60.0, clock=lambda: 0.0)
    assert limit.filter(record("socket.accept() out of system resource\nsocket: <fd=7>", level=logging.ERROR))
    assert not limit.filter(record("socket.accept() out of system resource\nsocket: <fd=9>", level=logging.ERROR))


def test_the_kinds_remembered_are_bounded():
    now = [0.0]
    limit = RepeatFilter(burst=1, window=10.0, clock=lambda: now[0], max_kinds=50)
    for i in range(500):
        now[0] = i * 0.1
        limit.filter(record(f"warning number {i}"))
    assert len(limit._seen) <= 50
