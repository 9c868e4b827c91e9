"""The push listener's timing and threading, with a scripted session and no database.

The listener claims once on every (re)connect, again on a notification or when the database
says a row comes due, retries a run another claim held off with a doubling wait, and reconnects
with a capped backoff whose log line never shows the DSN's password. Here the claim, the store
and the connection are stand-ins, so each of those decisions shows in milliseconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from outbox_celery.claim import listener as listener_module
from outbox_celery.claim.claimer import ClaimRun
from outbox_celery.claim.listener import _BUSY_RETRY, _MIN_WAIT, Listener
from outbox_celery.db.store import SLOT_FREED

SETTLE = 10.0
HOUR = 3600.0


@dataclass(frozen=True)
class Notification:
    payload: str


class Inbox(queue.Queue[str]):
    """The payloads of a session, each also a byte on a pipe: the session's socket."""

    def __init__(self) -> None:
        super().__init__()
        self.pipe = os.pipe()
        os.set_blocking(self.pipe[0], False)

    def put(self, item: str, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        os.write(self.pipe[1], b"n")

    def put_burst(self, items: list[str]) -> None:
        """Several payloads that reach the socket together: all wait before it is readable."""
        for item in items:
            super().put(item)
        os.write(self.pipe[1], b"n" * len(items))

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.pipe[0], 4096):
                pass


class FakeConn:
    """A LISTEN session: ``notifies`` yields the payloads the test puts in ``inbox``; its
    ``fileno`` is readable while a payload waits, as a socket is."""

    def __init__(self) -> None:
        self.inbox = Inbox()

    def fileno(self) -> int:
        return self.inbox.pipe[0]

    def notifies(self, *, timeout: float, stop_after: int | None = None) -> Iterator[Notification]:
        self.inbox.drain()
        got = 0
        deadline = time.monotonic() + timeout
        while stop_after is None or got < stop_after:
            try:
                yield Notification(self.inbox.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                return
            got += 1

    def __enter__(self) -> FakeConn:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class FakeStore:
    """``listen``, ``next_due`` and ``claim_probe``: the due time the test sets, None (nothing
    due) by default, and whether a claim would find work (no, by default)."""

    def __init__(self) -> None:
        self.due: float | None = None
        self.asked: list[float] = []
        self.work = False
        self.probed: list[float] = []

    def listen(self, conn: Any) -> str:
        return "outbox_celery_1"

    def next_due(self, conn: Any, event_types: Any, *, within: float) -> float | None:
        self.asked.append(within)
        return self.due

    def claim_probe(self, conn: Any, event_types: Any, *, within: float) -> tuple[bool, float | None]:
        """An idle sweep's question: ``work`` says whether a claim would find something."""
        self.probed.append(within)
        return self.work, self.due


class Claims:
    """A claim that returns the runs the test scripts (then plain ones) and counts calls."""

    def __init__(self, *stopped_by: str | None) -> None:
        self.script = list(stopped_by)
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self) -> ClaimRun | None:
        with self._lock:
            self.calls += 1
            stopped = self.script.pop(0) if self.script else None
        return ClaimRun(stopped_by=stopped) if stopped else None

    def wait(self, n: int) -> None:
        deadline = time.monotonic() + SETTLE
        while self.calls < n:
            assert time.monotonic() < deadline, f"{n} claim run(s) expected, got {self.calls}"
            time.sleep(0.002)


def _listener(claim: Claims, store: FakeStore | None = None, *, poll: float = HOUR, **kw: Any) -> Listener:
    return Listener(
        dsn="postgresql://app:s3cret@db.example/app",
        store=store or FakeStore(),  # type: ignore[arg-type]
        claim=claim,
        event_types=lambda: ["thing.happened"],
        poll=poll,
        **kw,
    )


@pytest.fixture
def session(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeConn]:
    conn = FakeConn()
    monkeypatch.setattr(listener_module.psycopg, "connect", lambda *a, **kw: conn)
    yield conn


def test_it_claims_on_connect_then_on_each_notification_and_nothing_in_between(session: FakeConn) -> None:
    claim = Claims()
    listener = _listener(claim)
    listener.start()
    try:
        assert listener.connected.wait(SETTLE)
        claim.wait(1)  # whatever was committed while nobody listened
        time.sleep(0.3)
        assert claim.calls == 1  # no notification, nothing due, an hour's poll: it sleeps
        session.inbox.put_burst(["commit"] * 3)  # a burst arrives together: one claim answers it
        claim.wait(2)
        deadline = time.monotonic() + SETTLE
        while listener.get_stats()["notifications"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        time.sleep(0.2)
        assert claim.calls == 2
        assert listener.get_stats() == {
            "notifications": 3,
            "claims": 2,
            "probes": 0,
            "connects": 1,
            "errors": 0,
        }
    finally:
        listener.stop(timeout=SETTLE)
    assert not listener.running
    assert not listener.connected.is_set()


def test_a_row_the_database_says_comes_due_wakes_it_without_a_notification(session: FakeConn) -> None:
    claim = Claims()
    store = FakeStore()
    store.due = 0.2
    listener = _listener(claim, store)
    started = time.monotonic()
    listener.start()
    try:
        claim.wait(3)
        # Each run asked for the next due time within the poll period, and slept until then.
        assert time.monotonic() - started >= 0.4
        assert set(store.asked) == {HOUR}
        assert listener.get_stats()["notifications"] == 0
    finally:
        listener.stop(timeout=SETTLE)


def test_the_next_wait_is_the_due_time_bounded_by_the_poll_and_a_minimum() -> None:
    store = FakeStore()
    listener = _listener(Claims(), store, poll=5.0)
    conn = FakeConn()
    assert listener._claim_until_quiet(conn) == 5.0  # type: ignore[arg-type]
    store.due = 1.5
    assert listener._claim_until_quiet(conn) == 1.5  # type: ignore[arg-type]
    store.due = 0.0  # due now: never a busy loop against the claim's own now()
    assert listener._claim_until_quiet(conn) == _MIN_WAIT  # type: ignore[arg-type]
    store.due = 60.0
    assert listener._claim_until_quiet(conn) == 5.0  # type: ignore[arg-type]
    assert store.asked == [5.0] * 4


def test_a_held_off_run_is_retried_with_a_doubling_wait_up_to_its_cap() -> None:
    held = ["another_claim_running"] * 8
    claim = Claims(*held)
    listener = _listener(claim)
    waits: list[float] = []
    listener._hold_off = lambda conn, seconds: waits.append(seconds)  # type: ignore[method-assign]
    listener._claim_until_quiet(FakeConn())  # type: ignore[arg-type]
    assert claim.calls == 9  # held off eight times, then a run that was not
    first, cap = _BUSY_RETRY
    expected = [min(first * 2**i, cap) for i in range(8)]
    assert waits == pytest.approx(expected)
    assert waits[-1] == cap and waits[0] == first


def test_a_run_that_ran_out_of_budget_is_followed_by_another_at_once() -> None:
    claim = Claims("budget", "budget", None)
    listener = _listener(claim)
    listener._hold_off = lambda conn, seconds: pytest.fail("a backlog is not held off")  # type: ignore[method-assign]
    listener._claim_until_quiet(FakeConn())  # type: ignore[arg-type]
    assert claim.calls == 3


def test_holding_off_drains_the_notifications_that_arrive_and_counts_them() -> None:
    listener = _listener(Claims())
    conn = FakeConn()
    for _ in range(4):
        conn.inbox.put("commit")
    started = time.monotonic()
    listener._hold_off(conn, 0.15)  # type: ignore[arg-type]
    assert time.monotonic() - started >= 0.15  # notifications do not cut the wait short
    assert conn.inbox.empty()
    assert listener.get_stats()["notifications"] == 4


def test_reconnects_back_off_doubling_up_to_the_cap_and_hide_the_password(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    listener = _listener(Claims(), max_backoff=1.0)
    monkeypatch.setattr(listener_module.random, "uniform", lambda a, b: 1.0)
    failures = 7

    def refused() -> None:
        raise OSError("connection to postgresql://app:s3cret@db.example/app refused")

    waits: list[float] = []

    class Stop(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            waits.append(float(timeout or 0.0))
            if len(waits) == failures:
                self.set()
            return self.is_set()

    listener._session = refused  # type: ignore[method-assign]
    listener._stop = Stop()
    with caplog.at_level(logging.WARNING, logger="outbox_celery.claim.listener"):
        listener._run()  # in this thread: it returns once stopped
    assert waits == pytest.approx([0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0])
    assert listener.get_stats()["errors"] == failures
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == failures
    assert all("reconnecting in" in m and "OSError" in m for m in messages)
    assert not any("s3cret" in m for m in messages), messages


def test_a_failure_after_a_connect_resets_the_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    listener = _listener(Claims())
    monkeypatch.setattr(listener_module.random, "uniform", lambda a, b: 1.0)
    outcomes = iter([OSError("down"), OSError("down"), None, OSError("down")])

    def session() -> None:
        exc = next(outcomes)
        if exc is not None:
            raise exc

    waits: list[float] = []

    class Stop(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            waits.append(float(timeout or 0.0))
            if len(waits) == 3:
                self.set()
            return self.is_set()

    listener._session = session  # type: ignore[method-assign]
    listener._stop = Stop()
    listener._run()
    assert waits == pytest.approx([0.2, 0.4, 0.2])


def test_a_freed_slot_wakes_it_only_while_a_limit_holds_a_type_back(session: FakeConn) -> None:
    # A finished concurrency-limited delivery notifies SLOT_FREED. Claimed while a type
    # was at its limit (the run's flow_wait), it claims at once; held back by nothing, the
    # notification is drained and nothing runs (a limit that does not bind starts no claims).
    runs = [ClaimRun(), ClaimRun(flow_wait=HOUR), ClaimRun()]
    calls: list[ClaimRun] = []

    def claim() -> ClaimRun:
        run = runs.pop(0) if runs else ClaimRun()
        calls.append(run)
        return run

    listener = _listener(claim)  # type: ignore[arg-type]
    listener.start()
    try:
        assert listener.connected.wait(SETTLE)
        deadline = time.monotonic() + SETTLE
        while not calls:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        session.inbox.put(SLOT_FREED)  # nothing held: ignored
        time.sleep(0.3)
        assert len(calls) == 1 and listener.get_stats()["notifications"] == 1
        session.inbox.put("")  # a producer's commit: claims; that run holds a type back
        while len(calls) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        session.inbox.put(SLOT_FREED)  # now it claims at once
        while len(calls) < 3:
            assert time.monotonic() < deadline, "a freed slot did not wake a held listener"
            time.sleep(0.002)
    finally:
        listener.stop()


def _probes(listener: Listener, n: int) -> None:
    deadline = time.monotonic() + SETTLE
    while listener.get_stats()["probes"] < n:
        assert time.monotonic() < deadline, f"{n} probe(s) expected, got {listener.get_stats()}"
        time.sleep(0.002)


def test_invariant_36_an_idle_sweep_asks_one_question_and_claims_only_when_it_finds_work(
    session: FakeConn,
) -> None:
    # idle_poll 0.2 s, idle: it asks on connect, then each sweep falls 0.1-0.3 s after the last. A sweep
    # that finds nothing claims nothing; one that finds work claims once, and a notification
    # claims at once without asking.
    claim = Claims()
    store = FakeStore()
    listener = _listener(claim, store, poll=0.05, idle_poll=0.2)
    listener._active_at -= 1.0  # no claim did anything for longer than a sweep
    listener.start()
    try:
        _probes(listener, 4)  # the first on connect: whatever was committed meanwhile is due
        assert claim.calls == 0
        store.work = True
        claim.wait(1)
        store.work = False
        _probes(listener, listener.get_stats()["probes"] + 2)
        assert claim.calls == 1
        assert all(0.09 <= w <= 0.31 for w in store.probed), store.probed
        store.work = True  # a lease ran out, or a row came due that no notification announced
        claim.wait(2)
        store.work = False
        session.inbox.put("commit")
        claim.wait(3)
    finally:
        listener.stop(timeout=SETTLE)


def test_invariant_36_a_sweep_that_finds_something_coming_due_claims_then_without_asking() -> None:
    store = FakeStore()
    claim = Claims()
    listener = _listener(claim, store, poll=0.05, idle_poll=0.2)
    listener._active_at -= 1.0  # idle for longer than a sweep
    conn = FakeConn()
    wait = listener._claim_until_quiet(conn)  # type: ignore[arg-type]
    assert listener._sweeping and 0.09 <= wait <= 0.31
    store.due = 0.03  # the probe finds a delayed row due in 30 ms
    assert listener._sweep(conn) == pytest.approx(0.03)  # type: ignore[arg-type]
    assert not listener._sweeping and claim.calls == 1  # that wake claims, it does not ask
    store.due = None
    store.work = True
    listener._sweeping = True
    listener._sweep(conn)  # type: ignore[arg-type]
    assert claim.calls == 2 and listener.get_stats()["probes"] == 2
    # A listener that was busy lately wakes every poll, and asks then too; one without idle_poll
    # (one database) claims every poll without asking.
    busy = _listener(Claims(), FakeStore(), poll=0.05, idle_poll=0.2)
    assert busy._claim_until_quiet(conn) == 0.05 and busy._sweeping  # type: ignore[arg-type]
    plain = _listener(Claims(), FakeStore(), poll=0.05)
    assert plain._claim_until_quiet(conn) == 0.05 and not plain._sweeping  # type: ignore[arg-type]


def test_invariant_36_a_listener_busy_lately_asks_at_every_poll_and_claims_what_comes_due(
    session: FakeConn,
) -> None:
    # Started (or reconnected) with a claim that did something less than idle_poll ago: it asks
    # at every poll (an ordered follower whose head just finished is announced by nothing), and
    # claims only when the answer is yes.
    claim = Claims()
    store = FakeStore()
    listener = _listener(claim, store, poll=0.02, idle_poll=HOUR)
    listener.start()
    try:
        _probes(listener, 5)
        assert claim.calls == 0
        assert set(store.probed) == {0.02}
        store.work = True  # the follower is its key's head now
        claim.wait(1)
    finally:
        listener.stop(timeout=SETTLE)


@pytest.mark.parametrize(
    ("dsn", "kw", "expected"),
    [
        ("postgresql://db.example/app", {"connect_timeout": 3}, 3),
        ("postgresql://db.example/app?connect_timeout=7", {"connect_timeout": 3}, None),
        ("postgresql://db.example/app", {"connect_timeout": 3, "exit_after": 30.0}, 10),
        ("postgresql://db.example/app", {}, None),
    ],
)
def test_a_session_to_a_host_that_does_not_answer_gives_up_within_its_connect_timeout(
    monkeypatch: pytest.MonkeyPatch, dsn: str, kw: dict[str, Any], expected: int | None
) -> None:
    # A lane's listener (several databases) passes connection_wait's timeout: a host that does
    # not answer holds it that long, not the kernel's SYN retries; the DSN's own wins.
    seen: list[dict[str, Any]] = []

    def connect(*a: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        raise OSError("no route")

    monkeypatch.setattr(listener_module.psycopg, "connect", connect)
    listener = Listener(
        dsn=dsn,
        store=FakeStore(),
        claim=Claims(),
        event_types=lambda: [],
        **kw,  # type: ignore[arg-type]
    )
    with pytest.raises(OSError):
        listener._session()
    assert seen[0].get("connect_timeout") == expected
