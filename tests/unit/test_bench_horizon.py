"""The horizon benchmark's arithmetic (benchmarks/horizon.py): windows and the goals' verdicts.

The benchmark itself runs real processes for minutes (``make bench BENCH_ARGS="--only
horizon"``); these tests feed its window cutting and its judge hand-made latencies, so a goal
that cannot be missed (or met) would show here.
"""

from __future__ import annotations

import pytest

from benchmarks.horizon import Sample, Scenario, summarize, windows

T0 = 1_000.0


def _scenario(rate: float = 10.0) -> Scenario:
    return Scenario("pin 20 s", rate=rate, duration=40.0, pin_at=10.0, pin_for=20.0, window=10.0)


def _run(latency: dict[int, float], rate: float = 10.0) -> tuple[list[float], list[float]]:
    """One commit every 1/rate s for 40 s; latency by window index (default 10 ms)."""
    commits = [T0 + k / rate for k in range(int(40 * rate))]
    totals = [latency.get(int((c - T0) // 10), 0.010) for c in commits]
    return commits, totals


def _samples(unfinished: int = 3) -> list[Sample]:
    return [Sample(float(t), unfinished, 100 * t, 0, 10 <= t < 30, 0, 1.0) for t in range(40)]


def test_windows_cut_by_commit_time_and_mark_the_pin() -> None:
    commits, totals = _run({1: 0.5})
    wins = windows(commits, totals, T0, _samples(), width=10.0, pin=(10.0, 30.0))
    assert [w["t"] for w in wins] == [0.0, 10.0, 20.0, 30.0]
    assert [w["pinned"] for w in wins] == [False, True, True, False]
    assert [w["pin_held"] for w in wins] == [False, True, True, False]
    assert all(w["committed"] == 100 for w in wins)
    assert wins[1]["p50"] == pytest.approx(0.5)
    # Window 1's messages start 0.5 s late: five of them start in window 2.
    assert wins[1]["started"] == 95 and wins[2]["started"] == 105
    assert wins[3]["dead"] == 3900 and wins[0]["unfinished_max"] == 3


def test_a_run_that_stays_flat_meets_both_goals() -> None:
    commits, totals = _run({})
    sc = _scenario()
    wins = windows(commits, totals, T0, _samples(), width=10.0, pin=(10.0, 30.0))
    m = summarize(wins, commits, totals, T0, sc)
    assert m["p99_goal_met"] and m["unfinished_goal_met"]
    assert m["ratio"] == pytest.approx(1.0)


def test_a_slow_pinned_window_misses_the_p99_goal() -> None:
    # 200 ms is under 250 ms but above 3x the 10 ms before the pin.
    commits, totals = _run({2: 0.200})
    sc = _scenario()
    m = summarize(
        windows(commits, totals, T0, _samples(), width=10.0, pin=(10.0, 30.0)), commits, totals, T0, sc
    )
    assert not m["p99_goal_met"]
    assert m["p99_worst_pinned"] == pytest.approx(0.200)
    assert m["recovered_s"] == 0.0


def test_more_unfinished_rows_than_a_second_of_production_misses() -> None:
    commits, totals = _run({})
    sc = _scenario(rate=10.0)
    wins = windows(commits, totals, T0, _samples(unfinished=11), width=10.0, pin=(10.0, 30.0))
    m = summarize(wins, commits, totals, T0, sc)
    assert not m["unfinished_goal_met"] and m["unfinished_max"] == 11
