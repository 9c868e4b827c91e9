"""outbox_celery.inbox: the receiver's idempotency keys, recorded in the effect's transaction,
so each key has one effect however often (and however concurrently) it is delivered.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from outbox_celery import ProducerError, inbox
from outbox_celery.db.migrations import applied_versions, available, migrate

from .helpers import Connect
from .producer_kinds import SYNC_KINDS

TABLE = "receiver.inbox"


@pytest.fixture
def inbox_conn(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """An autocommit connection with a migrated inbox and an effect table."""
    assert inbox.migrate_inbox(conn, TABLE) == [m.version for m in available(inbox.INBOX)]
    conn.execute("CREATE TABLE receiver.effects (key text, n int)")
    return conn


def _effects(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return conn.execute("SELECT key, n FROM receiver.effects ORDER BY key, n").fetchall()


def _shape(conn: psycopg.Connection[Any], table: str) -> dict[str, Any]:
    columns = conn.execute(
        "SELECT attname, format_type(atttypid, atttypmod), attnotnull FROM pg_attribute"
        " WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        [table],
    ).fetchall()
    indexes = conn.execute(
        "SELECT replace(pg_get_indexdef(indexrelid), %s, '<t>') FROM pg_index WHERE indrelid = %s::regclass",
        [table, table],
    ).fetchall()
    checks = conn.execute(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = %s::regclass ORDER BY 1",
        [table],
    ).fetchall()
    return {
        "columns": columns,
        "indexes": sorted(str(r[0]).split(" ON ")[1] for r in indexes),
        "checks": checks,
    }


def test_the_inbox_migrates_with_its_own_ledger_and_replay_equals_fresh(
    inbox_conn: psycopg.Connection[Any],
) -> None:
    conn = inbox_conn
    versions = [m.version for m in available(inbox.INBOX)]
    assert applied_versions(conn, TABLE, migrations=inbox.INBOX) == versions
    assert inbox.migrate_inbox(conn, TABLE) == []
    # Its own ledger: the outbox's knows nothing of it, and an outbox of the same name migrates.
    assert applied_versions(conn, TABLE) == []
    assert conn.execute(
        "SELECT to_regclass('receiver.outbox_celery_inbox_migrations') IS NOT NULL"
    ).fetchone() == (True,)
    assert migrate(conn, "receiver.replayed", fresh_schema=False, migrations=inbox.INBOX) == versions
    assert _shape(conn, "receiver.replayed") == _shape(conn, TABLE)


def test_a_key_has_its_effect_once_and_a_rolled_back_key_is_free(inbox_conn: psycopg.Connection[Any]) -> None:
    conn = inbox_conn

    def deliver(key: str, n: int) -> bool:
        with conn.transaction():
            return inbox.apply_once(
                conn,
                key,
                lambda: conn.execute("INSERT INTO receiver.effects VALUES (%s, %s)", [key, n]),
                event_type="order.paid",
                table=TABLE,
            )

    assert deliver("outbox:1", 1) is True
    assert deliver("outbox:1", 2) is False
    with pytest.raises(RuntimeError), conn.transaction():
        assert inbox.first_time(conn, "outbox:2", table=TABLE)
        raise RuntimeError("the effect failed")
    assert deliver("outbox:2", 3) is True
    with conn.transaction():
        assert inbox.first_time(conn, "outbox:3", table=TABLE) is True
        assert inbox.first_time(conn, "outbox:3", table=TABLE) is False, "earlier in this transaction"
    assert _effects(conn) == [("outbox:1", 1), ("outbox:2", 3)]
    assert conn.execute(
        "SELECT event_type FROM receiver.inbox WHERE idempotency_key = 'outbox:1'"
    ).fetchone() == ("order.paid",)


def test_autocommit_and_bad_keys_are_refused(inbox_conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(ProducerError, match="autocommit"):
        inbox.first_time(inbox_conn, "k", table=TABLE)
    with inbox_conn.transaction(), pytest.raises(ProducerError, match="must not be empty"):
        inbox.first_time(inbox_conn, " ", table=TABLE)
    assert inbox_conn.execute("SELECT count(*) FROM receiver.inbox").fetchone() == (0,)


@pytest.mark.parametrize("first_rolls_back", [False, True], ids=["all-commit", "first-rolls-back"])
def test_eight_concurrent_deliveries_of_one_key_have_one_effect(
    inbox_conn: psycopg.Connection[Any], connect: Connect, first_rolls_back: bool
) -> None:
    n = 8
    barrier = threading.Barrier(n)
    first_in = threading.Event()
    results: dict[int, Any] = {}
    conns = [connect() for _ in range(n)]

    def delivery(i: int) -> None:
        c = conns[i]
        try:
            barrier.wait(10)
            if i != 0:
                first_in.wait(10)  # delivery 0 holds the key, uncommitted
            with c.transaction(force_rollback=first_rolls_back and i == 0):
                results[i] = inbox.apply_once(
                    c,
                    "outbox:9",
                    lambda: c.execute("INSERT INTO receiver.effects VALUES ('outbox:9', %s)", [i]),
                    table=TABLE,
                )
                if i == 0:
                    first_in.set()
                threading.Event().wait(0.3)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=delivery, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(isinstance(r, BaseException) for r in results.values()), results
    effects = _effects(inbox_conn)
    assert len(effects) == 1, effects
    (winner,) = [i for i, applied in results.items() if applied and not (first_rolls_back and i == 0)]
    assert effects == [("outbox:9", winner)]
    assert (winner == 0) is not first_rolls_back


def test_retention_purges_old_keys_only_and_a_purged_key_applies_again(
    inbox_conn: psycopg.Connection[Any],
) -> None:
    conn = inbox_conn
    with conn.transaction():
        for key in ("old-1", "old-2", "new"):
            inbox.first_time(conn, key, table=TABLE)
    conn.execute(
        "UPDATE receiver.inbox SET processed_at = now() - interval '8 days'"
        " WHERE idempotency_key LIKE 'old-%'"
    )
    assert inbox.purge_inbox(conn, older_than=7 * 86400, table=TABLE, batch_size=1) == 2
    assert conn.execute("SELECT idempotency_key FROM receiver.inbox").fetchall() == [("new",)]
    with conn.transaction():
        assert inbox.first_time(conn, "old-1", table=TABLE) is True
        assert inbox.first_time(conn, "new", table=TABLE) is False
    with conn.transaction(), pytest.raises(inbox.InboxError):
        inbox.purge_inbox(conn, older_than=1, table=TABLE)


@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_every_connection_kind_records_in_its_transaction(
    kind: str, inbox_conn: psycopg.Connection[Any], migrated_dsn: str
) -> None:
    with SYNC_KINDS[kind](migrated_dsn) as h:
        assert inbox.first_time(h.conn, "k", table=TABLE) is True
        h.rollback()
        assert inbox.first_time(h.conn, "k", table=TABLE) is True
        h.commit()
        assert inbox.first_time(h.conn, "k", table=TABLE) is False
        h.rollback()
    assert inbox_conn.execute("SELECT count(*) FROM receiver.inbox").fetchone() == (1,)


def test_invariant_11_a_receiver_that_stored_old_keys_skips_a_redelivery_under_the_new_key(
    inbox_conn: psycopg.Connection[Any],
) -> None:
    # Keys gained the sending table's identity. A message applied under its old key
    # ("public.outbox:7") and redelivered after the upgrade under the new one is skipped when the
    # receiver passes the old key as previous_key; a message new to it applies once.
    c = inbox_conn
    with c.transaction():
        assert inbox.first_time(c, "public.outbox:7", table=TABLE)
    with c.transaction():
        assert not inbox.first_time(c, "uuid-a/public.outbox:7", table=TABLE, previous_key="public.outbox:7")
    with c.transaction():
        assert inbox.first_time(c, "uuid-a/public.outbox:8", table=TABLE, previous_key="public.outbox:8")
    for key, previous in [("uuid-a/public.outbox:8", "public.outbox:8"), ("public.outbox:8", None)]:
        with c.transaction():
            assert not inbox.first_time(c, key, table=TABLE, previous_key=previous)
