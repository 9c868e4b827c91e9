"""The receiving side's half of exactly-once effects: an inbox of idempotency keys.

The outbox delivers at least once (DESIGN invariant 11): a receiver may see a message twice.
It gets exactly-once *effects* by recording the message's idempotency key in the same
transaction as the effect, and applying the effect only the first time::

    from outbox_celery import inbox

    inbox.migrate_inbox(conn, "receiver.inbox")          # once, at deploy (own ledger)

    with conn.transaction():                              # the receiver's own transaction
        if inbox.first_time(conn, key, table="receiver.inbox"):
            apply_the_effect(conn)                        # same transaction
    # or: inbox.apply_once(conn, key, lambda: apply_the_effect(conn), table=...)

Committed together or not at all: a redelivery after a commit finds the key and does nothing;
after a rollback (or a crash) it applies the effect then. Concurrent deliveries of one key
serialize on the key: the second waits for the first transaction and skips when it committed.

Connections: the same kinds as :func:`~outbox_celery.enqueue` (psycopg 3, psycopg2, SQLAlchemy
``Session``/``Connection``), in a transaction (autocommit is refused: the key would commit apart
from the effect). Retention: :func:`purge_inbox` deletes keys older than a given age; a
redelivery arriving after its key was purged would apply the effect again, so keep keys longer
than the sender can redeliver (for an outbox sender: well beyond ``max_attempts`` retries with
backoff and ``max_defer_age``; days, not minutes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import psycopg
from psycopg import pq, sql

from .db import migrations
from .db import statements as _sql
from .errors import InboxError as InboxError
from .produce.connections import sync_view
from .produce.enqueue import check_transaction, checked_text
from .produce.writes import Statement
from .table import TableName

__all__ = ["DEFAULT_TABLE", "INBOX", "apply_once", "first_time", "migrate_inbox", "purge_inbox"]

logger = logging.getLogger(__name__)

DEFAULT_TABLE = "outbox_inbox"
MAX_KEY_LENGTH = 400


#: The inbox's migrations, fresh schema and ledger (``outbox_celery_inbox_migrations``), run by
#: the same runner as the outbox's (:func:`outbox_celery.db.migrations.migrate`).
INBOX = migrations.MigrationSet(
    "inbox/migrations", "inbox/schema.sql", "outbox_celery_inbox_migrations", _sql.compose
)


def _queries(table: str) -> Mapping[str, sql.Composed]:
    return _sql.queries("inbox/queries.sql", TableName.parse(table))


def migrate_inbox(conn: psycopg.Connection[Any], table: str | TableName = DEFAULT_TABLE) -> list[int]:
    """Create or upgrade the inbox table (idempotent); return the versions applied now."""
    return migrations.migrate(conn, table, migrations=INBOX)


def first_time(
    conn: Any,
    key: str,
    *,
    event_type: str | None = None,
    table: str | TableName = DEFAULT_TABLE,
    previous_key: str | None = None,
) -> bool:
    """Record ``key`` in ``conn``'s current transaction; ``True`` the first time.

    ``True``: apply the message's effect now, in this same transaction. ``False``: the key was
    recorded by a committed transaction (or earlier in this one): skip the effect.

    :param key: the message's idempotency key (``Message.idempotency_key``, an
        ``Idempotency-Key`` header); 1-400 characters.
    :param event_type: stored with the key, for people reading the table.
    :param previous_key: the key the same message had before (``Message.legacy_idempotency_key``:
        the sender's keys gained its table's identity with migration 0006). Recorded too, and if it was
        recorded already (the effect was applied under the old key) this returns ``False``.
        Pass it for as long as the sender may redeliver a message it first sent under the old
        key (see the module docstring for how long that is).
    :raises ProducerError: bad key, unsupported connection, or no transaction.
    """
    key = checked_text(key, "idempotency key", MAX_KEY_LENGTH)
    view = sync_view(conn)
    check_transaction(view, allow_autocommit=False)
    query = _queries(str(TableName.parse(table)))["record"]
    new = bool(view.fetch(Statement(query, {"key": key, "event_type": event_type})))
    if new and previous_key is not None and previous_key != key:
        # Recorded, not merely looked up: a concurrent delivery under the old key waits for
        # this transaction and then skips, exactly as for one key.
        previous = checked_text(previous_key, "previous idempotency key", MAX_KEY_LENGTH)
        new = bool(view.fetch(Statement(query, {"key": previous, "event_type": event_type})))
    return new


def apply_once(
    conn: Any,
    key: str,
    effect: Callable[[], object],
    *,
    event_type: str | None = None,
    table: str | TableName = DEFAULT_TABLE,
    previous_key: str | None = None,
) -> bool:
    """Call ``effect()`` only if ``key`` is new (see :func:`first_time`); whether it was called.

    ``effect`` runs in the caller's transaction; if it raises, roll that transaction back (the
    ``with conn.transaction()`` block does) and the key is not recorded either.
    """
    if not first_time(conn, key, event_type=event_type, table=table, previous_key=previous_key):
        return False
    effect()
    return True


def purge_inbox(
    conn: psycopg.Connection[Any],
    *,
    older_than: float,
    table: str | TableName = DEFAULT_TABLE,
    batch_size: int = 5000,
) -> int:
    """Delete keys recorded more than ``older_than`` seconds ago (database clock); return how many.

    Each batch is its own short transaction, so ``conn`` must not be inside one. A redelivery
    of a purged key applies its effect again: see the module docstring for a safe age.
    """
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        raise InboxError("purge_inbox runs each batch in its own transaction; pass a connection outside one")
    if isinstance(older_than, bool) or not isinstance(older_than, int | float) or not older_than >= 0:
        raise InboxError(f"older_than must be a number of seconds >= 0, got {older_than!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InboxError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    query = _queries(str(TableName.parse(table)))["purge_batch"]
    total = 0
    while True:
        with conn.transaction():
            n = conn.execute(query, {"older_than": float(older_than), "limit": batch_size}).rowcount
        total += n
        if n < batch_size:
            break
    if total:
        logger.info(
            "inbox purge: deleted %s key(s)", total, extra={"deleted": total, "inbox_table": str(table)}
        )
    return total
