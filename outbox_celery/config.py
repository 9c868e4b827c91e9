"""Settings of an outbox, in one frozen dataclass with every default documented here.

:class:`OutboxConfig` is the one declaration of every setting. An
:class:`~outbox_celery.Outbox` takes them as keywords named after its fields (``Outbox(app,
lease=30)``), checked against them by :func:`check_setting_names`; a field not given comes from
the Celery configuration as ``outbox_<field>`` (``app.conf.outbox_lease = 30``), then from its
default. ``Outbox(app, config=OutboxConfig(...))`` takes a whole configuration instead.
:func:`resolve` applies that order. docs/celery.md's settings table lists every field with its
default (``tests/unit/test_config.py`` checks it against this class).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from .databases import database_map
from .dsn import DSN_ENV, invalid_dsn
from .errors import ConfigurationError, seconds
from .table import TableName

__all__ = ["UNSET", "OutboxConfig", "TableName", "Unset", "check_setting_names", "given_settings", "resolve"]


class Unset(enum.Enum):
    """The type of :data:`UNSET`."""

    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"


#: Deprecated: a setting left out of ``Outbox(...)`` comes from the Celery configuration
#: (``outbox_<name>``), then from the default; passing ``UNSET`` for it warns and does the same.
UNSET = Unset.UNSET


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be an integer >= 1, got {value!r}")
    return value


# Shortest lease accepted: the delivery's hard time limit (0.9 * lease) stays below the lease
# and the soft one below that, each by a margin a loaded worker can still honour.
MIN_LEASE = 2.0

_SECONDS_FIELDS = (
    "idle_sweep",
    "database_idle_close",
    "databases_refresh",
    "lease",
    "claim_interval",
    "claim_budget",
    "backoff_base",
    "backoff_cap",
    "max_defer_age",
    "unroutable_delay",
    "retention",
    "max_clock_skew",
    "broker_timeout",
    "claim_time_limit",
    "handler_time_limit",
    "listen_poll",
    "done_batch_delay",
    "scan_lookback",
    "full_scan_interval",
    "unreachable_exit_after",
    "wait_for_database",
)
# Seconds settings where 0 means "not at all".
_MAY_BE_ZERO = ("done_batch_delay", "wait_for_database")
_INT_FIELDS = (
    "batch_size",
    "max_attempts",
    "max_in_flight",
    "max_payload_bytes",
    "pool_max_size",
    "retention_batch_size",
)


@dataclass(frozen=True, slots=True)
class OutboxConfig:
    """Every knob of an outbox. Seconds may be given as ``timedelta``.

    :ivar dsn: PostgreSQL connection string (libpq format or URI). Required by workers. When
        neither ``Outbox(dsn=...)`` nor ``outbox_dsn`` gives one, :class:`~outbox_celery.Outbox`
        reads the ``OUTBOX_DSN`` environment variable. A password in ``outbox_dsn`` is printed
        by ``celery report`` and ``celery inspect conf``; the variable, the keyword, or a
        password in ``PGPASSWORD`` / a passfile keep it out.
    :ivar table: outbox table, ``"name"`` or ``"schema.name"``. Default ``"outbox"``.
    :ivar lease: seconds a claim owns a row before another claim may take it. Default 60; at
        least 2 (shorter leases raise :class:`ConfigurationError`). The delivery task's hard time
        limit is ``0.9 * lease`` and its Celery ``expires`` ``max_clock_skew`` after its end.
    :ivar batch_size: rows claimed per claim transaction. Default 200.
    :ivar max_attempts: handler runs before a message goes ``dead``. Default 12.
    :ivar claim_interval: seconds between beat-triggered claim runs (sub-second allowed): the
        safety net behind the listener (``listen``). Default 5.0.
    :ivar claim_budget: seconds one claim run may keep claiming while batches come back full.
        Default 1.0 (the listener starts the next run at once; a beat-triggered run in a prefork
        pool process must not hold it from deliveries for a whole ``claim_interval``).
    :ivar max_in_flight: hard upper bound of claimed-but-unfinished rows. Default 1000.
    :ivar min_in_flight: the in-flight bound never adapts below this. Default ``batch_size``
        (capped by ``max_in_flight``).
    :ivar adaptive_in_flight: when true (default) the bound follows measured throughput:
        ``finished in the last lease / 2`` clamped to ``[min_in_flight, max_in_flight]``, so
        that whatever is handed to Celery can start within half a lease. With several
        databases, a database whose claims are pushed (``listen``) keeps about two seconds of
        its throughput instead (DESIGN invariant 37): they share the delivery queue.
    :ivar backoff_base: seconds; full-jitter window after attempt ``n`` is
        ``min(backoff_cap, backoff_base * 2**n)``. Default 1.0.
    :ivar backoff_cap: seconds; upper bound of the backoff window. Default 300.
    :ivar max_defer_age: seconds since ``created_at`` after which a ``Defer`` makes the message
        ``dead`` instead. Default 7 days.
    :ivar max_payload_bytes: largest JSON payload :meth:`Outbox.enqueue
        <outbox_celery.app.outbox.Outbox.enqueue>` and ``enqueue_many`` accept (the module-level
        :func:`~outbox_celery.enqueue` takes its own ``max_payload_bytes``). Default 1 MiB.
    :ivar claim_queue: Celery queue of the claim (and retention) task. Default ``"outbox.claim"``.
    :ivar default_queue: queue for event types registered without one. Default ``"outbox"``.
    :ivar unroutable_delay: seconds a message waits when a worker has no handler for its event
        type (attempt refunded). Default 60.
    :ivar pool_max_size: psycopg pool size per worker process. Default 4.
    :ivar retention: seconds after which ``done`` rows are purged by the retention beat task;
        ``None`` disables it. Default 7 days.
    :ivar retention_batch_size: rows deleted per purge transaction. Default 5000.
    :ivar relaxed_commit: commit the fenced start and ``done`` with ``synchronous_commit = off``
        (only a PostgreSQL crash can lose them, which costs at most a redelivery after the lease;
        claims always commit durably). Default true.
    :ivar max_clock_skew: seconds the wall clocks of workers and beat may be off from
        PostgreSQL's (and from each other) without losing a claim or a delivery (invariant 13).
        Celery checks ``expires`` on the receiving worker's own clock, so the claim task expires
        ``claim_interval + max_clock_skew`` after beat sent it and a delivery task
        ``max_clock_skew`` after its lease end; the fence, not ``expires``, decides whether a
        task is stale. Default 300 (five minutes).
    :ivar broker_timeout: seconds the claim's publishing connection may block on connect, read
        or write before it fails (Redis ``socket_timeout``/``socket_connect_timeout``, py-amqp
        ``read_timeout``/``write_timeout``, on that connection only). A publish that hangs (a
        half-open TCP connection) then fails and the claim run gives its rows back to
        ``pending``. Default 10.
    :ivar claim_time_limit: soft time limit of the claim task, in seconds; the hard one is 5 s
        later. A claim run that outlives it stops publishing and releases what it had not
        published (a backstop for brokers without socket timeouts). Default
        ``claim budget + 3 * broker_timeout``.
    :ivar prepare_threshold: psycopg's ``prepare_threshold`` for the pool's connections: a
        query executed this many times on a connection becomes a server-side prepared
        statement. ``None`` disables them, as PgBouncer in transaction pooling needs before 1.21
        (from 1.21 on, PgBouncer's ``max_prepared_statements`` lets them work). ``None`` counts
        in the Celery configuration too (``outbox_prepare_threshold = None``). Default 5
        (psycopg's).
    :ivar lease_heartbeat: extend the lease automatically while a handler runs (every third of
        a lease, fenced, from a thread; it stops when the lease is lost or the handler ends), so
        handlers may run longer than one lease. The delivery's hard time limit is then
        ``handler_time_limit`` instead of ``0.9 * lease``, and the heartbeat stops extending
        once a handler has run that long. Default false.
    :ivar handler_time_limit: with ``lease_heartbeat``, the delivery task's hard time limit in
        seconds (soft: ``max(0.9 * hard, hard - 1)``). Default ``10 * lease``. Only allowed
        with ``lease_heartbeat`` (without it the limit is ``0.9 * lease``).
    :ivar configure_celery: apply recommended Celery settings (prefetch 1, Redis visibility
        timeout above the lease) where the user has not set them. Default true.
    :ivar listen: run a listener in every worker that consumes ``claim_queue``: it LISTENs for
        the producers' notifications and claims at once, in the worker's main process, and wakes
        when a delayed row or a lease comes due. Default true. See docs/push.md.
    :ivar listen_dsn: DSN of the listener's own connection when ``dsn`` points at a pooler in
        transaction mode (LISTEN needs a session). Default ``None``: ``dsn``.
    :ivar listen_poll: seconds the listener waits at most between claim runs when nothing wakes
        it (no database work beyond one claim run; nothing goes through the broker). Default 1.0.
    :ivar done_batch_delay: seconds a delivery worker process may hold a handled unordered
        message's ``done`` to write it with the others of that window, in one fenced statement
        (ordered messages, and messages with less than this plus one second of lease left, are
        written at once). A process killed in that window has its messages delivered again
        after their lease, as for a kill during the handler. 0 writes every ``done`` at once.
        Default 0.05; below ``lease / 4``.
    :ivar scan_lookback: seconds behind where its previous claim stopped that a claim starts
        its index scans (DESIGN invariant 18): what it steps over stays bounded while a long
        transaction pins the xmin horizon. A message whose producer's transaction commits more
        than this after it began waits for the next full scan. Default 10.
    :ivar full_scan_interval: seconds between a process's claims that scan from the start of
        the indexes (the first claim of a process always does), for messages committed later
        than ``scan_lookback`` behind the marks. Default 60.
    :ivar unreachable_exit_after: seconds a worker running the push listener (one that consumes
        ``claim_queue``, with ``listen`` on) may go without a working session with its database
        before it stops (a warm shutdown, exit code 1), so that its supervisor restarts it and
        probes see it. Default ``None``: it keeps retrying and logging (docs/operations.md,
        "Health checks and probes").
    :ivar wait_for_database: seconds a worker that serves this outbox (it consumes its claim
        queue or a delivery queue) waits at start for its database: reachable, the table
        migrated, the handlers' subscriptions registered. Past it the worker refuses to start
        (one line on stderr, exit code 1) instead of running and failing every task it takes.
        Default 0: it refuses at once.
    :ivar databases: several databases served by this outbox, by name, instead of one ``dsn``:
        a mapping of names to DSNs or :class:`~outbox_celery.databases.Database` values, a list
        of :class:`~outbox_celery.databases.Database`, or a callable returning either (called
        again every ``databases_refresh`` seconds: tenants added at run time). Each database
        has its own table, migrations, claims and LISTEN; one beat entry and one claim queue
        serve them all (docs/databases.md, DESIGN invariant 34). Default ``None``: ``dsn``.
    :ivar idle_sweep: with ``databases``, seconds between the sweeps of a database whose last
        claim found nothing to do, in each process that claims: a sweep asks one statement and
        claims only when it finds something to do (DESIGN invariant 36); a notification (push)
        or a due row claims it at once. Default 30.
    :ivar database_idle_close: with ``databases``, seconds a worker process keeps the
        connections of a database it has not used; then they are closed. Default 60.
    :ivar databases_refresh: with a callable ``databases``, seconds between its calls.
        Default 10.
    """

    # Left out of repr: error reporters that record locals (Sentry) send repr(config).
    dsn: str | None = field(default=None, repr=False)
    table: TableName = field(default_factory=lambda: TableName("outbox"))
    lease: float = 60.0
    batch_size: int = 200
    max_attempts: int = 12
    claim_interval: float = 5.0
    claim_budget: float | None = None
    max_in_flight: int = 1000
    min_in_flight: int | None = None
    adaptive_in_flight: bool = True
    backoff_base: float = 1.0
    backoff_cap: float = 300.0
    max_defer_age: float = 7 * 24 * 3600.0
    max_payload_bytes: int = 1024 * 1024
    claim_queue: str = "outbox.claim"
    default_queue: str = "outbox"
    unroutable_delay: float = 60.0
    pool_max_size: int = 4
    retention: float | None = 7 * 24 * 3600.0
    retention_batch_size: int = 5000
    relaxed_commit: bool = True
    configure_celery: bool = True
    max_clock_skew: float = 300.0
    broker_timeout: float = 10.0
    claim_time_limit: float | None = None
    prepare_threshold: int | None = 5
    lease_heartbeat: bool = False
    handler_time_limit: float | None = None
    listen: bool = True
    listen_dsn: str | None = field(default=None, repr=False)
    listen_poll: float = 1.0
    done_batch_delay: float = 0.05
    scan_lookback: float = 10.0
    full_scan_interval: float = 60.0
    unreachable_exit_after: float | None = None
    wait_for_database: float = 0.0
    databases: Any = field(default=None, repr=False)
    idle_sweep: float = 30.0
    database_idle_close: float = 60.0
    databases_refresh: float = 10.0

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "table", TableName.parse(self.table))
        for name in _SECONDS_FIELDS:
            value = getattr(self, name)
            if value is None and name in (
                "claim_budget",
                "retention",
                "claim_time_limit",
                "handler_time_limit",
                "unreachable_exit_after",
            ):
                continue
            set_(
                self,
                name,
                seconds(value, name, error=ConfigurationError, positive=name not in _MAY_BE_ZERO),
            )
        for name in _INT_FIELDS:
            _positive_int(getattr(self, name), name)
        if not isinstance(self.lease_heartbeat, bool):
            raise ConfigurationError(f"lease_heartbeat must be true or false, got {self.lease_heartbeat!r}")
        if self.handler_time_limit is not None and not self.lease_heartbeat:
            raise ConfigurationError(
                "handler_time_limit needs lease_heartbeat: without it the delivery's time limit "
                "is 0.9 * lease, so that the lease outlives the handler"
            )
        if self.pool_max_size < 2:
            # A transactional handler holds one for its transaction while its fenced start,
            # finish and lease heartbeat take another (docs/transactional.md).
            raise ConfigurationError(f"pool_max_size must be at least 2, got {self.pool_max_size}")
        if self.prepare_threshold is not None and (
            isinstance(self.prepare_threshold, bool)
            or not isinstance(self.prepare_threshold, int)
            or self.prepare_threshold < 0
        ):
            raise ConfigurationError(
                f"prepare_threshold must be None or an integer >= 0, got {self.prepare_threshold!r}"
            )
        if self.min_in_flight is not None:
            _positive_int(self.min_in_flight, "min_in_flight")
        if self.backoff_cap < self.backoff_base:
            raise ConfigurationError("backoff_cap must be >= backoff_base")
        if self.claim_interval >= self.lease:
            raise ConfigurationError("claim_interval must be shorter than lease")
        if self.lease < MIN_LEASE:
            # The delivery's hard time limit (0.9 * lease) must end a handler before its lease
            # does, with room for the fenced finalize; under 2 s there is none to speak of.
            raise ConfigurationError(
                f"lease must be at least {MIN_LEASE:g} s (got {self.lease:g} s): the delivery "
                "task's time limits must fit below it"
            )
        if self.done_batch_delay >= self.lease / 4:
            raise ConfigurationError(
                f"done_batch_delay must be below lease / 4 ({self.lease / 4:g} s), got "
                f"{self.done_batch_delay:g} s: a done held longer could outlive its lease"
            )
        self._check_strings()
        if self.databases is not None:
            if self.dsn is not None:
                raise ConfigurationError(
                    "give either dsn (one database) or databases (several by name), not both"
                )
            if not callable(self.databases) or isinstance(self.databases, Mapping):
                # Its errors now, not at the first claim.
                for db in database_map(self.databases).values():
                    if db.table is not None:
                        TableName.parse(db.table)

    def _check_strings(self) -> None:
        """The connection strings parse, the queue names are non-empty strings."""
        for name in ("dsn", "listen_dsn"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str):
                raise ConfigurationError(f"{name} must be a string")
            # Refused here, before anything connects with it: libpq quotes the part of a
            # DSN it cannot parse (an unencoded "%" in a password) in its error, which the
            # connection pool logs on every attempt and the listener on every reconnect.
            try:
                conninfo_to_dict(value)
            except psycopg.Error as unparseable:
                raise ConfigurationError(f"{name}: {invalid_dsn(value, unparseable)}") from None
        for name in ("claim_queue", "default_queue"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigurationError(f"{name} must be a non-empty string")

    @property
    def effective_claim_budget(self) -> float:
        """The claim run's time budget in seconds."""
        return self.claim_budget if self.claim_budget is not None else 1.0

    @property
    def claim_time_limits(self) -> tuple[float, float]:
        """``(soft, hard)`` time limits of the claim task, in seconds."""
        soft = self.claim_time_limit
        if soft is None:
            # A run claims for its budget, then each publish may block for a broker timeout
            # (and once more on kombu's single retry, and on a reconnect).
            soft = self.effective_claim_budget + 3 * self.broker_timeout
        return soft, soft + 5.0

    @property
    def effective_min_in_flight(self) -> int:
        """The lower bound of the adaptive in-flight limit."""
        floor = self.min_in_flight if self.min_in_flight is not None else self.batch_size
        return min(floor, self.max_in_flight)

    @property
    def task_time_limit(self) -> float:
        """Hard time limit of a delivery task.

        ``0.9 * lease``, always below the lease; with ``lease_heartbeat`` the heartbeat keeps
        the lease ahead of the handler instead, and the limit is ``handler_time_limit``
        (default ``10 * lease``).
        """
        if self.lease_heartbeat:
            return self.handler_time_limit if self.handler_time_limit is not None else 10 * self.lease
        return self.lease * 0.9

    @property
    def stalled_after(self) -> float:
        """Seconds a route's oldest claimed task may wait for a worker to start it before the
        route counts as stalled (DESIGN invariant 16): two claim intervals or a quarter of the
        lease, the longer. The claim then hands that route no more rows, and its waiting tasks
        no longer take room under the in-flight bound from the other routes."""
        return max(2 * self.claim_interval, self.lease / 4)

    @property
    def connection_wait(self) -> float:
        """Seconds a pooled connection is waited for, and a new one given to connect.

        A quarter of the lease, from 1 to 30 seconds: well inside a delivery's
        :attr:`task_time_limit`, so a process whose connections the server dropped fails the
        wait (the row returns after its lease, fenced) instead of being killed by its hard time
        limit while waiting, and a claim run never waits longer than its lease for the database.
        """
        return min(30.0, max(1.0, self.lease / 4))

    @property
    def min_redelivery_timeout(self) -> float:
        """Seconds a broker must leave an unacknowledged delivery alone: ``task_time_limit + lease``.

        A delivery may run for :attr:`task_time_limit` and its row keeps a lease beyond that; a
        broker that redelivers sooner (Redis ``visibility_timeout``, RabbitMQ
        ``consumer_timeout``) hands a running claim to a second worker. Its fenced start is
        refused (invariant 2), but the copy is wasted work and, on RabbitMQ, the first channel is closed.
        """
        return self.task_time_limit + self.lease

    def replace(self, **changes: Any) -> OutboxConfig:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_mapping(cls, conf: Mapping[str, Any], **overrides: Any) -> OutboxConfig:
        """Build from ``outbox_*`` keys of a Celery configuration plus explicit overrides."""
        check_setting_names(overrides)
        return cls(**{**_celery_settings(conf), **overrides})


SETTINGS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(OutboxConfig))


def check_setting_names(names: Iterable[str]) -> None:
    """Raise :class:`ConfigurationError` for names that are not :class:`OutboxConfig` fields.

    The message names each unknown setting with the fields it most resembles (``leese``: did
    you mean ``lease``?).
    """
    unknown = sorted(set(names) - SETTINGS)
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(SETTINGS), n=3, cutoff=0.6)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        hints.append(f"{name!r}{hint}")
    raise ConfigurationError(
        f"unknown outbox setting(s): {', '.join(hints)}; the settings are the fields of OutboxConfig"
    )


def _celery_settings(conf: Mapping[str, Any]) -> dict[str, Any]:
    """The ``outbox_<field>`` values set in a Celery configuration, by field name."""
    values: dict[str, Any] = {}
    for name in SETTINGS:
        key = f"outbox_{name}"
        try:
            present = key in conf
        except TypeError:  # pragma: no cover - exotic mappings
            present = False
        # None is a value of its own for prepare_threshold (disabled), not "unset".
        if present and (conf[key] is not None or name == "prepare_threshold"):
            values[name] = conf[key]
    return values


def given_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword settings of an ``Outbox(...)`` call, names checked, ``UNSET`` ones left out.

    Passing :data:`UNSET` is deprecated (leaving the keyword out does the same) and warns.
    """
    check_setting_names(settings)
    unset = sorted(k for k, v in settings.items() if v is UNSET)
    if unset:
        warnings.warn(
            f"passing UNSET to Outbox() is deprecated: leave out {', '.join(f'{k}=' for k in unset)} "
            "instead (a setting not given comes from the Celery configuration, then the default)",
            DeprecationWarning,
            stacklevel=3,
        )
    return {k: v for k, v in settings.items() if v is not UNSET}


def resolve(
    conf: Mapping[str, Any], settings: Mapping[str, Any], base: OutboxConfig | None = None
) -> OutboxConfig:
    """The configuration of an outbox: ``settings`` (keywords) over ``base`` or the Celery one.

    Without ``base``: a keyword wins over ``outbox_<name>`` in ``conf``, which wins over the
    default. With ``base`` (``Outbox(config=...)``), the keywords override ``base`` and ``conf``
    may hold no ``outbox_*`` setting: one given in two places would leave one of them ignored.
    Either way a ``dsn`` still unset is read from the ``OUTBOX_DSN`` environment variable.
    """
    if base is None:
        config = OutboxConfig.from_mapping(conf, **settings)
    else:
        also = sorted(f"outbox_{name}" for name in _celery_settings(conf))
        if also:
            raise ConfigurationError(
                f"Outbox(config=...) was given, and the Celery configuration sets {', '.join(also)}: "
                "put these in the OutboxConfig (or pass them as keywords), or leave config= out"
            )
        config = base.replace(**settings)
    if config.dsn is None and config.databases is None and os.environ.get(DSN_ENV):
        # Read from the environment, the DSN never enters app.conf, which `celery report` and
        # `celery inspect conf` print (Celery masks only names it knows).
        config = config.replace(dsn=os.environ[DSN_ENV])
    return config
