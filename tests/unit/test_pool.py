"""The per-process pool and its idle check, with stand-in pools and a stand-in clock.

:class:`ForkSafePool` opens one pool per process, lazily and once however many threads ask, and
never touches a pool inherited across ``fork()``. :class:`IdleCheck` checks only connections
that sat idle long enough.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest

from outbox_celery.db import pool as _pool
from outbox_celery.db.pool import ForkSafePool, IdleCheck


class FakePool:
    def __init__(self, n: int) -> None:
        self.n = n
        self.closed = False

    def close(self, timeout: float = 5.0) -> None:
        self.closed = True


class Opener:
    def __init__(self) -> None:
        self.pools: list[FakePool] = []
        self._lock = threading.Lock()

    def __call__(self) -> Any:
        with self._lock:
            pool = FakePool(len(self.pools))
            self.pools.append(pool)
        return pool


@pytest.fixture
def pid(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The process id ``_pool`` sees; a test changes it to play the forked child."""
    current = [1000]
    monkeypatch.setattr(_pool.os, "getpid", lambda: current[0])
    monkeypatch.setattr(_pool, "_ORPHANED_POOLS", [])
    return current


def test_the_pool_is_opened_on_first_use_and_once(pid: list[int]) -> None:
    opener = Opener()
    pool = ForkSafePool(opener)
    assert opener.pools == []
    first = pool.get()
    assert pool.get() is first
    assert opener.pools == [first]


def test_threads_racing_for_the_first_use_open_one_pool(pid: list[int]) -> None:
    opener = Opener()
    pool = ForkSafePool(opener)
    start = threading.Barrier(8)
    got: list[Any] = []

    def use() -> None:
        start.wait()
        got.append(pool.get())

    threads = [threading.Thread(target=use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(opener.pools) == 1
    assert all(p is opener.pools[0] for p in got)


def test_a_forked_child_opens_its_own_and_leaves_the_parents_untouched(pid: list[int]) -> None:
    opener = Opener()
    pool = ForkSafePool(opener)
    parents = pool.get()
    pid[0] = 1001  # the child
    childs = pool.get()
    assert childs is not parents
    assert not parents.closed  # its sockets are the parent's
    assert [parents] == _pool._ORPHANED_POOLS  # kept from the garbage collector's finalizer
    pool.close()
    assert childs.closed and not parents.closed


def test_after_fork_sets_the_parents_pool_aside_and_the_next_use_opens_one(pid: list[int]) -> None:
    opener = Opener()
    pool = ForkSafePool(opener)
    parents = pool.get()
    pool.after_fork()  # in the parent itself: nothing to set aside
    assert pool.get() is parents
    pid[0] = 1001
    pool.after_fork()
    assert [parents] == _pool._ORPHANED_POOLS
    assert len(opener.pools) == 1  # lazily: nothing opened until used
    assert pool.get() is not parents
    assert not parents.closed


def test_close_closes_only_a_pool_this_process_opened(pid: list[int]) -> None:
    opener = Opener()
    pool = ForkSafePool(opener)
    pool.close()  # nothing opened: nothing to do
    parents = pool.get()
    pid[0] = 1001
    pool.close()
    assert not parents.closed
    pid[0] = 1000
    again = pool.get()
    assert again is not parents  # a closed ForkSafePool opens a fresh pool when used again
    pool.close()
    pool.close()  # idempotent
    assert again.closed


class Conn:
    """A pooled connection stand-in (weak-referenceable, hashable by identity)."""


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]

    class Time:
        @staticmethod
        def monotonic() -> float:
            return now[0]

    monkeypatch.setattr(_pool, "time", Time)
    return now


@pytest.fixture
def checked(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen: list[Any] = []
    monkeypatch.setattr(_pool.ConnectionPool, "check_connection", staticmethod(seen.append))
    return seen


def test_idle_check_checks_a_connection_it_has_not_seen_returned(
    clock: list[float], checked: list[Any]
) -> None:
    check = IdleCheck(after=2.0)
    conn = Conn()
    check(conn)
    assert checked == [conn]


def test_idle_check_skips_a_recently_returned_connection_and_checks_an_idle_one(
    clock: list[float], checked: list[Any]
) -> None:
    check = IdleCheck(after=2.0)
    conn = Conn()
    check.returned(conn)
    clock[0] += 1.999
    check(conn)
    assert checked == []  # used a moment ago: no round trip
    clock[0] += 0.001
    check(conn)
    assert checked == [conn]  # idle `after` seconds: checked before use
    check.returned(conn)
    clock[0] += 0.5
    check(conn)
    assert checked == [conn]  # each return restarts the idle time


def test_idle_check_forgets_connections_that_are_gone(clock: list[float], checked: list[Any]) -> None:
    check = IdleCheck(after=2.0)
    conn = Conn()
    check.returned(conn)
    assert len(check._returned) == 1
    del conn
    gc.collect()
    assert len(check._returned) == 0
