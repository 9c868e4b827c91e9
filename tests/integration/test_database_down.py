"""A database of several that stops taking connections after its rows were claimed (DESIGN
invariant 34): its tasks fail at once instead of each holding a worker process for
``connection_wait``, no handler runs, no attempt is spent, and once it answers again the same
tasks deliver.

The database is made unreachable as an operator would: ``ALTER DATABASE ... ALLOW_CONNECTIONS
false`` and ``pg_terminate_backend`` of its sessions.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from outbox_celery.db.pool import DatabaseUnavailable

from .test_databases import Recorded, _enqueue, _outbox_sessions, _statuses
from .test_databases import three as three

LEASE = 6.0  # connection_wait: a quarter of it, 1.5 s


@contextmanager
def _unreachable(server_dsn: str, dsn: str) -> Iterator[None]:
    name = conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false").format(sql.Identifier(name)))
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        try:
            yield
        finally:
            admin.execute(
                sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS true").format(sql.Identifier(name))
            )


def _timed_failure(deliver: object) -> tuple[float, BaseException]:
    started = time.monotonic()
    with pytest.raises(psycopg.OperationalError) as raised:
        deliver()  # type: ignore[operator]
    return time.monotonic() - started, raised.value


def test_invariant_34_tasks_of_a_database_that_went_away_fail_at_once_and_deliver_when_it_returns(
    three: dict[str, str], server_dsn: str
) -> None:
    _enqueue(three["b"], 4)
    _enqueue(three["a"], 1)
    r = Recorded(three, lease=LEASE)
    assert r.outbox.claim().claimed == 5
    tasks = [c for d, c in r.tasks if d == "b"]
    assert len(tasks) == 4
    # b's pool has connections that the server is about to end.
    assert r.outbox.database("b").pool is not None
    with _unreachable(server_dsn, three["b"]):
        first, exc = _timed_failure(lambda: r.outbox.deliver(tasks[0].id, tasks[0].lease_version, "b"))
        # The first finds out: its fenced start fails on a connection the server ended, and
        # before the retry one connection of its own is refused at once, without the pool's
        # wait for a reconnection (LANE_CONNECTION_WAIT, 2 s) and with no wait for recording
        # the failure.
        assert first < 0.5, f"the first task held its process {first:.1f}s"
        assert isinstance(exc, DatabaseUnavailable), exc
        # The others know: they fail at once.
        for c in tasks[1:3]:
            took, exc = _timed_failure(lambda c=c: r.outbox.deliver(c.id, c.lease_version, "b"))
            assert isinstance(exc, DatabaseUnavailable), exc
            assert took < 0.2, f"a task of the unreachable database held its process {took:.2f}s"
            assert "b" in str(exc) and "gave no connection" in str(exc)
        # The other database is untouched.
        [a_task] = [c for d, c in r.tasks if d == "a"]
        assert r.outbox.deliver(a_task.id, a_task.lease_version, "a") == "done"
    assert [m.database for m in r.calls] == ["a"]  # no handler of b ran
    # Back: after its pause (at most connection_wait) one direct attempt finds it, and every
    # task delivers on its lease, which nothing spent.
    deadline = time.monotonic() + 10
    outcomes: list[str] = []
    for c in tasks:
        while True:
            try:
                outcomes.append(r.outbox.deliver(c.id, c.lease_version, "b"))
                break
            except DatabaseUnavailable:
                assert time.monotonic() < deadline, "b was not asked again within 10 s"
                time.sleep(0.1)
    assert outcomes == ["done"] * 4
    r.outbox.close()
    assert _statuses(three["b"]) == {"done": 4}
    with psycopg.connect(three["b"], autocommit=True) as conn:
        attempts = conn.execute("SELECT array_agg(attempts ORDER BY id) FROM outbox").fetchone()
    assert attempts is not None and attempts[0] == [1, 1, 1, 1]


def test_invariant_34_a_sweep_that_finds_nothing_leaves_no_connection_open(three: dict[str, str]) -> None:
    # database_idle_close longer than idle_sweep (the defaults' order): an idle database's
    # sweeps would otherwise keep its pool open for good.
    _enqueue(three["a"], 1)
    r = Recorded(three, idle_sweep=1.0, database_idle_close=60.0)
    lanes = r.outbox.lanes
    assert lanes is not None
    assert r.outbox.claim().claimed == 1
    lanes._idle_checked = 0.0  # the next look is not held back by the last second's
    lanes.close_idle()
    # a claimed: its pool stays for its deliveries, with the one connection its claim run took
    # (invariant 16: the claim lock lives in the claim transaction); b and c were swept, found
    # nothing, and counted as no use: their pools go at the next look, and they hold no session.
    assert [_outbox_sessions(three[d]) for d in "abc"] == [1, 0, 0]
    assert [lane.name for lane in lanes.lanes() if lane.is_open] == ["a"]
    r.outbox.close()


def test_invariant_34_a_database_that_refused_connections_is_asked_again_within_a_second(
    three: dict[str, str], server_dsn: str
) -> None:
    # A lease of 60 s: connection_wait is 15 s. Failures in a row would double the pause up to
    # it, and a task claimed as the database returns, failing in that pause, would wait its
    # lease. A server that refuses at once is asked again at least every second.
    _enqueue(three["b"], 1)
    r = Recorded(three, lease=60.0)
    assert r.outbox.claim().claimed == 1
    [(_, c)] = r.tasks
    with _unreachable(server_dsn, three["b"]):
        deadline = time.monotonic() + 6.0
        while time.monotonic() < deadline:
            with pytest.raises(DatabaseUnavailable):
                r.outbox.deliver(c.id, c.lease_version, "b")
            time.sleep(0.05)
        lane = r.outbox.database("b")
        assert lane._down >= 5, lane._down  # asked again and refused, time after time
    returned = time.monotonic()
    while True:
        try:
            assert r.outbox.deliver(c.id, c.lease_version, "b") == "done"
            break
        except DatabaseUnavailable:
            assert time.monotonic() - returned < 1.2, "b was not asked again within a second"
            time.sleep(0.05)
    r.outbox.close()
    assert _statuses(three["b"]) == {"done": 1}
