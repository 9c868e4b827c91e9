"""Push: LISTEN for the producers' notifications and claim at once.

A :class:`Listener` is a daemon thread with its own session connection. It waits on the
table's channel (``outbox_celery_<table oid>``, signalled by :func:`~outbox_celery.enqueue` at
commit) and runs a claim as soon as a notification arrives. Notifications that arrive while a
claim runs are drained in one go and lead to one more run, so a burst of commits costs a handful
of claims. When nothing arrives it still wakes: at the next delayed row or lease end the
database reports (``Store.next_due``), and at most every ``listen_poll`` seconds, so rows that no
notification announces (ordered followers, rows left by the in-flight bound) wait no longer.

It never replaces beat: a listener that cannot connect retries with backoff and logs, while the
beat-triggered claim keeps delivering every ``claim_interval``. After every (re)connect it claims
once, for whatever was committed while it was not listening.

The :class:`~outbox_celery.app.outbox.Outbox` starts one per worker that consumes the claim
queue, in the worker's main process after the pool has forked (a Celery bootstep).
"""

from __future__ import annotations

import logging
import math
import os
import random
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..db.store import SLOT_FREED, Store
from ..dsn import error_line
from .claimer import ClaimRun, StoppedBy
from .gate import until_slot

__all__ = ["Listener"]

logger = logging.getLogger(__name__)

# After a claim run that another claim held off, try again soon: that run may have selected its
# rows before our notifying transaction committed (the claim lock serializes runs, DESIGN 1).
_BUSY_RETRY = (0.005, 0.2)
# Shortest wait before a due row is claimed: the clocks compared are both the database's, but a
# row due "now" may still lose its race with the claim's own now().
_MIN_WAIT = 0.002
# The thread checks for stop() at least this often while it holds off (between notifications
# it waits on its wake pipe instead).
_STOP_CHECK = 0.5


class Listener:
    """Turns notifications on one outbox table's channel into claim runs.

    :param dsn: a session connection (not a transaction-mode pooler: LISTEN needs a session).
    :param store: the table's :class:`~outbox_celery.db.store.Store` (channel and next due time).
    :param claim: runs one claim (in this thread) and returns what it did.
    :param event_types: the event types claimed here (for the next due time).
    :param poll: seconds between claim runs at most when nothing wakes the listener.
    :param max_backoff: longest wait between reconnection attempts, in seconds.
    :param name: for logs and the thread's name.
    :param exit_after: seconds the listener may go without a working session with its database
        (connect refused or failing, every session ending in an error) before it gives up:
        it logs an error, calls ``on_unreachable`` and stops. ``None`` retries forever.
    :param on_unreachable: what giving up does (the Celery step stops the worker, exit code 1).
    :param prepare_threshold: psycopg's ``prepare_threshold`` for its connection, as for the
        pool's (``None`` behind a transaction-mode pooler: its statements run many times).
    :param connect_timeout: libpq's ``connect_timeout`` for its session when neither the DSN
        nor ``exit_after`` sets one (``None``: libpq's, unbounded).
    :param idle_poll: seconds it waits at most when nothing wakes it, once its claim runs have
        found nothing to do (nothing claimed, reaped or released, nothing held by a limit) for
        that long; ``None``: always ``poll``. A message that waits for no notification (an
        ordered follower whose head just finished) is claimed within ``poll`` while the
        database was busy lately. An Outbox of several databases sets ``idle_sweep`` here, so an idle
        database costs its LISTEN and one sweep per ``idle_sweep``, at a moment of its own in the
        sweep (DESIGN invariants 34, 35). With ``idle_poll`` set, every wake at the poll period or
        the sweep (not a notification, nor a row the database said comes due) is one statement on
        this session (:meth:`~outbox_celery.db.store.Store.claim_probe`), and a claim run only
        when it finds something to do (DESIGN invariant 36).
    """

    def __init__(
        self,
        *,
        dsn: str,
        store: Store,
        claim: Callable[[], ClaimRun | None],
        event_types: Callable[[], Sequence[str]],
        poll: float = 1.0,
        max_backoff: float = 10.0,
        name: str = "outbox",
        exit_after: float | None = None,
        on_unreachable: Callable[[], None] | None = None,
        prepare_threshold: int | None = 5,
        idle_poll: float | None = None,
        connect_timeout: int | None = None,
    ) -> None:
        self.dsn = dsn
        self.connect_timeout = connect_timeout
        self.idle_poll = idle_poll
        # Where in each idle_poll this listener's idle claims fall (monotonic clock), chosen at
        # random: idle databases' listeners started together do not all claim at once.
        self._phase = random.uniform(0.0, idle_poll or 0.0)
        # When a claim run last did something (monotonic).
        self._active_at = time.monotonic()
        self.prepare_threshold = prepare_threshold
        self.store = store
        self.claim = claim
        self.event_types = event_types
        self.poll = poll
        self.max_backoff = max_backoff
        self.name = name
        self.exit_after = exit_after
        self.on_unreachable = on_unreachable
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats: dict[str, int] = {
            "notifications": 0,
            "claims": 0,
            "probes": 0,
            "connects": 0,
            "errors": 0,
        }
        self._stats_lock = threading.Lock()
        self.connected = threading.Event()
        # Whether the last claim run left a type held back by a limit: freed slots then matter.
        self._held = False
        # A pipe stop() writes to: the thread waits on it beside its connection (read end,
        # write end), so a waiting listener wakes for a notification, a due row or stop() only.
        self._wake: tuple[int, int] | None = None
        # Whether the current wait ends at the poll period or the idle sweep's moment (nothing
        # comes due before it) of a listener with idle_poll: it then asks one question before it
        # claims (DESIGN invariant 36).
        self._sweeping = False

    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats[key] += n

    def get_stats(self) -> dict[str, int]:
        """Counters: notifications received, claim runs, idle sweeps' probes, connects, errors."""
        with self._stats_lock:
            return dict(self._stats)

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread (returns at once; connecting happens in the thread)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        if self._wake is None:
            self._wake = os.pipe()
        self._thread = threading.Thread(target=self._run, name=f"outbox-listener-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the thread to stop and wait for it (a claim run in progress finishes first)."""
        self._stop.set()
        wake = self._wake
        if wake is not None:
            os.write(wake[1], b"x")
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("outbox listener %s did not stop within %.1fs", self.name, timeout)
                return  # it may still wait on the pipe: left open
        if wake is not None and (thread is None or not thread.is_alive()):
            self._wake = None
            os.close(wake[0])
            os.close(wake[1])

    @property
    def running(self) -> bool:
        """Whether the thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        # When the database stopped answering (monotonic): the first failure after a session.
        down_since: float | None = None
        while not self._stop.is_set():
            try:
                self._session()
                failures = 0
            except Exception as exc:
                # Beat-driven claims keep delivering meanwhile; this only costs latency.
                now = time.monotonic()
                if self.connected.is_set() or down_since is None:
                    down_since = now
                self.connected.clear()
                self._count("errors")
                failures += 1
                if self.exit_after is not None and now - down_since >= self.exit_after:
                    self._give_up(exc, now - down_since)
                    return
                delay = min(self.max_backoff, 0.1 * 2 ** min(failures, 10)) * random.uniform(0.5, 1.0)
                if self.exit_after is not None:  # the next attempt comes at the bound at the latest
                    delay = max(0.0, min(delay, down_since + self.exit_after - now))
                logger.warning(
                    "outbox listener %s: %s: %s; reconnecting in %.1fs",
                    self.name,
                    type(exc).__name__,
                    error_line(exc, self.dsn),
                    delay,
                    extra={"outcome": "listener_error"},
                )
                self._stop.wait(delay)
        self.connected.clear()

    def _give_up(self, exc: BaseException, down_for: float) -> None:
        """The database stayed unreachable past ``exit_after``: say so and stop the worker."""
        logger.error(
            "outbox listener %s: no working database session for %.1fs (unreachable_exit_after "
            "%.1fs), last error %s: %s; stopping the worker so that its supervisor sees it",
            self.name,
            down_for,
            self.exit_after,
            type(exc).__name__,
            error_line(exc, self.dsn),
            extra={"outcome": "listener_unreachable"},
        )
        self.connected.clear()
        if self.on_unreachable is not None:
            self.on_unreachable()

    def _session(self) -> None:
        extra: dict[str, Any] = {}
        if "connect_timeout" not in conninfo_to_dict(self.dsn):
            # A host that does not answer must fail within the bound, not after the kernel's
            # SYN retries (minutes).
            if self.exit_after is not None:
                extra["connect_timeout"] = max(2, math.ceil(min(self.exit_after, 10.0)))
            elif self.connect_timeout is not None:
                extra["connect_timeout"] = self.connect_timeout
        with psycopg.connect(
            self.dsn,
            autocommit=True,
            prepare_threshold=self.prepare_threshold,
            application_name=f"outbox-celery:{self.name}:listen",
            **extra,
        ) as conn:
            channel = self.store.listen(conn)
            self._count("connects")
            self.connected.set()
            logger.info("outbox listener %s: listening on %s", self.name, channel)
            # Whatever was committed while nobody listened: claim once on every (re)connect, or,
            # with idle_poll, ask first as an idle sweep does (DESIGN invariant 36).
            wake = True
            wait = 0.0
            sweep = self.idle_poll is not None
            while not self._stop.is_set():
                if sweep:
                    wait = self._sweep(conn)
                elif wake:
                    wait = self._claim_until_quiet(conn)
                woke_at = time.monotonic()
                deadline = woke_at + wait
                wake = sweep = False
                while not self._stop.is_set():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        # Something comes due, or the poll period is over (an idle sweep's).
                        wake = True
                        sweep = self._sweeping
                        break
                    if self._wait_notification(conn, left):
                        wake = True
                        break

    def _wait_notification(self, conn: psycopg.Connection[Any], timeout: float) -> bool:
        """Wait up to ``timeout`` for a notification (or stop()); drain the ones already there.

        True when one calls for a claim: any but a freed slot's (:data:`SLOT_FREED`), which
        only matters while the last run left a type held back by a limit; otherwise
        every finished delivery of a limit that does not bind would start a claim run.

        The wait is one ``poll`` of the connection and the wake pipe, the interpreter lock
        released throughout. ``conn.notifies(timeout=...)`` wakes every 0.1 s to look for
        signals: a hundred idle listeners took the lock a thousand times a second from Celery's
        consumer in the same process (DESIGN invariant 35).
        """
        # Every notification received meanwhile is answered by the same claim (coalesced),
        # those psycopg kept while the connection ran a statement included.
        got = list(conn.notifies(timeout=0.0))
        if not got and self._readable(conn, timeout):
            got = list(conn.notifies(timeout=0.0))
        if got:
            self._count("notifications", len(got))
        return any(n.payload != SLOT_FREED for n in got) or (self._held and bool(got))

    def _readable(self, conn: psycopg.Connection[Any], timeout: float) -> bool:
        """Wait up to ``timeout`` for the connection to have data; False on stop() or timeout."""
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)
        if self._wake is not None:
            poller.register(self._wake[0], select.POLLIN)
        ready = poller.poll(max(0, math.ceil(timeout * 1000)))
        return any(fd == conn.fileno() for fd, _ in ready)

    def _hold_off(self, conn: psycopg.Connection[Any], seconds: float) -> None:
        """Wait ``seconds`` (or until stopped), draining every notification that arrives."""
        deadline = time.monotonic() + seconds
        got = 0
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            got += sum(1 for _ in conn.notifies(timeout=min(left, _STOP_CHECK)))
        if got:
            self._count("notifications", got)

    def _sweep(self, conn: psycopg.Connection[Any]) -> float:
        """A wake at the poll period, or at the idle sweep's moment (DESIGN invariant 36): one
        statement on this session asks whether a claim would find anything to do; only then does
        it claim. Returns the next wait."""
        poll = self._poll()
        due, seconds = self.store.claim_probe(conn, self.event_types(), within=poll)
        self._count("probes")
        if due:
            return self._claim_until_quiet(conn)
        self._sweeping = seconds is None
        return poll if seconds is None else min(poll, max(_MIN_WAIT, seconds))

    def _poll(self) -> float:
        """The longest wait now: ``poll`` while a claim did something within ``idle_poll``, else
        until this listener's moment in the next idle sweep."""
        if self.idle_poll is not None and time.monotonic() - self._active_at >= self.idle_poll:
            return until_slot(time.monotonic(), self.idle_poll, self._phase)
        return self.poll

    def _claim_until_quiet(self, conn: psycopg.Connection[Any]) -> float:
        """Claim until a run was not held off by another one; return how long to wait next."""
        busy_wait = _BUSY_RETRY[0]
        run: ClaimRun | None = None
        while not self._stop.is_set():
            run = self.claim()
            self._count("claims")
            if run is not None and run.stopped_by == StoppedBy.ANOTHER_CLAIM_RUNNING:
                # Another process's run holds the claim lock and may have read the table before
                # the notifying transaction committed: try again once it is done. The wait
                # doubles up to _BUSY_RETRY[1] while runs are held off, and notifications do not
                # cut it short: under a storm of commits each one would trigger another
                # attempt at once, hundreds a second per worker, while the holder's run claims
                # what they announce anyway. They are drained meanwhile and answered by the
                # next attempt.
                self._hold_off(conn, busy_wait)
                busy_wait = min(busy_wait * 2, _BUSY_RETRY[1])
                continue
            if run is not None and run.stopped_by == StoppedBy.BUDGET:
                continue  # a backlog: keep claiming
            break
        if run is not None and _did_something(run):
            self._active_at = time.monotonic()
        poll = self._poll()
        due = self.store.next_due(conn, self.event_types(), within=poll)
        self._held = run is not None and run.flow_wait is not None
        if run is not None and run.flow_wait is not None:
            # An event type held back by its limit or a RateLimited outcome: a finished
            # delivery, a refilled rate bucket or a hold's end sends no notification.
            due = run.flow_wait if due is None else min(due, run.flow_wait)
        # With idle_poll (several databases), a wait that ends at the poll period or the idle
        # sweep's moment asks first (invariant 36); one that ends when a row comes due claims.
        self._sweeping = self.idle_poll is not None and due is None
        if due is None:
            return poll
        return min(poll, max(_MIN_WAIT, due))


def _did_something(run: ClaimRun) -> bool:
    """Whether a claim run changed rows or left a type held back by a limit."""
    return bool(run.claimed or run.reaped or run.released or run.lost or run.flow_wait is not None)
