"""One outbox table's named statements and the small reads and writes around them.

:class:`Store` is the table's seam: its named statements (and their one-row forms), its
counters, its transaction rules and its identity. The rooms above run their statements through
it: the producers (:class:`~outbox_celery.produce.writes.ProducerWrites`), the claim
(:func:`outbox_celery.claim.executor.claim`), the fenced transitions (its
:class:`~outbox_celery.db.completer.Completer`, ``store.completer``); the operators' reads and
actions are ``ops/``. It imports nothing of them.

Every method takes a psycopg connection. A method that owns a transaction opens it itself with
``conn.transaction()``, so it works on pooled autocommit connections; a single fenced statement
on an autocommit connection outside a transaction is its own implicit transaction, which saves
the ``BEGIN`` and ``COMMIT`` round trips (:meth:`Store._single_statement`). The fenced start and
an all-done finalize commit with ``synchronous_commit = off`` when the store owns the
transaction (see :class:`Store`); everything else, the claim above all, commits durably.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from types import MappingProxyType
from typing import Any, NamedTuple, TypeVar

import psycopg
from psycopg import pq, sql

from .. import codec
from ..message import KEY_SEPARATOR, Message, idempotency_key, split_route
from ..table import TableName
from . import rows as _rows
from . import statements as _sql
from .completer import LOST, Completer, Finalized, FinalizedMany, Finish, Lease, Step

__all__ = ["LOST", "SLOT_FREED", "Finalized", "FinalizedMany", "Lease", "Store", "starter_token"]

logger = logging.getLogger(__name__)

R = TypeVar("R")

#: The payload of a finished concurrency-limited delivery's notification: a slot is free.
SLOT_FREED = "slot_freed"


def starter_token() -> str:
    """``host:pid:<random>``: names one fenced start (written to ``lease_owner``).

    A start's retry after a lost reply passes the same token and gets its row back
    (:meth:`Completer.start <outbox_celery.db.completer.Completer.start>`); any other start of the
    same claim is refused.
    """
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


# -- the rows of the store's own statements (read by column name, db/rows.py) ------------------


class NameRow(NamedTuple):
    """``canonical_name``: the table as PostgreSQL resolves it."""

    schema_name: str
    table_name: str


class InstanceStateRow(NamedTuple):
    """``instance``: whether the identity table is there and readable (ok, missing, denied)."""

    state: str


class InstanceRow(NamedTuple):
    """``instance_id``: the table's identity."""

    instance: str


class ClaimLockRow(NamedTuple):
    """``try_claim_lock``: whether this transaction holds the table's claim lock."""

    locked: bool


class CountRow(NamedTuple):
    """``count_in_flight``, ``count_recent_done``."""

    n: int


class RouteFlightRow(NamedTuple):
    """A row of ``in_flight_by_route``."""

    event_type: str
    live: int
    unstarted: int
    stalled: int


class ReadyRow(NamedTuple):
    """``flow_exists``: whether the flow-control tables exist."""

    ready: bool


class EventTypeRow(NamedTuple):
    """``flow_capped``: an event type."""

    event_type: str


class LimitsRow(NamedTuple):
    """``transaction_limits``: the settings it made, and the transaction's isolation level."""

    statement_timeout: str
    idle_timeout: str
    transaction_timeout: str | None
    isolation: str


class ChannelRow(NamedTuple):
    """``notify_channel``: the table's channel."""

    channel: str


class DueRow(NamedTuple):
    """``next_due``: whether a claim would find work now (asked by an idle sweep only), and
    seconds until something comes due (``None``: nothing in the window)."""

    due: bool
    seconds: float | None


class Store:
    """The named statements of one outbox table, its counters, transaction rules and identity.

    The fenced transitions of its rows are :attr:`completer`'s; the claim is
    :func:`outbox_celery.claim.executor.claim`'s; the producers' writes are
    :class:`~outbox_celery.produce.writes.ProducerWrites`'; each runs this store's statements.

    :param table: ``"name"``, ``"schema.name"`` or a :class:`~outbox_celery.config.TableName`.
    :param relaxed_commit: commit the fenced start and ``done`` with ``synchronous_commit = off``
        when the store owns the transaction (an autocommit connection outside a transaction).
        Default true. Only a PostgreSQL crash can lose such a commit (the WAL writer flushes it
        within about three ``wal_writer_delay``), and losing one means at most a redelivery after
        the lease: a lost ``done`` leaves the row ``processing`` until its lease ends, a lost
        start leaves one handler run uncounted. Any later claim that sees the row commits
        durably and, WAL being sequential, flushes the earlier relaxed commit with it, so
        ordering and fencing hold across a crash. The claim itself always commits durably: its
        new ``lease_version`` goes out in published tasks and must never be rolled back.
    :param queries: replacement texts for named queries of ``sql/queries.sql`` (same name, same
        parameters, same column names: rows are read by column name; ``{table}`` and the index
        names are bound as identifiers, the file's fragments such as ``{claim_picked}`` filled
        in). For benchmarks and experiments: the text is trusted SQL, never user input.
    """

    def __init__(
        self,
        table: str | TableName = "outbox",
        *,
        relaxed_commit: bool = True,
        queries: Mapping[str, str] | None = None,
        database: str | None = None,
    ) -> None:
        self.table = TableName.parse(table)
        self.relaxed_commit = relaxed_commit
        #: The name of the database this table lives in, when an Outbox serves several
        #: (DESIGN invariant 34); ``None`` for the one ``dsn``. Handlers read it as
        #: :attr:`Message.database <outbox_celery.message.Message.database>`.
        self.database = database
        #: `` on database <name>`` for log lines when it has one, else empty.
        self.on = f" on database {database}" if database else ""
        #: The ``database`` field of log records when it has one.
        self.log_fields: dict[str, str] = {"database": database} if database else {}
        self._q: Mapping[str, sql.Composed] = _sql.queries("queries.sql", self.table)
        unknown = set(queries or {}) - set(self._q)
        if unknown:
            raise ValueError(f"no named queries {sorted(unknown)} to replace")
        filled = {
            name: _sql.fill(text, _sql.fragments("queries.sql")) for name, text in (queries or {}).items()
        }
        if filled:
            bound = {name: _sql.bind(text, self.table, name) for name, text in filled.items()}
            self._q = {**self._q, **bound}
        #: The one-row forms of the fenced statements (the completer's calls with one row).
        self._one: Mapping[str, sql.Composed] = _sql.one_row_queries("queries.sql", self.table, filled)
        self._stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()
        self._canonical: str | None = None
        self._instance: str | None = None
        self._flow_ready = False
        self._subscriptions_ready = False
        self._flow_warned = False
        #: The table's name, quoted: the ``table`` parameter of the statements that resolve it to
        #: its oid in SQL, so that lock names do not depend on how the table was spelled
        #: ("outbox" or "public.outbox"). Quoting needs no connection: formatted once.
        self.quoted: str = self.table.identifier().as_string(None)
        #: The fenced transitions of this table: start, finalize, lease extension.
        self.completer = Completer(self)

    # -- transactions --------------------------------------------------------------------------

    @staticmethod
    def _owns_transaction(conn: psycopg.Connection[Any]) -> bool:
        return bool(conn.autocommit) and conn.info.transaction_status == pq.TransactionStatus.IDLE

    def _single_statement(self, conn: psycopg.Connection[Any]) -> AbstractContextManager[Any]:
        """The transaction around one fenced statement.

        On an autocommit connection outside a transaction block the statement is its own
        transaction already; ``BEGIN``/``COMMIT`` around it would cost two round trips and change
        nothing. In any other state the statement joins (or opens) a transaction.
        """
        if self._owns_transaction(conn):
            return contextlib.nullcontext()
        return conn.transaction()

    def _commit_mode(self, conn: psycopg.Connection[Any]) -> str | None:
        """``"off"`` where a relaxed commit is allowed; ``None`` keeps the session's setting."""
        return "off" if self.relaxed_commit and self._owns_transaction(conn) else None

    @property
    def queries(self) -> Mapping[str, sql.Composed]:
        """The named queries, bound to this table (read-only)."""
        return MappingProxyType(dict(self._q))

    def _read(
        self, conn: psycopg.Connection[Any], cls: type[R], name: str, params: Mapping[str, Any] | None = None
    ) -> list[R]:
        """Run named statement ``name``; its rows as ``cls``, by column name."""
        return _rows.read(conn, cls, self._q[name], params)

    # -- identity ------------------------------------------------------------------------------

    def canonical_name(self, conn: psycopg.Connection[Any]) -> str:
        """``schema.name`` of the table as PostgreSQL resolves it, e.g. ``public.outbox``.

        The base of every idempotency key (``public.outbox:42``): however the table was
        spelled (``outbox``, ``public.outbox``), one message has one key. Resolved once per
        Store, then cached.
        """
        if self._canonical is None:
            [row] = self._read(conn, NameRow, "canonical_name", {"table": self.quoted})
            self._canonical = f"{row.schema_name}.{row.table_name}"
        return self._canonical

    def instance(self, conn: psycopg.Connection[Any]) -> str | None:
        """The table's identity (a UUID drawn once by migration 0006), or ``None`` before it.

        The discriminator of idempotency keys: two databases or clusters with an outbox
        of the same name never send the same key. Read once per Store, then cached; a table not
        migrated to 0006 yet gives ``None`` (keys of the previous form, logged) until the
        process restarts.
        """
        if self._instance is None:
            name = self.table.identifier(_sql.INSTANCE_SUFFIX).as_string(conn)
            [found] = self._read(conn, InstanceStateRow, "instance", {"instance_table": name})
            state = found.state
            self._instance = ""
            if state == "ok":
                rows = self._read(conn, InstanceRow, "instance_id")
                self._instance = rows[0].instance if rows else ""
            if not self._instance:
                why = {
                    "missing": "migration 0006 not applied",
                    "denied": f"this role may not read it: GRANT SELECT ON {name} to the workers' role",
                }.get(state, "its row is missing")
                logger.error(
                    "outbox table %s has no readable identity (%s): idempotency keys keep the "
                    "previous form until this is fixed and workers restart",
                    self.table.qualified,
                    why,
                    extra={"outbox_table": self.table.qualified},
                )
        return self._instance or None

    def key_prefix(self, conn: psycopg.Connection[Any]) -> str:
        """What every idempotency key of this table starts with (``<instance>/public.outbox:``)."""
        return idempotency_key(self.canonical_name(conn), 0, self.instance(conn))[:-1]

    # -- observability -------------------------------------------------------------------------

    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats[key] += n

    def get_stats(self) -> dict[str, int]:
        """Counters of this process: claims, fenced outcomes, lost leases."""
        with self._stats_lock:
            return dict(self._stats)

    # -- the claim run's reads -----------------------------------------------------------------

    def try_claim_lock(self, conn: psycopg.Connection[Any]) -> bool:
        """Transaction-level advisory lock: one claim run per table at a time.

        ``conn`` must be inside a transaction that the caller keeps open for the whole claim run
        (on a connection of its own: the claims commit on another); ending that transaction
        releases the lock. Nothing lives in the session, so it holds behind PgBouncer in
        transaction pooling, where a session lock could be taken on one server connection and
        "released" on another, leaving every later run skipped.
        """
        if conn.info.transaction_status != pq.TransactionStatus.INTRANS:
            raise RuntimeError("try_claim_lock needs an open transaction (conn.transaction())")
        [row] = self._read(conn, ClaimLockRow, "try_claim_lock", {"table": self.quoted})
        return bool(row.locked)

    def in_flight(self, conn: psycopg.Connection[Any]) -> int:
        """Live leases: rows ``processing`` whose lease has not run out (DESIGN invariant 16)."""
        [row] = self._read(conn, CountRow, "count_in_flight")
        return int(row.n)

    def in_flight_by_route(
        self, conn: psycopg.Connection[Any], *, lease: float, stall: float
    ) -> list[RouteFlightRow]:
        """Live leases per route, with those whose task has not started and those of them
        claimed more than ``stall`` seconds ago (DESIGN invariant 16)."""
        return self._read(conn, RouteFlightRow, "in_flight_by_route", {"lease": lease, "stall": stall})

    def recent_done(self, conn: psycopg.Connection[Any], *, window: float, cap: int) -> int:
        """Rows finished ``done`` in the last ``window`` seconds, counted up to ``cap``."""
        [row] = self._read(conn, CountRow, "count_recent_done", {"window": window, "cap": cap})
        return int(row.n)

    def release(self, conn: psycopg.Connection[Any], leases: Sequence[Lease]) -> int:
        """Give the leases of unpublished claims back: ``pending`` now, no attempt spent
        (invariant 12).

        A claim whose fenced start has run is left alone (a publish that raised although the
        broker got the task): its worker holds the row. Returns how many rows went back.
        """
        if not leases:
            return 0
        with conn.transaction():
            finishes = [Finish(x, Step.RELEASE) for x in leases]
            won = self.completer.finish(conn, finishes, max_attempts=0, max_age=0.0)
        return len(won.statuses)

    # -- flow control --------------------------------------------------------------------

    def flow_ready(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether the flow-control tables (migrations 0007, 0008) exist; cached once they do."""
        if not self._flow_ready:
            name = self.table.identifier(_sql.FLOW_SUFFIX).as_string(conn)
            keys = self.table.identifier(_sql.FLOW_KEY_SUFFIX).as_string(conn)
            params = {"flow_table": name, "flow_key_table": keys}
            [row] = self._read(conn, ReadyRow, "flow_exists", params)
            self._flow_ready = bool(row.ready)
        return self._flow_ready

    def subscriptions_ready(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether the subscription table (migration 0011) exists; cached once it does."""
        if not self._subscriptions_ready:
            name = self.table.identifier(_sql.SUBSCRIPTION_SUFFIX).as_string(conn)
            [row] = self._read(conn, ReadyRow, "subscriptions_exist", {"subscription_table": name})
            self._subscriptions_ready = bool(row.ready)
        return self._subscriptions_ready

    def capped(self, conn: psycopg.Connection[Any], event_types: Sequence[str]) -> frozenset[str]:
        """The types among ``event_types`` the last claim left at their concurrency limit
        (empty before migration 0008)."""
        if not event_types or not self.flow_ready(conn):
            return frozenset()
        rows = self._read(conn, EventTypeRow, "flow_capped", {"types": list(event_types)})
        return frozenset(r.event_type for r in rows)

    # -- the worker's -------------------------------------------------------------------------

    def _message(self, conn: psycopg.Connection[Any], row: dict[str, Any]) -> Message:
        event_type, subscription = split_route(row["event_type"])
        key = row["ordering_key"]
        return Message(
            id=int(row["id"]),
            event_type=event_type,
            subscription=subscription,
            aggregate_type=row["aggregate_type"],
            aggregate_id=row["aggregate_id"],
            # psycopg's json loader, then kombu's object hook (DESIGN invariant 27): what was
            # enqueued, a string included (a str payload is a JSON string, never decoded again).
            payload=codec.decode(row["payload"]),
            attempts=int(row["attempts"]),
            created_at=row["created_at"],
            lease_version=int(row["lease_version"]),
            # The producer's key, without the subscription's part (invariant 28).
            ordering_key=key.partition(KEY_SEPARATOR)[0] if key is not None else None,
            idempotency_key=idempotency_key(self.canonical_name(conn), int(row["id"]), self.instance(conn)),
            trace_context=row.get("trace_context"),
            legacy_idempotency_key=idempotency_key(self.canonical_name(conn), int(row["id"])),
            group_id=row.get("group_id"),
            database=self.database,
        )

    def follow_ups_at_commit(self, conn: psycopg.Connection[Any], ids: Sequence[int]) -> int:
        """Move rows the caller's open transaction enqueued, already due, to this statement's time.

        A transactional handler's long transaction runs it just before its done (named query
        ``follow_ups_at_commit``, DESIGN invariant 18): its follow-ups then land at its commit,
        in front of the claims' scan marks, not at its start. Returns how many moved.

        :raises RuntimeError: ``conn`` is in autocommit outside a transaction block.
        """
        if self._owns_transaction(conn):
            raise RuntimeError("follow_ups_at_commit needs the transaction that enqueued the rows")
        return conn.execute(self._q["follow_ups_at_commit"], {"ids": list(ids)}).rowcount

    def limit_transaction(self, conn: psycopg.Connection[Any], *, seconds: float) -> str:
        """Bound the caller's open transaction to ``seconds`` (a transactional handler's).

        Sets ``statement_timeout`` and ``idle_in_transaction_session_timeout`` for this
        transaction only, and ``transaction_timeout`` on PostgreSQL 17 and later (named query
        ``transaction_limits``). Returns the transaction's isolation level.

        :raises RuntimeError: ``conn`` would run the statement as its own transaction (an
            autocommit connection outside a transaction block): there is nothing to bound.
        """
        if self._owns_transaction(conn):
            raise RuntimeError("limit_transaction needs a transaction: this connection is in autocommit")
        ms = max(1, round(seconds * 1000))
        [row] = self._read(conn, LimitsRow, "transaction_limits", {"ms": ms})
        return row.isolation

    # -- push ----------------------------------------------------------------------------

    def notify_channel(self, conn: psycopg.Connection[Any]) -> str:
        """The channel :meth:`notify` signals on (``outbox_celery_<table oid>``)."""
        [row] = self._read(conn, ChannelRow, "notify_channel", {"table": self.quoted})
        return row.channel

    def notify(self, conn: psycopg.Connection[Any], payload: str = "") -> None:
        """Signal this table's channel (:meth:`notify_channel`) with ``payload``: the push
        listeners claim again (:data:`SLOT_FREED`: only while a limit holds a type back)."""
        conn.execute(self._q["notify"], {"table": self.quoted, "payload": payload})

    def listen(self, conn: psycopg.Connection[Any]) -> str:
        """``LISTEN`` on this table's channel (a session-level setting); return the channel."""
        channel = self.notify_channel(conn)
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        return channel

    def next_due(
        self, conn: psycopg.Connection[Any], event_types: Sequence[str] | None, *, within: float = 3600.0
    ) -> float | None:
        """Seconds until a delayed row of ``event_types`` or a live lease comes due, or None.

        Only what comes due in the next ``within`` seconds is looked for (None otherwise): the
        listener asks for its poll period, so the probe steps over that window's dead index
        entries only (DESIGN invariant 18).
        """
        return self._due(conn, event_types, within=within, probe=False)[1]

    def claim_probe(
        self, conn: psycopg.Connection[Any], event_types: Sequence[str] | None, *, within: float = 3600.0
    ) -> tuple[bool, float | None]:
        """An idle sweep's one statement (DESIGN invariant 36): whether a claim run would find
        anything to do now (a due row or ordered head of any type, a lease that ran out), and
        :meth:`next_due`'s seconds. A yes may be false (a paused type's due rows), a no is not."""
        return self._due(conn, event_types, within=within, probe=True)

    def _due(
        self, conn: psycopg.Connection[Any], event_types: Sequence[str] | None, *, within: float, probe: bool
    ) -> tuple[bool, float | None]:
        params = {
            "event_types": list(event_types) if event_types is not None else None,
            "within": within,
            "probe": probe,
        }
        [row] = self._read(conn, DueRow, "next_due", params)
        return bool(row.due), None if row.seconds is None else float(row.seconds)
