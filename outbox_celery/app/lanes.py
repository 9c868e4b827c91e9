"""One process's side of an Outbox that serves several databases (``databases=``).

A :class:`Lane` is one database in this process: its settings (the Outbox's, with the
database's DSN and table), its :class:`~outbox_celery.db.store.Store`, a connection pool opened
at first use and closed after ``database_idle_close`` seconds unused, and its
:class:`~outbox_celery.claim.claimer.Claimer` and :class:`~outbox_celery.worker.deliverer.Deliverer`.
:class:`Lanes` holds them by name, calls a ``databases`` callable again every
``databases_refresh`` seconds, and runs the beat-triggered claim over them in turn (DESIGN
invariant 34).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from billiard.exceptions import SoftTimeLimitExceeded
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolClosed

from ..backoff import RetryPolicy
from ..claim.claimer import Claimer, ClaimRun, Published, StoppedBy
from ..claim.executor import Claimed
from ..claim.gate import ClaimGate, until_slot
from ..config import OutboxConfig
from ..databases import Database, database_map
from ..db.pool import DatabaseUnavailable, ForkSafePool, IdleCheck
from ..db.store import Store
from ..dsn import error_line
from ..errors import ConfigurationError, UnknownDatabase
from ..handlers import HandlerSpec
from ..table import TableName
from ..worker.deliverer import Deliverer

__all__ = [
    "LANE_CONNECTION_WAIT",
    "POOL_CHECK_IDLE",
    "Lane",
    "Lanes",
    "connect_timeout",
    "merge_runs",
    "open_pool",
]

logger = logging.getLogger("outbox_celery.app.outbox")

# Seconds a pooled connection may sit idle and still be handed out without a check (IdleCheck).
POOL_CHECK_IDLE = 2.0
# A claim that failed on a database (down, dropped, not migrated) is tried again after this many
# seconds, doubling per failure up to ``idle_sweep``: the other databases' claims do not wait.
_FAILED_RETRY = 0.5
# A database that gave no connection is not asked again by this process for this many seconds,
# doubling per failure up to ``connection_wait``: meanwhile its tasks and claims fail at once
# instead of each holding a process for ``connection_wait``.
_DOWN_RETRY = 0.25
# A server that refused the direct attempt within _REFUSED_WITHIN (stopped, restarting, taking
# no connections, dropped) is asked again at least every _REFUSED_PAUSE: such an attempt costs
# next to nothing, and a task that fails in the pause after the database returned waits its
# lease. Only a host that does not answer (the attempt waits for ``connect_timeout``) is left for
# up to ``connection_wait``.
_REFUSED_WITHIN = 0.5
_REFUSED_PAUSE = 1.0
# Seconds a lane waits for a pooled connection (at most connection_wait): a database that
# refuses connections is found out in this long, not the lease's quarter. A lane's pool serves
# one delivery at a time per process, so a healthy one hands out or connects well within it.
LANE_CONNECTION_WAIT = 2.0


def connect_timeout(config: OutboxConfig) -> dict[str, Any]:
    """``connect_timeout`` for a new connection to ``config.dsn``, unless the DSN sets its own:
    libpq's is unbounded, and a host that does not answer would hold a new connection for the
    kernel's SYN retries, minutes."""
    if "connect_timeout" in conninfo_to_dict(config.dsn or ""):
        return {}
    return {"connect_timeout": max(2, math.ceil(config.connection_wait))}


def open_pool(
    config: OutboxConfig,
    *,
    name: str,
    check: IdleCheck,
    min_size: int = 1,
    max_idle: float | None = None,
    timeout: float | None = None,
) -> ConnectionPool[Any]:
    """A psycopg pool of autocommit connections to ``config.dsn`` for one outbox database;
    ``timeout``: seconds a connection is waited for (default ``connection_wait``)."""
    # No local holds the DSN: error reporters that record frame locals would send it.
    if not config.dsn:
        raise ConfigurationError(
            "no DSN: set OUTBOX_DSN, pass Outbox(app, dsn=...) or set outbox_dsn in the Celery config"
        )
    kwargs: dict[str, Any] = {
        "autocommit": True,
        "application_name": f"outbox-celery:{name}",
        # None behind PgBouncer < 1.21 in transaction pooling (docs/celery.md).
        "prepare_threshold": config.prepare_threshold,
        **connect_timeout(config),
    }
    wait = config.connection_wait
    extra: dict[str, Any] = {} if max_idle is None else {"max_idle": max_idle}
    return ConnectionPool(
        config.dsn,
        min_size=min_size,
        max_size=config.pool_max_size,
        kwargs=kwargs,
        # Bounded by the lease (connection_wait): after the server dropped the pool's
        # connections, a delivery or a claim that cannot get one fails fast and its row comes
        # back after its lease, instead of waiting out psycopg_pool's 30 s.
        timeout=wait if timeout is None else timeout,
        name=f"outbox-{name}",
        # A connection the server closed while it sat idle (restart, failover,
        # pg_terminate_backend) is replaced before use, not handed to a delivery whose fenced
        # write would then fail. Only idle ones: a round trip per checkout cost as much as the
        # fenced writes themselves; the rest are covered by the retry.
        check=check,
        open=True,
        **extra,
    )


def _worked(run: ClaimRun) -> bool:
    """Whether a claim run found work on its database: rows claimed, reaped or given back, or
    more left than its budget took."""
    return bool(run.claimed or run.reaped or run.released or run.lost or run.stopped_by == StoppedBy.BUDGET)


def merge_runs(runs: Sequence[ClaimRun]) -> ClaimRun:
    """One :class:`ClaimRun` for the runs of several databases (the claim task's result)."""
    total = ClaimRun()
    for run in runs:
        total.claimed += run.claimed
        total.published += run.published
        total.released += run.released
        total.reaped += run.reaped
        total.lost += run.lost
        total.unroutable += run.unroutable
        total.refused += run.refused
        total.batches += run.batches
        total.in_flight_limit += run.in_flight_limit
        total.seconds += run.seconds
        total.errors += run.errors
        if run.flow_wait is not None:
            total.flow_wait = (
                run.flow_wait if total.flow_wait is None else min(total.flow_wait, run.flow_wait)
            )
    ended = {run.stopped_by for run in runs}
    total.skipped = bool(runs) and all(run.skipped for run in runs)
    for why in (StoppedBy.BUDGET, StoppedBy.PUBLISH_FAILED, StoppedBy.IN_FLIGHT_BOUND):
        if why in ended:
            total.stopped_by = why
            break
    else:
        total.stopped_by = StoppedBy.DRAINED if runs else StoppedBy.NO_HANDLERS
    return total


class Lane:
    """One database of an Outbox that serves several, in this process.

    :param database: the declared database.
    :param config: the Outbox's settings with this database's ``dsn``, ``table`` and
        ``listen_dsn``.
    :param handlers: the Outbox's handlers by route (shared, read at each use).
    :param outbox_name: the Outbox's name (connection and log names).
    :param retry: the Outbox's retry policy, if it has one.
    """

    def __init__(
        self,
        database: Database,
        config: OutboxConfig,
        handlers: Mapping[str, HandlerSpec],
        *,
        outbox_name: str,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.name = database.name
        self.database = database
        self.config = config
        self.handlers = handlers
        self.outbox_name = outbox_name
        self.retry = retry
        self.store = Store(config.table, relaxed_commit=config.relaxed_commit, database=self.name)
        self._idle_check = IdleCheck(POOL_CHECK_IDLE)
        self._pool = ForkSafePool(self._open_pool)
        self._claimer: Claimer | None = None
        self._deliverer: Deliverer | None = None
        #: When this process last used the database (monotonic: a delivery, or a claim that
        #: did something; never yet: -inf); its pool closes after ``database_idle_close``
        #: seconds without use.
        self.used = float("-inf")
        #: The beat-triggered claim leaves this database out until then (monotonic): it found
        #: nothing to do, or its database failed.
        self.quiet_until = 0.0
        #: Where in each ``idle_sweep`` beat's claim in this process sweeps the database while
        #: it is idle (monotonic clock, chosen at random): idle databases are swept one after
        #: another through the sweep, not all in one claim task.
        self.phase = random.uniform(0.0, config.idle_sweep)
        #: When a claim here last did something (monotonic; never yet: a first run that finds
        #: nothing leaves the database idle at once).
        self.active_at = float("-inf")
        #: Whether the next visit of beat's claim is an idle sweep, which asks :meth:`probe`
        #: before it claims (DESIGN invariant 36): so is the first, for a database this process
        #: has not claimed yet, while the push listeners claim on notifications.
        self.sweeping = True
        self.failures = 0
        # Connection failures in a row (0: the database answers), the monotonic time before
        # which it is not asked again, the last failure's first line, and whether the server
        # refused that attempt at once.
        self._down = 0
        self._down_until = 0.0
        self._down_error = ""
        self._refused = False
        self._probing = threading.Lock()
        # Connections of this lane handed out and not yet returned.
        self._in_use = 0
        self._in_use_lock = threading.Lock()

    def _open_pool(self) -> ConnectionPool[Any]:
        # min_size 0 and max_idle: psycopg_pool closes the connections nobody used for
        # database_idle_close seconds even while this process takes no task at all.
        return open_pool(
            self.config,
            name=f"{self.outbox_name}:{self.name}",
            check=self._idle_check,
            min_size=0,
            max_idle=self.config.database_idle_close,
            timeout=min(self.config.connection_wait, LANE_CONNECTION_WAIT),
        )

    @property
    def pool(self) -> ConnectionPool[Any]:
        """This process's pool for the database (opened now if closed)."""
        return self._pool.get()

    @property
    def is_open(self) -> bool:
        """Whether this process holds a pool for the database."""
        return self._pool.opened

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled autocommit connection to the database.

        :raises DatabaseUnavailable: the database gave no connection moments ago (DESIGN
            invariant 34): it is asked again after a pause that doubles per failure up to
            ``connection_wait``, by one direct connection attempt, which fails at once where
            the server refuses; until then every caller fails at once.
        """
        with self._claim_connection() as conn:
            self.used = time.monotonic()
            try:
                yield conn
            finally:
                self.used = time.monotonic()

    @contextmanager
    def _claim_connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A connection that does not count as a use of the database: a claim run that finds
        nothing (an idle database's sweep) leaves its pool to close (``database_idle_close``);
        one that does something counts (:meth:`Lanes.claim_one`)."""
        self._admit()
        got = False
        with self._in_use_lock:
            self._in_use += 1
        try:
            with self.pool.connection() as conn:
                got = True
                try:
                    yield conn
                finally:
                    self._idle_check.returned(conn)
        except psycopg.OperationalError as exc:
            # PoolClosed: another thread closed the pool under a waiting caller (this lane
            # found the database unavailable, or closed it idle): nothing new about the server.
            if not got and not isinstance(exc, DatabaseUnavailable | PoolClosed):
                self._unavailable(exc)
            raise
        finally:
            with self._in_use_lock:
                self._in_use -= 1

    @property
    def connect_timeout(self) -> int | None:
        """libpq's ``connect_timeout`` for a new connection to the database (``None``: its DSN
        sets one): ``connection_wait`` rounded up, at least 2 s."""
        timeout: int | None = connect_timeout(self.config).get("connect_timeout")
        return timeout

    @property
    def in_use(self) -> bool:
        """Whether a connection of this lane is handed out in this process."""
        return self._in_use > 0

    def _admit(self) -> None:
        """Fail at once while the database is known to be unreachable; after the pause, one
        caller tries a direct connection (the others still fail at once)."""
        if not self._down:
            return
        now = time.monotonic()
        if now < self._down_until or not self._probing.acquire(blocking=False):
            raise DatabaseUnavailable(
                f"database {self.name} gave no connection ({self._down_error}); "
                f"asked again in {max(0.0, self._down_until - now):.1f}s"
            )
        try:
            self._down_until = now + self._pause()
            self._reach().close()
            logger.info(
                "outbox %s: database %s answers again",
                self.outbox_name,
                self.name,
                extra={"database": self.name},
            )
            self._down = 0
            self._down_until = 0.0
        finally:
            self._probing.release()

    def _direct(self) -> psycopg.Connection[Any]:
        """A connection of its own to the database, not the pool's: a server that refuses
        connections says so at once, where the pool's reconnection attempts would keep the
        caller waiting for a connection until its timeout."""
        return psycopg.connect(
            self.config.dsn or "",
            autocommit=True,
            application_name=f"outbox-celery:{self.outbox_name}:{self.name}",
            prepare_threshold=None,
            **connect_timeout(self.config),
        )

    def _reach(self) -> psycopg.Connection[Any]:
        """:meth:`_direct`; a connection the server refuses pauses the database in this process
        (:meth:`_unavailable`) and raises :class:`DatabaseUnavailable`."""
        started = time.monotonic()
        try:
            return self._direct()
        except psycopg.Error as exc:
            self._unavailable(exc, refused=time.monotonic() - started < _REFUSED_WITHIN)
            raise DatabaseUnavailable(
                f"database {self.name} gave no connection ({self._down_error})"
            ) from None

    def _pause(self) -> float:
        cap = _REFUSED_PAUSE if self._refused else self.config.connection_wait
        return min(cap, _DOWN_RETRY * 2.0 ** min(self._down, 10))

    def _unavailable(self, exc: BaseException, *, refused: bool = False) -> None:
        """The database gave no connection: pause asking it (``refused``: it said so at once,
        and the pause stays short), and drop this process's pool, whose own reconnection
        attempts back off for minutes (the next use after the pause opens a fresh one)."""
        first = not self._down
        self._down += 1
        self._refused = refused
        self._down_until = time.monotonic() + self._pause()
        self._down_error = error_line(exc, self.config.dsn)
        self._pool.close(timeout=1.0)
        if first:
            logger.warning(
                "outbox %s: database %s gave no connection (%s); its tasks and claims in this "
                "process fail at once until it answers, its rows wait, the other databases go on",
                self.outbox_name,
                self.name,
                self._down_error,
                extra={"outcome": "database_unavailable", "database": self.name},
            )

    def probe(self) -> bool:
        """Whether a claim run on the database would find anything to do now (DESIGN invariant
        36): one statement (:meth:`Store.claim_probe <outbox_celery.db.store.Store.claim_probe>`)
        on one connection, the pool's while this process holds it open, else one of its own,
        closed after: an idle database's pool is closed (``database_idle_close``), and opening it
        for one statement would start its threads and leave it open. Neither counts as a use.

        :raises DatabaseUnavailable: as :meth:`connection`.
        """
        routes = sorted(self.handlers)
        if self.is_open:
            with self._claim_connection() as conn:
                return self.store.claim_probe(conn, routes, within=0.0)[0]
        self._admit()
        with self._reach() as conn:
            return self.store.claim_probe(conn, routes, within=0.0)[0]

    def check(self) -> None:
        """Before a fenced write is retried on a broken connection: one connection of its own
        first, so that a database that stopped taking connections is known at once
        (:class:`DatabaseUnavailable`, and every caller in this process fails at once after it)
        instead of after ``LANE_CONNECTION_WAIT`` of the pool's reconnection attempts; then every
        idle pooled connection is tested. A database paused already is asked by
        :meth:`_admit` alone (at once it fails, after its pause it reaches)."""
        if self._down:
            self._admit()
        else:
            self._reach().close()
        self.pool.check()

    @property
    def claimer(self) -> Claimer:
        """Claim runs on this database."""
        if self._claimer is None:
            self._claimer = Claimer(
                self.config, self._claim_connection, self.handlers, store=self.store, shared=True
            )
        return self._claimer

    @property
    def deliverer(self) -> Deliverer:
        """Delivery tasks of this database in this process."""
        if self._deliverer is None:
            self._deliverer = Deliverer(
                self.config,
                self.connection,
                self.handlers,
                store=self.store,
                retry=self.retry,
                recover=self.check,
            )
        return self._deliverer

    def close(self) -> None:
        """Write the batched ``done`` still held, then close this process's pool (idempotent)."""
        if self._deliverer is not None:
            self._deliverer.flush()
        self._pool.close()

    def after_fork(self) -> None:
        """In a forked child: leave the parent's pool alone."""
        self._pool.after_fork()


class Lanes:
    """The databases of an Outbox that serves several, in this process, by name.

    :param setting: the ``databases`` setting (a mapping, a list or a callable).
    :param config: the Outbox's resolved settings.
    :param handlers: the Outbox's handlers by route.
    :param outbox_name: the Outbox's name.
    :param retry: the Outbox's retry policy, if it has one.
    """

    def __init__(
        self,
        setting: Any,
        config: OutboxConfig,
        handlers: Mapping[str, HandlerSpec],
        *,
        outbox_name: str,
        retry: RetryPolicy | None = None,
    ) -> None:
        self._setting = setting
        self._dynamic = callable(setting) and not isinstance(setting, Mapping)
        self.config = config
        self._handlers = handlers
        self._outbox_name = outbox_name
        self._retry = retry
        self._lock = threading.RLock()
        self._lanes: dict[str, Lane] = {}
        self._refreshed: float | None = None
        self._forced: float = 0.0
        self._idle_checked = 0.0
        self._turn = 0
        #: The push listeners' claim runs of this process, one at a time (DESIGN invariant 35).
        self.gate = ClaimGate()

    # -- the declared databases ------------------------------------------------------------------

    def refresh(self, *, force: bool = False) -> None:
        """Read the declared databases (a callable: at most every ``databases_refresh`` seconds
        unless ``force``); new ones get a lane, removed ones are closed.

        A callable that raises keeps the databases it returned last (logged); on the first read
        its error is raised.
        """
        now = time.monotonic()
        with self._lock:
            if self._refreshed is not None and (
                not self._dynamic or (not force and now - self._refreshed < self.config.databases_refresh)
            ):
                return
            try:
                found = database_map(self._setting)
            except Exception as exc:
                if self._refreshed is None:
                    raise
                logger.error("outbox %s: databases could not be read again: %s", self._outbox_name, exc)
                self._refreshed = now
                return
            self._refreshed = now
            for name in [n for n in self._lanes if n not in found or found[n] != self._lanes[n].database]:
                lane = self._lanes.pop(name)
                lane.close()
                if name not in found:
                    logger.info("outbox %s: database %s is no longer served", self._outbox_name, name)
            for name, db in found.items():
                if name not in self._lanes:
                    self._lanes[name] = self._lane(db)

    def _lane(self, db: Database) -> Lane:
        config = self.config.replace(
            databases=None,
            dsn=db.dsn,
            table=TableName.parse(db.table) if db.table else self.config.table,
            listen_dsn=db.listen_dsn,
        )
        return Lane(db, config, self._handlers, outbox_name=self._outbox_name, retry=self._retry)

    @property
    def databases(self) -> dict[str, Database]:
        """The databases served now, by name."""
        self.refresh()
        with self._lock:
            return {name: lane.database for name, lane in self._lanes.items()}

    def lanes(self) -> list[Lane]:
        """Every lane, by name."""
        self.refresh()
        with self._lock:
            return [self._lanes[name] for name in sorted(self._lanes)]

    def get(self, name: str) -> Lane:
        """The lane of database ``name``.

        :raises UnknownDatabase: no database of that name is declared (a callable is read again
            first, at most once a second).
        """
        self.refresh()
        self.close_idle()
        lane = self._lanes.get(name)
        if lane is None and self._dynamic and time.monotonic() - self._forced >= 1.0:
            self._forced = time.monotonic()
            self.refresh(force=True)
            lane = self._lanes.get(name)
        if lane is None:
            known = ", ".join(sorted(self._lanes)) or "none"
            raise UnknownDatabase(
                f"outbox {self._outbox_name} serves no database named {name!r} (it serves: {known})"
            )
        return lane

    # -- connections -------------------------------------------------------------------------

    def close_idle(self) -> list[str]:
        """Close the pools of the databases this process has not used for
        ``database_idle_close`` seconds (looked at most once a second); returns their names."""
        now = time.monotonic()
        if now - self._idle_checked < 1.0:
            return []
        self._idle_checked = now
        closed = []
        with self._lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            if lane.is_open and not lane.in_use and now - lane.used >= self.config.database_idle_close:
                lane.close()
                closed.append(lane.name)
        return closed

    def close(self) -> None:
        """Close every lane's pool in this process (idempotent)."""
        with self._lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.close()

    def after_fork(self) -> None:
        """In a forked child: leave the parent's pools alone (and its listeners' gate)."""
        self.gate = ClaimGate()
        with self._lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.after_fork()

    # -- the beat-triggered claim --------------------------------------------------------------

    def claim(
        self,
        publish: Callable[[Sequence[Claimed], str], Published | int],
        *,
        owner: str,
        sweep_idle: bool,
    ) -> ClaimRun:
        """One claim run on each database that may have work, in turn (DESIGN invariant 34).

        The databases are visited round robin, starting one further each run; each gets one
        claim run, bounded by ``claim_budget`` as a single database's is, so a busy database
        never keeps a quiet one from its turn. With ``sweep_idle`` (the push listeners claim on
        notifications), a database none of whose runs here did anything for ``idle_sweep``
        seconds is left out until its own moment in the next sweep, half a sweep to a sweep and a
        half later (DESIGN invariant 35; an ordered follower whose head just finished sends no
        notification, hence the wait before it counts as idle). A database that fails (down,
        dropped, not migrated) is logged and tried again after a backoff; the others are
        claimed as usual.
        """
        lanes = self.lanes()
        self.close_idle()
        if not lanes:
            return ClaimRun(stopped_by=StoppedBy.NO_HANDLERS)
        start = self._turn % len(lanes)
        self._turn = start + 1
        # No database is started past half the claim task's soft time limit (each run is
        # bounded by claim_budget): the next run starts where this one stopped.
        cfg = self.config
        deadline = time.monotonic() + max(cfg.effective_claim_budget, cfg.claim_time_limits[0] / 2)
        runs: list[ClaimRun] = []
        failed: list[str] = []
        for visited, lane in enumerate(lanes[start:] + lanes[:start]):
            now = time.monotonic()
            if now >= deadline and visited:
                self._turn = start + visited
                break
            if lane.quiet_until > now:
                continue
            try:
                # An idle sweep claims only what its one question finds (DESIGN invariant 36).
                if not (sweep_idle and lane.sweeping) or lane.probe():
                    run = self.claim_one(lane, publish, owner=owner)
                else:
                    run = ClaimRun(stopped_by=StoppedBy.DRAINED)
            except SoftTimeLimitExceeded:
                raise
            except Exception as exc:
                self._failed(lane, exc)
                failed.append(f"{lane.name}: {type(exc).__name__}")
                continue
            if _worked(run):
                lane.active_at = now
            idle = sweep_idle and now - lane.active_at >= self.config.idle_sweep
            lane.sweeping = idle
            lane.quiet_until = now + until_slot(now, self.config.idle_sweep, lane.phase) if idle else 0.0
            runs.append(run)
        total = merge_runs(runs)
        total.errors += failed
        return total

    def claim_one(
        self, lane: Lane, publish: Callable[[Sequence[Claimed], str], Published | int], *, owner: str
    ) -> ClaimRun:
        """One claim run on ``lane``'s database (the push listener of that database runs it)."""
        name = lane.name
        with self.gate.turn():
            run = lane.claimer.run(lambda claims: publish(claims, name), owner=owner)
        lane.failures = 0
        if _worked(run):
            lane.used = time.monotonic()  # a sweep that found nothing leaves the pool to close
        return run

    def _failed(self, lane: Lane, exc: BaseException) -> None:
        lane.failures += 1
        lane.sweeping = False
        pause = min(self.config.idle_sweep, _FAILED_RETRY * 2.0 ** min(lane.failures - 1, 10))
        now = time.monotonic()
        lane.quiet_until = now + pause
        # Not idle once it answers again: its listener may still be reconnecting, so its next
        # runs here claim it on every tick until it has been quiet for idle_sweep.
        lane.active_at = now
        logger.warning(
            "outbox %s: claim on database %s failed (%s); its rows wait, the other databases are "
            "claimed; trying it again in %.1fs",
            self._outbox_name,
            lane.name,
            error_line(exc, lane.config.dsn),
            pause,
            extra={"outcome": "database_failed", "database": lane.name},
        )
