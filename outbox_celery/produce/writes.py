"""The producer's writes: the key locks and the insert plan (invariant 9).

:class:`ProducerWrites` holds the statements producers run on one outbox table: the per-key
locks and the write plan every kind of producer connection drives. It runs the named statements
of its table's :class:`~outbox_celery.db.store.Store` and nothing else.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row

from ..db import rows as _rows
from ..db import statements as _sql
from ..db.store import Store
from ..errors import ProducerError
from ..message import KEY_SEPARATOR

__all__ = [
    "MAX_ORDERING_KEYS",
    "DedupRow",
    "InsertedRow",
    "LockedRow",
    "ProducerWrites",
    "Statement",
    "WritePlan",
]

# Distinct ordering keys one producer call may lock. Each key's lock is held to commit in
# PostgreSQL's shared lock table, whose size is max_locks_per_transaction x (max_connections +
# max_prepared_transactions) for the whole server (6,400 on a stock one): a bulk import of
# 20,000 keys failed with "out of shared memory", and every other session needing a lock failed
# with it meanwhile. Refused before anything is written instead; split such batches.
MAX_ORDERING_KEYS = 1000


class Statement(NamedTuple):
    """One statement of a write plan: the query, its parameters, and the row type its rows are
    read into by column name (:mod:`outbox_celery.db.rows`); ``None``: the plan reads none of
    them."""

    query: sql.Composed
    params: dict[str, Any]
    row: type[Any] | None = None

    def row_factory(self) -> Any:
        """The psycopg 3 row factory of its rows (a sync or async cursor's): its row type's, by
        column name, else tuples."""
        return tuple_row if self.row is None else _rows.factory(self.row)


#: The producer's statements for some rows (see :meth:`ProducerWrites.write_plan`): it yields
#: each statement, is sent back its rows (typed as the statement says) and returns the ids.
WritePlan = Generator[Statement, list[Any], list[int]]


class LockedRow(NamedTuple):
    """The row of ``lock_keys``: the keys locked and the transaction's isolation level."""

    locked: int
    isolation: str


class InsertedRow(NamedTuple):
    """A row of ``insert``, ``insert_many`` and ``group_insert``: one row written (its own or a
    subscription's, invariant 28), or a group's row (``group_insert``, invariant 29)."""

    id: int | None
    dedup_key: str | None
    woke: bool | None
    ordering_key: str | None
    #: The row whose payload a subscription's row reads; ``None`` on an event's own row.
    payload_of: int | None
    #: ``group_insert``'s group row only: the group's id and its member rows inserted.
    group_id: int | None = None
    total: int | None = None


class DedupRow(NamedTuple):
    """A row of ``dedup_ids``: the row holding a dedup key."""

    id: int
    dedup_key: str


class ProducerWrites:
    """The producer's statements of one outbox table.

    :param store: the table's :class:`~outbox_celery.db.store.Store`, whose named statements
        these are.
    """

    def __init__(self, store: Store) -> None:
        self.store = store

    def lock_keys(self, conn: psycopg.Connection[Any], keys: Iterable[str]) -> None:
        """Take the per-key producer locks, all in one statement (sorted: no deadlocks).

        :raises ProducerError: the transaction is not ``READ COMMITTED`` (see
            :meth:`_check_isolation`). Refused before anything is written.
        """
        params = {"table": self.store.quoted, "keys": list(keys)}
        with conn.cursor(row_factory=_rows.factory(LockedRow)) as cur:
            self._check_isolation(cur.execute(self.store._q["lock_keys"], params).fetchall())

    @staticmethod
    def _check_isolation(locked: Sequence[LockedRow]) -> None:
        """Refuse ordered events outside ``READ COMMITTED`` (``locked``: lock_keys' rows).

        The insert that follows the key locks decides whether the new row is its key's head from
        what its statement sees; under repeatable read or serializable the snapshot predates the
        lock, so it could miss a message of the key committed meanwhile (two heads) or a head
        finished meanwhile (a key with none).
        """
        level = locked[0].isolation if locked else "read committed"
        if level != "read committed":
            raise ProducerError(
                f"ordered events need a READ COMMITTED transaction, this one is {level}: the "
                "head of an ordering key is decided under the key lock, which a snapshot taken "
                "earlier cannot see (DESIGN invariant 9); enqueue unordered events or use "
                "read committed for this transaction"
            )

    def insert(self, conn: psycopg.Connection[Any], row: dict[str, Any]) -> int:
        """Insert one validated row in the caller's transaction (no key lock)."""
        return self._run(conn, self.write_plan([row], lock=False))[0]

    def insert_many(self, conn: psycopg.Connection[Any], rows: Sequence[dict[str, Any]]) -> list[int]:
        """Insert validated rows with one statement; ids come back in input order (no key lock)."""
        return self._run(conn, self.write_plan(rows, lock=False))

    @staticmethod
    def _run(conn: psycopg.Connection[Any], plan: WritePlan) -> list[int]:
        """Run a plan's statements on a psycopg connection, each read as its statement says."""
        statement = next(plan)
        while True:
            with conn.cursor(row_factory=statement.row_factory()) as cur:
                rows = cur.execute(statement.query, statement.params).fetchall()
            try:
                statement = plan.send(rows)
            except StopIteration as done:
                ids: list[int] = done.value
                return ids

    @staticmethod
    def _many_params(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return {
            "event_types": [r["event_type"] for r in rows],
            "aggregate_types": [r["aggregate_type"] for r in rows],
            "aggregate_ids": [r["aggregate_id"] for r in rows],
            "payloads": [r["payload"] for r in rows],
            "ordering_keys": [r["ordering_key"] for r in rows],
            "delays": [r["delay"] for r in rows],
            "dedup_keys": [r.get("dedup_key") for r in rows],
            "trace_contexts": [r.get("trace_context") for r in rows],
            "limit_keys": [r.get("limit_key") for r in rows],
        }

    def write_plan(
        self,
        rows: Sequence[dict[str, Any]],
        *,
        lock: bool = True,
        notify: bool = False,
        group: Mapping[str, Any] | None = None,
    ) -> WritePlan:
        """The producer's statements for validated rows, as a plan without I/O.

        Refuses (:class:`~outbox_celery.errors.ProducerError`, before any statement) rows with
        more than :data:`MAX_ORDERING_KEYS` distinct ordering keys.

        Yields ``(query, params)`` for the key locks (invariant 9), then the insert, then, when
        a dedup key was already taken, the lookup of the row holding it; the caller executes
        each in its transaction and sends back the rows it returned; the plan returns the ids
        in input order. One plan serves every kind of producer connection (psycopg 3 sync and
        async, psycopg2, SQLAlchemy), so locks and inserts cannot diverge. With ``notify`` the
        insert itself signals the table's listeners (they hear it at commit): no extra
        statement, no extra round trip.

        With ``group`` (the callback's validated row and ``skip_on_dead``, DESIGN invariant 29)
        the rows are a group's members: one statement inserts them and the group's row
        (``group_insert``), whose total is the member rows inserted; a group none of whose rows
        was inserted (all duplicates) is complete at once and its callback enqueued here. The
        plan then returns the group's id first, the members' ids after it.
        """
        keys = [r["ordering_key"] for r in rows if r["ordering_key"] is not None]
        distinct = len(set(keys))
        if lock and distinct > MAX_ORDERING_KEYS:
            raise ProducerError(
                f"{distinct} distinct ordering keys in one enqueue; the limit is {MAX_ORDERING_KEYS}: "
                "each key's lock is held until commit in PostgreSQL's shared lock table "
                "(max_locks_per_transaction x max_connections for the whole server), which a larger "
                "batch can exhaust ('out of shared memory', for every session). Nothing was written; "
                f"split the events into transactions of at most {MAX_ORDERING_KEYS} keys each"
            )
        if keys and lock:
            lock_params = {"table": self.store.quoted, "keys": keys}
            self._check_isolation((yield Statement(self.store._q["lock_keys"], lock_params, LockedRow)))
        wake = {"notify": notify, "table": self.store.quoted}
        group_id: int | None = None
        if group is not None:
            params = {**self._many_params(rows), **wake, **self._group_params(group)}
            got: list[InsertedRow] = yield Statement(self.store._q["group_insert"], params, InsertedRow)
            # The group's row (group_id set), then the members' rows as insert_many returns them.
            [head] = [r for r in got if r.group_id is not None]
            group_id, total = int(head.group_id or 0), int(head.total or 0)
            inserted = [r for r in got if r.group_id is None]
            if total == 0:
                empty = {"group_id": group_id, "table": wake["table"]}
                yield Statement(self.store._q["group_fire_empty"], empty)
        elif len(rows) == 1:
            params = {"dedup_key": None, "trace_context": None, "limit_key": None, **rows[0], **wake}
            inserted = yield Statement(self.store._q["insert"], params, InsertedRow)
        else:
            params = {**self._many_params(rows), **wake}
            inserted = yield Statement(self.store._q["insert_many"], params, InsertedRow)
        ids = yield from self._answer(rows, inserted, lock=lock)
        return ids if group_id is None else [group_id, *ids]

    def _answer(
        self, rows: Sequence[dict[str, Any]], inserted: Sequence[InsertedRow], *, lock: bool
    ) -> WritePlan:
        """The write plan's tail: the ids of ``rows`` in input order from what the insert
        returned, a taken dedup key answered by the row holding it, and the heads of keys whose
        first row was dropped as a duplicate settled (invariant 9)."""
        # The insert returns every row it wrote: each event's own row (payload_of NULL) and its
        # other subscriptions' rows (invariant 28), which answer nothing here. Identity values
        # are drawn in input order (ORDER BY n), so sorting the ids of the events' rows without
        # a dedup key restores their input order.
        owners = [r for r in inserted if r.payload_of is None]
        plain = iter(sorted(int(r.id or 0) for r in owners if r.dedup_key is None))
        by_key = {r.dedup_key: int(r.id or 0) for r in owners if r.dedup_key is not None}
        missing = sorted({k for r in rows if (k := r.get("dedup_key")) is not None} - by_key.keys())
        if missing:
            # Taken before (or by a concurrent producer that committed while we waited on its
            # row): the row that holds the key answers, and nothing new was written for it.
            found: list[DedupRow] = yield Statement(self.store._q["dedup_ids"], {"keys": missing}, DedupRow)
            by_key.update({r.dedup_key: int(r.id) for r in found})
        if lock and len(owners) < len(rows):
            # Some rows were dropped as duplicates: a dedup key taken before, or one shared by
            # two rows of this batch (the later one is dropped). A dropped row may have been
            # its ordering key's head candidate: hand every such key's head to its lowest
            # unfinished message, still under the key lock (a no-op where the head is right).
            # Keys whose first row in the batch carries no dedup key cannot have lost it.
            first: dict[str, dict[str, Any]] = {}
            for r in rows:
                if r["ordering_key"] is not None:
                    first.setdefault(r["ordering_key"], r)
            unsettled = {k for k, r in first.items() if r.get("dedup_key") is not None}
            # A subscription's rows carry its own key ("<key>" chr(31) route, invariant 28).
            stored = {
                r.ordering_key
                for r in inserted
                if r.ordering_key is not None and r.ordering_key.partition(KEY_SEPARATOR)[0] in unsettled
            }
            if unsettled:
                yield Statement(self.store._q["settle_heads"], {"keys": sorted(unsettled | stored)})
        gone = sorted({r["dedup_key"] for r in rows if r.get("dedup_key") is not None} - by_key.keys())
        if gone:
            # Only a purge between our insert and the lookup (or a REPEATABLE READ snapshot that
            # cannot see the holder) gets here; the transaction can be retried.
            raise ProducerError(f"dedup key(s) {gone} are held by rows this transaction cannot see; retry")
        ids = [next(plain) if r.get("dedup_key") is None else by_key[r["dedup_key"]] for r in rows]
        return ids

    def _group_params(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """The parameters of ``group_insert`` beyond the members': the callback and its rule."""
        then = group["then"]
        return {
            "group_table": self.store.table.identifier(_sql.GROUP_SUFFIX).as_string(None),
            "skip_on_dead": bool(group["skip_on_dead"]),
            "then_event_type": then["event_type"],
            "then_aggregate_type": then["aggregate_type"],
            "then_aggregate_id": then["aggregate_id"],
            "then_payload": then["payload"],
            "then_delay": then["delay"],
            "then_limit_key": then.get("limit_key"),
            "then_trace_context": then.get("trace_context"),
        }
