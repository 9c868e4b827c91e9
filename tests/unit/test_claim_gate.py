"""The claim gate (DESIGN invariant 35) with real threads: one run at a time, in arrival order,
and a run past its patience lets the next one in beside it."""

from __future__ import annotations

import threading
import time

import pytest

from outbox_celery.claim.gate import ClaimGate, until_slot


def _run(gate: ClaimGate, name: str, hold: float, log: list[tuple[str, str, float]]) -> threading.Thread:
    def body() -> None:
        with gate.turn():
            log.append((name, "in", time.monotonic()))
            time.sleep(hold)
            log.append((name, "out", time.monotonic()))

    thread = threading.Thread(target=body, name=name)
    thread.start()
    return thread


def _queued(gate: ClaimGate, n: int) -> None:
    deadline = time.monotonic() + 5
    while len(gate._waiting) < n:
        assert time.monotonic() < deadline, "the runs never lined up"
        time.sleep(0.001)


def test_invariant_35_one_run_at_a_time_in_arrival_order() -> None:
    gate = ClaimGate(patience=5.0)
    log: list[tuple[str, str, float]] = []
    threads = [_run(gate, "first", 0.2, log)]
    time.sleep(0.05)  # the first is inside
    for i in range(5):
        threads.append(_run(gate, f"w{i}", 0.01, log))
        _queued(gate, i + 1)
    for t in threads:
        t.join(10)
    events = [(name, what) for name, what, _ in log]
    # Never two inside: every "in" is followed by its own "out".
    assert events == [(n, w) for n in ["first", "w0", "w1", "w2", "w3", "w4"] for w in ("in", "out")]


def test_invariant_35_a_run_past_patience_lets_the_next_in_beside_it() -> None:
    gate = ClaimGate(patience=0.1)
    log: list[tuple[str, str, float]] = []
    slow = _run(gate, "slow", 1.0, log)  # a database that does not answer
    time.sleep(0.02)
    quick = [_run(gate, "q0", 0.01, log)]
    _queued(gate, 1)
    for i in range(1, 4):
        quick.append(_run(gate, f"q{i}", 0.01, log))
        _queued(gate, i + 1)
    for t in quick:
        t.join(5)
    at = {(n, w): t for n, w, t in log}
    slow_in = at[("slow", "in")]
    # The quick runs went in one after another beside the slow one, long before it ended,
    # the first once the slow one was past its patience; one at a time among themselves.
    assert ("slow", "out") not in at
    assert 0.08 <= at[("q0", "in")] - slow_in <= 0.5
    for i in range(1, 4):
        assert at[(f"q{i}", "in")] >= at[(f"q{i - 1}", "out")]
    assert at[("q3", "out")] - slow_in < 0.8
    slow.join(5)


def test_invariant_35_each_idle_sweep_keeps_a_moment_of_its_own_in_the_period() -> None:
    period = 30.0
    for now in (100.0, 1234.5):
        waits = [until_slot(now, period, phase) for phase in (0.0, 7.5, 15.0, 22.5)]
        assert len(set(waits)) == 4  # four databases, four moments
        for phase, wait in zip((0.0, 7.5, 15.0, 22.5), waits, strict=True):
            assert period / 2 <= wait < 1.5 * period
            assert (now + wait - phase) % period == pytest.approx(0.0, abs=1e-9)
    # Swept at its moment, the next sweep is a whole period later.
    assert until_slot(7.5 + 0.02, period, 7.5) == pytest.approx(period - 0.02)
