"""Prometheus metrics of the outbox table: a collector to register, and a small exporter.

Database-side gauges only (depth per status, oldest pending age, expired leases, dead and
blocked messages, attempts); task-level metrics come from Flower (see docs/operations.md).

``prometheus_client`` is an optional dependency (the ``metrics`` extra); it is
imported when a collector is built, never when this module is imported.

::

    from prometheus_client import REGISTRY
    from outbox_celery.metrics import OutboxCollector

    REGISTRY.register(OutboxCollector("postgresql://...", "outbox"))
    # or, inside a process that has an Outbox object (uses its pool and knows its handlers):
    REGISTRY.register(OutboxCollector.from_outbox(outbox))

Every scrape runs one read-only statement per table (:func:`outbox_celery.ops.stats`) under a
statement timeout. Its reads are bounded (at most ``cap`` index entries per status, done rows
only from the newest end of their index), so a scrape costs the same with millions of done rows:
a count that reached the cap is a lower bound, and ``outbox_messages_capped`` says so (for
``done``: an estimate from the table's statistics). When it fails, ``outbox_up`` is 0 and the
table's other series are absent for that scrape, rather than stale.
"""

from __future__ import annotations

import logging
import time
from collections import Counter as Tally
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import psycopg

from ..dsn import error_line
from ..operated import OperatedOutbox
from ..table import TableName
from .snapshot import Stats, stats

if TYPE_CHECKING:
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import CollectorRegistry

__all__ = [
    "DEFAULT_METRICS_CAP",
    "DEFAULT_PORT",
    "METRIC_KEYS",
    "OutboxCollector",
    "require_prometheus",
    "start_exporter",
]

logger = logging.getLogger(__name__)

DEFAULT_PORT = 9808
#: Index entries each of a scrape's stats reads takes at most (per status): smaller than
#: ``stats``' default so that a scrape stays within milliseconds (docs/operations.md).
DEFAULT_METRICS_CAP = 1_000
#: Limit keys paused or held that get series of their own (paused first, then the longest
#: held); every key is counted per event type in ``outbox_limit_keys_paused`` and
#: ``outbox_limit_keys_rate_limited``.
METRIC_KEYS = 10

ConnectionFactory = Callable[[], AbstractContextManager[psycopg.Connection[Any]]]
#: Several databases by name: each a connection factory and its table.
_Databases = Mapping[str, tuple[ConnectionFactory, TableName]]

_STATUSES = ("pending", "processing", "done", "dead")
_LIVE = ("pending", "processing", "dead")


def require_prometheus() -> Any:
    """``prometheus_client.core``, or an :class:`ImportError` that says which extra to install."""
    try:
        import prometheus_client.core as core
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError(
            "Prometheus metrics need prometheus_client: install the metrics extra "
            "(python -m pip install '.[metrics]' in the outbox-celery source tree) "
            "or pip install prometheus-client"
        ) from exc
    return core


class OutboxCollector:
    """A Prometheus collector reporting the state of one or more outbox tables.

    :param source: a DSN (a short-lived connection per scrape) or a callable returning a
        context manager that yields a connection, e.g. a psycopg_pool ``pool.connection``.
    :param table: a table name, or several (each series carries a ``table`` label).
    :param handlers: event types that have a handler; when given, pending messages of other
        event types are reported as ``<namespace>_unroutable_messages``.
    :param namespace: prefix of every metric name. Default ``"outbox"``.
    :param timeout: statement timeout of the stats query, seconds. Default 10.
    :param connect_timeout: seconds to wait for a connection when ``source`` is a DSN.
    :param cap: index entries each of the stats reads takes at most (default
        :data:`DEFAULT_METRICS_CAP`); past it a count is a lower bound. ``None``: exact counts,
        reading every row (a scrape then costs the table's size).
    :param databases: several databases, by name: each a connection factory and its table
        (``source`` and ``table`` are then left out of the reads), or a callable returning them,
        called at each scrape. Every series then carries a ``database`` label first
        (:meth:`from_outbox` of an Outbox that serves several).
    """

    def __init__(
        self,
        source: str | ConnectionFactory,
        table: str | TableName | Sequence[str | TableName] = "outbox",
        *,
        handlers: Collection[str] | None = None,
        namespace: str = "outbox",
        timeout: float = 10.0,
        connect_timeout: float = 5.0,
        cap: int | None = DEFAULT_METRICS_CAP,
        databases: _Databases | Callable[[], _Databases] | None = None,
    ) -> None:
        require_prometheus()
        self._databases: Callable[[], _Databases] | None = None
        if callable(databases):
            self._databases = databases
        elif databases:
            fixed = dict(databases)
            self._databases = lambda: fixed
        tables = [table] if isinstance(table, str | TableName) else list(table)
        self.tables = [TableName.parse(t) for t in tables]
        if not self.tables:
            raise ValueError("at least one table is needed")
        self.handlers = frozenset(handlers) if handlers is not None else None
        self.namespace = namespace
        self.timeout = timeout
        self.cap = cap
        # Only to scrub it from logged errors (dsn.error_line); never logged itself.
        self._dsn: str | None = source if isinstance(source, str) else None
        # The same for each of several databases (from_outbox knows their DSNs).
        self._dsn_of: Callable[[str], str | None] = lambda _database: None
        self._connect_timeout = connect_timeout
        self._connect = self._connector(source) if isinstance(source, str) else source

    def _connector(self, dsn: str) -> ConnectionFactory:
        """A connection of its own to ``dsn`` per call (closed when its block ends)."""

        def connect() -> AbstractContextManager[psycopg.Connection[Any]]:
            return psycopg.connect(
                dsn,
                autocommit=True,
                connect_timeout=max(1, int(self._connect_timeout)),
                application_name="outbox-celery-metrics",
            )

        return connect

    @classmethod
    def from_outbox(cls, outbox: OperatedOutbox, *, pooled: bool = True, **kwargs: Any) -> OutboxCollector:
        """A collector over ``outbox``'s table (each of its databases') and handlers (keyword
        arguments pass on).

        :param pooled: read through the Outbox's pools, in a process that has them open (a
            worker). ``False`` opens a connection of its own for each database at each scrape
            and closes it after its read: an exporter process then holds at most one connection,
            and none between scrapes, however many databases the Outbox serves.
        """
        kwargs.setdefault("handlers", set(outbox.handlers))
        dsn = outbox.config.dsn
        if outbox.config.databases is None:
            return cls(outbox.connection if pooled or dsn is None else dsn, outbox.config.table, **kwargs)
        collector: OutboxCollector

        def connect(name: str, dsn: str) -> ConnectionFactory:
            return (lambda: outbox.connection(name)) if pooled else collector._connector(dsn)

        def databases() -> _Databases:
            # Read at each scrape: a database added to (or dropped from) a ``databases``
            # callable is scraped from the Outbox's next refresh on, as it is claimed.
            return {
                name: (connect(name, db.dsn), TableName.parse(db.table) if db.table else outbox.config.table)
                for name, db in outbox.databases.items()
            }

        def dsn_of(name: str) -> str | None:
            db = outbox.databases.get(name)
            return None if db is None else db.dsn

        kwargs["databases"] = databases
        collector = cls(outbox.connection, outbox.config.table, **kwargs)
        collector._dsn_of = dsn_of
        return collector

    @property
    def databases(self) -> dict[str, tuple[ConnectionFactory, TableName]] | None:
        """The databases a scrape reads now, by name (``None``: ``source`` and ``table``)."""
        return None if self._databases is None else dict(self._databases())

    # -- the families --------------------------------------------------------------------------

    def _families(self) -> dict[str, GaugeMetricFamily]:
        core = require_prometheus()
        ns = self.namespace
        g: _Gauge = core.GaugeMetricFamily
        if self._databases is not None:

            def g(name: str, documentation: str, *, labels: Sequence[str]) -> GaugeMetricFamily:
                family: GaugeMetricFamily = core.GaugeMetricFamily(
                    name, documentation, labels=["database", *labels]
                )
                return family

        fams: dict[str, GaugeMetricFamily] = {
            **_status_families(g, ns),
            **_age_families(g, ns),
            **_ordering_families(g, ns),
            **_breakdown_families(g, ns),
            **_horizon_families(g, ns),
            **_flow_families(g, ns),
            **_group_families(g, ns),
        }
        if self.handlers is not None:
            fams["unroutable"] = g(
                f"{ns}_unroutable_messages",
                "Pending rows of an event type that has no registered handler.",
                labels=["table", "event_type"],
            )
        return fams

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """The metric families, without touching the database (used at registration)."""
        yield from self._families().values()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Query each table and yield its gauges."""
        fams = self._families()
        databases = self.databases
        if databases is not None:
            for database, (connect, table) in sorted(databases.items()):
                self._collect(_Labelled(fams, database), table, connect, database)
        else:
            for table in self.tables:
                self._collect(fams, table, self._connect, None)
        yield from fams.values()

    def _collect(
        self, fams: Mapping[str, Any], table: TableName, connect: ConnectionFactory, database: str | None
    ) -> None:
        """Read one table's stats into ``fams``."""
        name = table.qualified
        started = time.monotonic()
        try:
            with connect() as conn:
                s = stats(conn, table, handlers=self.handlers, timeout=self.timeout, cap=self.cap)
        except Exception as exc:
            logger.warning(
                "outbox metrics: stats of %s%s failed: %s",
                name,
                "" if database is None else f" in database {database}",
                error_line(exc, self._dsn if database is None else self._dsn_of(database))
                or type(exc).__name__,
                extra={"outbox_table": name},
            )
            fams["up"].add_metric([name], 0)
            return
        fams["up"].add_metric([name], 1)
        fams["duration"].add_metric([name], time.monotonic() - started)
        self._add(fams, name, s)

    @staticmethod
    def _add(fams: Mapping[str, Any], name: str, s: Stats) -> None:
        for status in _STATUSES:
            fams["messages"].add_metric([name, status], s.counts[status])
            fams["capped"].add_metric([name, status], 1 if s.capped.get(status) else 0)
        fams["done_minute"].add_metric([name], s.done_last_minute)
        fams["ready"].add_metric([name], s.ready)
        fams["oldest_pending"].add_metric([name], s.oldest_pending_age or 0.0)
        fams["oldest_ready"].add_metric([name], s.oldest_ready_wait or 0.0)
        fams["oldest_processing"].add_metric([name], s.oldest_processing_age or 0.0)
        fams["expired"].add_metric([name], s.expired_leases)
        fams["blocked_keys"].add_metric([name], s.blocked_keys)
        fams["blocked_messages"].add_metric([name], s.blocked_messages)
        fams["headless_keys"].add_metric([name], s.headless_keys)
        fams["groups_open"].add_metric([name], s.groups.open)
        fams["groups_oldest"].add_metric([name], s.groups.oldest_open_age or 0.0)
        fams["groups_blocked"].add_metric([name], s.groups.blocked)
        for e in s.event_types:
            for status in _LIVE:
                fams["type_messages"].add_metric([name, e.event_type, status], getattr(e, status))
            # Every event type, zeros included: an alert on "> 0 for 5 minutes" needs the series.
            fams["unstarted"].add_metric([name, e.event_type], e.unstarted)
            if e.pending:
                fams["type_oldest"].add_metric([name, e.event_type], e.oldest_pending_age or 0.0)
            if "unroutable" in fams and e.pending and e.has_handler is False:
                fams["unroutable"].add_metric([name, e.event_type], e.pending)
        for f in s.flow:
            if f.paused:
                fams["paused"].add_metric([name, f.event_type], 1)
            if f.held_for:
                fams["held"].add_metric([name, f.event_type], f.held_for)
        # Keys by count per event type; one series per key for the first METRIC_KEYS only
        # (paused first, then the longest held): the series stay bounded by the event types,
        # whatever the number of keys paused or held (DESIGN invariant 25).
        paused_keys: Tally[str] = Tally(k.event_type for k in s.keys if k.paused)
        held_keys: Tally[str] = Tally(k.event_type for k in s.keys if k.held_for)
        for event_type in sorted(paused_keys):
            fams["keys_paused"].add_metric([name, event_type], paused_keys[event_type])
        for event_type in sorted(held_keys):
            fams["keys_held"].add_metric([name, event_type], held_keys[event_type])
        named = sorted(s.keys, key=lambda k: (not k.paused, -(k.held_for or 0.0), k.event_type, k.limit_key))
        for k in named[:METRIC_KEYS]:
            if k.paused:
                fams["key_paused"].add_metric([name, k.event_type, k.limit_key], 1)
            if k.held_for:
                fams["key_held"].add_metric([name, k.event_type, k.limit_key], k.held_for)
        for a in s.attempts:
            for status in _LIVE:
                fams["attempts"].add_metric([name, str(a.attempts), status], getattr(a, status))
        h = s.horizon
        if h is not None:
            kind = h.kind or "none"
            fams["horizon"].add_metric([name, kind], h.seconds or 0.0)
            fams["horizon_xids"].add_metric([name, kind], h.xid_age or 0)
            fams["dead_versions"].add_metric([name], h.dead_row_versions)
            if h.last_vacuum_age is not None:
                fams["vacuum_age"].add_metric([name], h.last_vacuum_age)


class _Labelled(Mapping[str, Any]):
    """The families, each adding ``database`` as its first label value."""

    class _Family:
        def __init__(self, family: GaugeMetricFamily, database: str) -> None:
            self._family, self._database = family, database

        def add_metric(self, labels: Sequence[str], value: float) -> None:
            self._family.add_metric([self._database, *labels], value)

    def __init__(self, fams: Mapping[str, GaugeMetricFamily], database: str) -> None:
        self._fams, self._database = fams, database

    def __getitem__(self, key: str) -> Any:
        return self._Family(self._fams[key], self._database)

    def __iter__(self) -> Iterator[str]:
        return iter(self._fams)

    def __len__(self) -> int:
        return len(self._fams)


# -- the families, one function per group (the order is the exposition order) ----------------------

_Gauge = Callable[..., "GaugeMetricFamily"]


def _status_families(g: _Gauge, ns: str) -> dict[str, GaugeMetricFamily]:
    """Whether the read succeeded and the rows per status (cap-aware)."""
    return {
        "up": g(f"{ns}_up", "1 if the last stats query of the table succeeded, else 0.", labels=["table"]),
        "messages": g(
            f"{ns}_messages",
            "Rows per status, read up to the collector's cap: a lower bound where "
            f"{ns}_messages_capped is 1 (done: an estimate past the cap).",
            labels=["table", "status"],
        ),
        "capped": g(
            f"{ns}_messages_capped",
            "1 where the status' read stopped at the cap: its count is a lower bound (done: an "
            "estimate from the table's statistics), else 0.",
            labels=["table", "status"],
        ),
        "done_minute": g(
            f"{ns}_done_last_minute_messages",
            "Rows that became done in the last minute (database clock; a lower bound when done is capped).",
            labels=["table"],
        ),
        "ready": g(
            f"{ns}_ready_messages",
            "Pending rows whose available_at has come (claimable now).",
            labels=["table"],
        ),
    }


def _age_families(g: _Gauge, ns: str) -> dict[str, GaugeMetricFamily]:
    """The oldest row of each live state and the expired leases."""
    return {
        "oldest_pending": g(
            f"{ns}_oldest_pending_age_seconds",
            "Seconds since created_at of the oldest pending row (0 when none).",
            labels=["table"],
        ),
        "oldest_ready": g(
            f"{ns}_oldest_ready_wait_seconds",
            "Seconds the oldest claimable row has waited past its available_at (0 when none).",
            labels=["table"],
        ),
        "oldest_processing": g(
            f"{ns}_oldest_processing_age_seconds",
            "Seconds since created_at of the oldest processing row (0 when none).",
            labels=["table"],
        ),
        "expired": g(
            f"{ns}_expired_leases",
            "Processing rows whose lease has expired (worker lost or stuck).",
            labels=["table"],
        ),
    }


def _ordering_families(g: _Gauge, ns: str) -> dict[str, GaugeMetricFamily]:
    """Ordering keys blocked by a dead head or left without a head."""
    return {
        "blocked_keys": g(
            f"{ns}_blocked_keys", "Ordering keys whose head message is dead.", labels=["table"]
        ),
        "headless_keys": g(
            f"{ns}_headless_keys",
            "Ordering keys with unfinished messages and no head: never claimed until "
            "`outbox-celery repair-heads` (should be 0).",
            labels=["table"],
        ),
        "blocked_messages": g(
            f"{ns}_blocked_messages",
            "Messages waiting behind a dead head of their ordering key.",
            labels=["table"],
        ),
    }


def _breakdown_families(g: _Gauge, ns: str) -> dict[str, GaugeMetricFamily]:
    """Live rows per event type and per attempts spent, and the read's own cost."""
    return {
        "type_messages": g(
            f"{ns}_event_type_messages",
            "Live rows (pending, processing, dead) per event type.",
            labels=["table", "event_type", "status"],
        ),
        "type_oldest": g(
            f"{ns}_event_type_oldest_pending_age_seconds",
            "Seconds since created_at of the oldest pending row of the event type.",
            labels=["table", "event_type"],
        ),
        "attempts": g(
            f"{ns}_attempts_messages",
            "Live rows per number of attempts spent (the attempts histogram).",
            labels=["table", "attempts", "status"],
        ),
        "duration": g(f"{ns}_stats_duration_seconds", "Seconds the stats query took.", labels=["table"]),
    }


def _horizon_families(g: _Gauge, ns: str) -> dict[str, GaugeMetricFamily]:
    """The xmin horizon and what it keeps VACUUM from cleaning."""
    return {
        "horizon": g(
            f"{ns}_xmin_horizon_age_seconds",
            "Seconds the oldest transaction holding back the xmin horizon has been open (0 when"
            " none; slots and standbys, which record no time, show in the xid gauge).",
            labels=["table", "kind"],
        ),
        "horizon_xids": g(
            f"{ns}_xmin_horizon_age_xids",
            "Transaction ids between now and the oldest snapshot still held (any kind).",
            labels=["table", "kind"],
        ),
        "dead_versions": g(
            f"{ns}_dead_row_versions",
            "Dead row versions of the outbox table (PostgreSQL's statistics); VACUUM removes"
            " them once no snapshot needs them.",
            labels=["table"],
        ),
        "vacuum_age": g(
            f"{ns}_last_vacuum_age_seconds",
            "Seconds since the outbox table's last vacuum or autovacuum (absent: never).",
            labels=["table"],
        ),
    }


def _flow_families(g: _Gauge, ns: str) -> dict[str, GaugeMetricFamily]:
    """Event types and limit keys nobody claims or starts: lost tasks, paused, rate limited."""
    return {
        "unstarted": g(
            f"{ns}_unstarted_messages",
            "Live rows of the event type claimed since their last start without a worker starting"
            " them (lost tasks: a queue with no consumer, a flushed broker).",
            labels=["table", "event_type"],
        ),
        "paused": g(
            f"{ns}_event_type_paused",
            "1 for an event type paused by an operator (outbox-celery pause): claimed by nobody.",
            labels=["table", "event_type"],
        ),
        "held": g(
            f"{ns}_event_type_rate_limited_seconds",
            "Seconds a RateLimited outcome still holds the event type back (claimed by nobody).",
            labels=["table", "event_type"],
        ),
        "key_paused": g(
            f"{ns}_limit_key_paused",
            "1 for a limit key paused by an operator (outbox-celery pause --key): claimed by nobody.",
            labels=["table", "event_type", "limit_key"],
        ),
        "key_held": g(
            f"{ns}_limit_key_rate_limited_seconds",
            "Seconds a RateLimited outcome still holds the limit key back (claimed by nobody).",
            labels=["table", "event_type", "limit_key"],
        ),
        "keys_paused": g(
            f"{ns}_limit_keys_paused",
            "Limit keys of the event type paused by an operator (all of them; the per-key "
            "series name the first few only).",
            labels=["table", "event_type"],
        ),
        "keys_held": g(
            f"{ns}_limit_keys_rate_limited",
            "Limit keys of the event type a RateLimited outcome holds back (all of them).",
            labels=["table", "event_type"],
        ),
    }


def _group_families(g: _Gauge, ns: str) -> dict[str, GaugeMetricFamily]:
    """Open groups with a callback (invariant 29)."""
    return {
        "groups_open": g(
            f"{ns}_groups_open",
            "Open groups with a callback (invariant 29): members not all final yet.",
            labels=["table"],
        ),
        "groups_oldest": g(
            f"{ns}_groups_oldest_open_age_seconds",
            "Seconds since the oldest open group was written (0: none open).",
            labels=["table"],
        ),
        "groups_blocked": g(
            f"{ns}_groups_blocked",
            "Open groups with a dead member: they wait for an operator (requeue or skip the"
            " member, or finish or cancel the group) unless every other member ends.",
            labels=["table"],
        ),
    }


def start_exporter(
    collector: OutboxCollector,
    *,
    port: int = DEFAULT_PORT,
    addr: str = "127.0.0.1",
    worker_metrics_dir: str | None = None,
) -> tuple[Any, CollectorRegistry]:
    """Serve ``/metrics`` for ``collector`` on ``addr:port`` from a daemon thread.

    ``addr`` defaults to the loopback interface: the page has no authentication and
    names event types and depths. Pass ``"0.0.0.0"`` (or one interface's address) to let a
    Prometheus on another host scrape it, behind a firewall or a network policy.

    The registry holds only this collector (no Python process metrics) and, with
    ``worker_metrics_dir``, the counters that workers on this machine wrote there in
    prometheus_client's multiprocess mode (see :func:`outbox_celery.metrics.track_deliveries`).
    Returns the HTTP server (call ``shutdown()`` to stop it) and the registry.
    """
    require_prometheus()
    from prometheus_client import start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector
    from prometheus_client.registry import CollectorRegistry

    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    if worker_metrics_dir is not None:
        MultiProcessCollector(registry, path=worker_metrics_dir)  # type: ignore[no-untyped-call]
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server, registry
