"""Retention: what deletes finished rows (``purge_done``) and what keeps VACUUM from cleaning
the row versions they leave (``horizon``).

Done rows stay until the retention task (or ``outbox-celery purge``) deletes them in short
batches; the dead row versions that leaves are removed by VACUUM once no snapshot needs them,
so a long transaction, a prepared transaction or a replication slot that holds the xmin horizon
lets the table grow (DESIGN invariant 18).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any, NamedTuple

import psycopg

from ..errors import AdminError, seconds
from ..table import TableName
from ._queries import outside_transaction, q, value, values
from .durations import format_duration
from .flow import prune_flow_keys
from .groups import purge_groups

__all__ = ["count_purgeable", "cutoff", "purge_done"]

logger = logging.getLogger(__name__)


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
