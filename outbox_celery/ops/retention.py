"""Retention: what deletes finished rows (``purge_done``) and what keeps VACUUM from cleaning
the row versions they leave (``horizon``).

Done rows stay until the retention task (or ``outbox-celery purge``) deletes them in short
batches; the dead row versions that leaves are removed by VACUUM once no snapshot needs them,
so a long transaction, a prepared transaction or a replication slot that holds the xmin horizon
lets the table grow (DESIGN invariant 18).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

import psycopg
from psycopg.rows import dict_row

from .._seconds import seconds
from ..config import TableName
from ..errors import AdminError
from ._queries import outside_transaction, q, regclass, value, values
from .durations import format_duration
from .flow import prune_flow_keys
from .groups import purge_groups

__all__ = ["Horizon", "count_purgeable", "cutoff", "horizon", "purge_done"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Horizon:
    """What holds back the database's xmin horizon, and the outbox table's dead row versions.

    While a transaction, prepared transaction, replication slot or standby holds the horizon,
    VACUUM removes no dead row version anywhere in the database; the claim keeps its cost
    bounded regardless (DESIGN invariant 18), but the table grows until it is released.

    :ivar kind: ``transaction``, ``prepared transaction``, ``replication slot`` or
        ``standby feedback``; ``None`` when nothing visible holds a snapshot.
    :ivar name: its pid, gid or slot name.
    :ivar application: the session's ``application_name`` (a slot's plugin, a prepared
        transaction's owner).
    :ivar state: the session's state (``idle in transaction``, ``active``...).
    :ivar seconds: how long its transaction has been open (``None`` for slots and standbys).
    :ivar xid_age: how many transaction ids old the snapshot it holds is.
    :ivar dead_row_versions: the outbox table's dead row versions (PostgreSQL's statistics).
    :ivar live_row_versions: its live row versions.
    :ivar last_vacuum_age: seconds since its last vacuum or autovacuum (``None``: never).
    """

    kind: str | None
    name: str | None
    application: str | None
    state: str | None
    seconds: float | None
    xid_age: int | None
    dead_row_versions: int
    live_row_versions: int
    last_vacuum_age: float | None

    def holder(self) -> str:
        """The oldest holder in a phrase (``"none"`` when nothing holds it)."""
        if self.kind is None:
            return "none"
        what = f"{self.kind} {self.name}"
        if self.application:
            what += f" ({self.application})"
        if self.state:
            what += f", {self.state}"
        if self.seconds is not None:
            what += f", open {format_duration(self.seconds)}"
        return what

    def held_for_long(self, threshold: float) -> bool:
        """Whether something has held the horizon long enough for a human to look: a snapshot
        open ``threshold`` seconds or more, or a replication slot nobody consumes (it holds the
        horizon until it is dropped)."""
        if self.kind is None:
            return False
        if self.seconds is not None:
            return self.seconds >= threshold
        return self.state == "inactive"


def horizon(conn: psycopg.Connection[Any], table: str | TableName = "outbox") -> Horizon:
    """What holds the xmin horizon back, and ``table``'s dead row versions (see :class:`Horizon`)."""
    t = TableName.parse(table)
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(q(t, "horizon"), {"table": regclass(conn, t)}).fetchone()
    assert row is not None
    return Horizon(
        kind=row["kind"],
        name=row["name"],
        application=row["application"],
        state=row["state"],
        seconds=row["seconds"],
        xid_age=None if row["xid_age"] is None else int(row["xid_age"]),
        dead_row_versions=int(row["dead_row_versions"] or 0),
        live_row_versions=int(row["live_row_versions"] or 0),
        last_vacuum_age=row["last_vacuum_age"],
    )


def cutoff(conn: psycopg.Connection[Any], table: str | TableName, older_than: float) -> datetime:
    """The database's ``now()`` less ``older_than`` seconds: fixed once per purge run."""
    older_than = seconds(older_than, "older_than", error=AdminError)
    when: datetime = value(conn, q(table, "purge_cutoff"), {"older_than": older_than})
    return when


def count_purgeable(conn: psycopg.Connection[Any], table: str | TableName, *, older_than: float) -> int:
    """How many ``done`` rows finished more than ``older_than`` seconds ago (a dry run)."""
    n = value(conn, q(table, "purge_count"), {"cutoff": cutoff(conn, table, older_than)})
    return int(n or 0)


class _Batch(NamedTuple):
    """One purge batch: the rows it locked, and those it deleted."""

    locked: int
    deleted: int


def _purge_batch(
    conn: psycopg.Connection[Any], table: str | TableName, *, cutoff: datetime, limit: int
) -> _Batch:
    """One batch of :func:`purge_done`, in the caller's transaction (read committed).

    Two statements: lock the candidates, then delete those no unfinished row reads, judged by a
    snapshot taken after the locks. One statement would judge by a snapshot taken before them,
    and a replay that committed a row reading an owner in between would lose that payload.
    """
    ids = [int(i) for i in values(conn, q(table, "purge_batch"), {"cutoff": cutoff, "limit": limit})]
    if not ids:
        return _Batch(0, 0)
    deleted = conn.execute(q(table, "purge_delete"), {"cutoff": cutoff, "ids": ids}).rowcount
    return _Batch(len(ids), deleted)


def purge_done(
    conn: psycopg.Connection[Any],
    table: str | TableName,
    *,
    older_than: float,
    batch_size: int,
    max_batches: int | None = None,
) -> int:
    """Delete ``done`` rows older than ``older_than`` seconds in batches; return rows deleted.

    Only ``done`` rows whose ``done_at`` is before ``now() - older_than`` (fixed when the run
    starts) are deleted; pending, processing and dead rows are never touched. Each batch of at
    most ``batch_size`` rows is its own short transaction (``FOR UPDATE SKIP LOCKED``, so two
    purges never wait on each other), hence ``conn`` must not be inside a transaction. A row
    whose payload another subscription's unfinished row reads stays (DESIGN invariant 28), and
    so does one a replay is pointing new rows at (``subscriptions add --replay-since``): a
    later run deletes it.
    ``max_batches`` bounds the run; the next run continues. Then the per-key flow state
    worth nothing any more goes too (:func:`~outbox_celery.ops.flow.prune_flow_keys`), and the
    groups closed before the cutoff (:func:`~outbox_celery.ops.groups.purge_groups`), neither
    counted in the result.
    """
    outside_transaction(conn, "purge")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise AdminError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    before = cutoff(conn, table, older_than)
    total = batches = 0
    while max_batches is None or batches < max_batches:
        with conn.transaction():
            # purge_delete's snapshot must be taken after purge_batch's locks, which only read
            # committed does, whatever the server's default_transaction_isolation.
            conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            batch = _purge_batch(conn, table, cutoff=before, limit=batch_size)
        total += batch.deleted
        batches += 1
        if batch.locked < batch_size:
            break
    prune_flow_keys(conn, table, batch_size=batch_size, max_batches=max_batches)
    purge_groups(conn, table, cutoff=before, batch_size=batch_size, max_batches=max_batches)
    if total:
        logger.info(
            "outbox purge: deleted %s done row(s) older than %s in %s batch(es)",
            total,
            format_duration(older_than),
            batches,
            extra={
                "outcome": "purged",
                "deleted": total,
                "batches": batches,
                "outbox_table": str(TableName.parse(table)),
            },
        )
    return total
