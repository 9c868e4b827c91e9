"""Operator-side queries against a real PostgreSQL: stats, dead letters, retention."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg import sql
from support import steps

from outbox_celery import Store, TableName, ops
from outbox_celery.app.outbox import Outbox
from outbox_celery.ops import _queries
from outbox_celery.produce.writes import ProducerWrites

from .helpers import LONG, PAST_SHORT, SHORT, Connect, add, claim_ids, count, fetch, fetch_all, stable


def _set(conn: psycopg.Connection[Any], table: str, ids: list[int], assignments: str) -> None:
    """``UPDATE table SET <assignments> WHERE id = ANY(ids)``; assignments are written by the test."""
    query = sql.SQL("UPDATE {} SET " + assignments + " WHERE id = ANY(%s)").format(
        TableName.parse(table).identifier()
    )
    conn.execute(query, [ids])


def _kill(
    store: Store, conn: psycopg.Connection[Any], outbox_id: int, error: str = "PermanentError: 410"
) -> None:
    """Take ``outbox_id`` through a real claim, start and dead finalize."""
    row = fetch(conn, store.table.qualified, outbox_id)
    result = steps.claim(
        store, conn, limit=50, lease=LONG, owner="t", max_attempts=5, event_types=[row["event_type"]]
    )
    claimed = {c.id: c for c in result.claimed}
    assert outbox_id in claimed, f"{outbox_id} was not claimable"
    others = [c for c in result.claimed if c.id != outbox_id]
    steps.release(store, conn, others)
    c = claimed[outbox_id]
    assert steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5) is not None
    assert steps.dead(store, conn, c.id, c.lease_version, error=error)


def _claim_of(store: Store, conn: psycopg.Connection[Any], event_type: str, lease: float) -> int:
    result = steps.claim(
        store, conn, limit=1, lease=lease, owner="t", max_attempts=5, event_types=[event_type]
    )
    assert len(result.claimed) == 1
    return result.claimed[0].id


# -- durations ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("7d", 7 * 86400),
        ("12h", 12 * 3600),
        ("30m", 1800),
        ("45s", 45),
        ("1w", 7 * 86400),
        ("1h30m", 5400),
        ("1.5h", 5400),
        (" 2D ", 2 * 86400),
        ("0s", 0),
    ],
)
def test_durations_parse(text: str, seconds: float) -> None:
    assert ops.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "7", "7x", "d7", "-1d", "1y", "7 d", "1h-30m", "abc", "1e3s"])
def test_malformed_durations_are_refused_with_one_line(text: str) -> None:
    with pytest.raises(ValueError, match="malformed duration") as info:
        ops.parse_duration(text)
    assert "\n" not in str(info.value)


# -- stats -------------------------------------------------------------------------------------


def test_stats_reports_every_status_age_lease_key_and_event_type(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    ready = add(conn, 3, table=table, event_type="order.created")
    _set(
        conn,
        table,
        ready[:1],
        "created_at = now() - interval '100 seconds', available_at = now() - interval '90 seconds'",
    )
    add(conn, 2, table=table, event_type="order.created", delay=3600)
    k1 = add(conn, 3, table=table, event_type="invoice.sent", key="k1")
    k2 = add(conn, 2, table=table, event_type="invoice.sent", key="k2")
    _kill(store, conn, k1[0])
    # k2's head was claimed along with k1's and released by _kill: pending and ready again.
    assert [fetch(conn, table, i)["status"] for i in k2] == ["pending", "pending"]
    # The long lease first: a later claim would take the short one back once it expired.
    live = _claim_of_new(store, conn, table, "mail.sent", LONG)
    expired = _claim_of_new(store, conn, table, "mail.sent", SHORT)
    _set(conn, table, [live], "created_at = now() - interval '50 seconds'")
    done = add(conn, 4, table=table, event_type="mail.sent")
    _set(conn, table, done, "status = 'done', done_at = now()")
    time.sleep(PAST_SHORT)

    s = ops.stats(conn, table, handlers={"order.created", "mail.sent"})

    assert s.counts == {"pending": 9, "processing": 2, "done": 4, "dead": 1}
    assert s.dead == 1
    # ready: 3 unordered due + the head of k2; k1's two wait behind a dead head, k2's second
    # behind its head; 2 are scheduled an hour ahead.
    assert s.ready == 4
    assert s.scheduled == 2
    assert s.oldest_pending_age is not None and 100 <= s.oldest_pending_age < 160
    assert s.oldest_ready_wait is not None and 90 <= s.oldest_ready_wait < 150
    assert s.oldest_processing_age is not None and 50 <= s.oldest_processing_age < 110
    assert s.expired_leases == 1
    assert (s.blocked_keys, s.blocked_messages) == (1, 2)
    by_type = {e.event_type: e for e in s.event_types}
    assert set(by_type) == {"order.created", "invoice.sent", "mail.sent"}
    inv = by_type["invoice.sent"]
    assert (inv.pending, inv.ready, inv.processing, inv.dead) == (4, 1, 0, 1)
    assert inv.has_handler is False
    order = by_type["order.created"]
    assert (order.pending, order.ready, order.processing, order.dead) == (5, 3, 0, 0)
    assert order.oldest_pending_age is not None and order.oldest_pending_age >= 100
    mail = by_type["mail.sent"]
    assert (mail.pending, mail.processing, mail.dead, mail.oldest_pending_age) == (0, 2, 0, None)
    assert s.unroutable == ["invoice.sent"]
    hist = {a.attempts: (a.pending, a.processing, a.dead) for a in s.attempts}
    assert hist == {0: (9, 2, 0), 1: (0, 0, 1)}
    assert expired != live


def _claim_of_new(
    store: Store, conn: psycopg.Connection[Any], table: str, event_type: str, lease: float
) -> int:
    [i] = add(conn, table=table, event_type=event_type)
    assert _claim_of(store, conn, event_type, lease) == i
    return i


def test_stats_of_an_empty_table_and_without_handlers(conn: psycopg.Connection[Any], table: str) -> None:
    s = ops.stats(conn, table)
    assert s.counts == {"pending": 0, "processing": 0, "done": 0, "dead": 0}
    assert (s.oldest_pending_age, s.oldest_ready_wait, s.oldest_processing_age) == (None, None, None)
    assert s.attempts == [] and s.event_types == []
    assert s.unroutable is None
    assert s.as_dict()["now"] == s.now.isoformat()


@pytest.mark.parametrize("table", ["events.outbox"])
def test_stats_and_purge_on_a_schema_qualified_table(conn: psycopg.Connection[Any], table: str) -> None:
    ids = add(conn, 3, table=table)
    _set(conn, table, ids[:2], "status = 'done', done_at = now() - interval '2 days'")
    assert ops.stats(conn, table).counts == {"pending": 1, "processing": 0, "done": 2, "dead": 0}
    assert ops.purge_done(conn, table, older_than=86400, batch_size=10) == 2
    assert count(conn, table) == 1


def test_operator_queries_are_served_by_the_partial_indexes(
    conn: psycopg.Connection[Any], table: str
) -> None:
    """With sequential scans priced out, no query reads the whole table (history stays cheap)."""
    add(conn, 5, table=table)
    add(conn, 2, table=table, key="k")
    conn.execute("SET enable_seqscan = off")
    params = {
        "after": 0,
        "event_type": None,
        "aggregate_type": None,
        "aggregate_id": None,
        "older_than": None,
        "newer_than": None,
        "limit": 50,
        "cutoff": "2000-01-01",
        "id": 1,
        "ids": [1, 2],
        "cap": ops.DEFAULT_STATS_CAP,
        "table": table,
    }
    for name in ("stats", "dead_list", "dead_count", "show", "purge_count", "purge_batch", "purge_delete"):
        query = _queries.q(table, name)
        text = query.as_string(conn)
        used = {k: v for k, v in params.items() if f"%({k})s" in text}
        plan = "\n".join(r[0] for r in conn.execute(sql.SQL("EXPLAIN ") + query, used).fetchall())
        assert "Seq Scan" not in plan, f"{name} scans the table:\n{plan}"


# -- dead letters ------------------------------------------------------------------------------


def test_list_dead_filters_and_pages(conn: psycopg.Connection[Any], table: str) -> None:
    a = add(conn, 5, table=table, event_type="a.happened")
    b = add(conn, 3, table=table, event_type="b.happened")
    add(conn, 2, table=table, event_type="a.happened")  # stay pending
    _set(conn, table, a + b, "status = 'dead', attempts = 3, last_error = 'boom ' || id")
    _set(conn, table, a[:2], "created_at = now() - interval '3 days'")

    everything = ops.list_dead(conn, table)
    assert [d.id for d in everything] == a + b
    assert everything[0].last_error == f"boom {a[0]}"
    assert ops.count_dead(conn, table) == 8

    assert [d.id for d in ops.list_dead(conn, table, event_type="b.happened")] == b
    assert [d.id for d in ops.list_dead(conn, table, older_than=2 * 86400)] == a[:2]
    assert [d.id for d in ops.list_dead(conn, table, newer_than=86400)] == a[2:] + b
    assert [d.id for d in ops.list_dead(conn, table, aggregate_type="thing", aggregate_id="1")] == [
        a[1],
        b[1],
    ]
    assert ops.count_dead(conn, table, event_type="a.happened", older_than=86400) == 2

    page1 = ops.list_dead(conn, table, limit=3)
    page2 = ops.list_dead(conn, table, limit=3, after=page1[-1].id)
    page3 = ops.list_dead(conn, table, limit=3, after=page2[-1].id)
    assert [d.id for d in page1 + page2 + page3] == a + b
    assert len(page3) == 2


def test_get_message_explains_an_ordered_wait(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    k = add(conn, 3, table=table, key="k")
    _kill(store, conn, k[0])
    head = ops.get_message(conn, table, k[0])
    assert head is not None
    assert (head["status"], head["key_head"], head["waiting_behind"]) == ("dead", k[0], 2)
    assert head["payload"] == {"i": 0}
    assert head["last_error"] == "PermanentError: 410"
    second = ops.get_message(conn, table, k[1])
    assert second is not None
    assert (second["status"], second["key_head"], second["waiting_behind"]) == ("pending", k[0], 1)
    assert second["available_in"] <= 0
    assert ops.get_message(conn, table, 10_000) is None


def test_requeue_resets_attempts_keeps_the_error_and_the_fencing_token(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    _kill(store, conn, i, error="PermanentError: 500 from billing")
    before = fetch(conn, table, i)
    assert ops.requeue(conn, table, [i], reason="billing fixed") == [i]
    row = fetch(conn, table, i)
    assert row["status"] == "pending"
    assert row["attempts"] == 0
    assert row["available_in"] <= 0
    assert row["lease_version"] == before["lease_version"]
    assert row["last_error"] == (
        "requeued by operator: billing fixed (attempts were 1); "
        "previous error: PermanentError: 500 from billing"
    )
    # Claimable again, with a newer fencing token than any earlier claim.
    [c] = steps.claim(store, conn, limit=5, lease=LONG, owner="t", max_attempts=5).claimed
    assert (c.id, c.lease_version) == (i, before["lease_version"] + 1)


def test_requeue_and_skip_are_all_or_nothing(conn: psycopg.Connection[Any], store: Store, table: str) -> None:
    ids = add(conn, 3, table=table)
    _kill(store, conn, ids[0])
    _claim_of(store, conn, "thing.happened", LONG)  # one of the others is now processing
    before = [stable(r) for r in fetch_all(conn, table)]
    with pytest.raises(ops.AdminError, match=r"no message with id 999"):
        ops.requeue(conn, table, [ids[0], 999])
    with pytest.raises(ops.AdminError, match=r"is pending|is processing"):
        ops.requeue(conn, table, ids)
    with pytest.raises(ops.AdminError, match=r"is processing"):
        ops.skip(conn, table, ids, reason="x")
    with pytest.raises(ops.AdminError, match="reason"):
        ops.skip(conn, table, [ids[0]], reason="  ")
    with pytest.raises(ops.AdminError, match="no message ids"):
        ops.requeue(conn, table, [])
    assert [stable(r) for r in fetch_all(conn, table)] == before


def test_skip_of_a_dead_head_unblocks_its_key_and_records_the_reason(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    k = add(conn, 3, table=table, key="k")
    _kill(store, conn, k[0])
    assert claim_ids(store, conn) == []  # the dead head blocks its key
    assert ops.skip(conn, table, [k[0]], reason="customer deleted") == [k[0]]
    row = fetch(conn, table, k[0])
    assert row["status"] == "done" and row["done_at"] is not None
    assert row["last_error"] == (
        "skipped by operator: customer deleted (was dead, attempts 1); previous error: PermanentError: 410"
    )
    assert claim_ids(store, conn) == [k[1]]
    assert ops.stats(conn, table).blocked_keys == 0


def test_requeue_all_moves_forward_in_batches_and_honours_the_event_type(
    conn: psycopg.Connection[Any], table: str
) -> None:
    a = add(conn, 5, table=table, event_type="a.happened")
    b = add(conn, 2, table=table, event_type="b.happened")
    _set(conn, table, a + b, "status = 'dead', attempts = 5")
    assert ops.requeue_all(conn, table, event_type="a.happened", batch_size=2) == 5
    assert count(conn, table, "status = 'pending' AND attempts = 0") == 5
    assert count(conn, table, "status = 'dead' AND event_type = 'b.happened'") == 2
    assert ops.requeue_all(conn, table, batch_size=2) == 2
    assert ops.requeue_all(conn, table) == 0
    assert count(conn, table, "status = 'pending'") == 7


# -- retention ---------------------------------------------------------------------------------


def test_purge_deletes_only_old_done_rows(conn: psycopg.Connection[Any], store: Store, table: str) -> None:
    old_done = add(conn, 7, table=table)
    recent_done = add(conn, 2, table=table)
    others = add(conn, 3, table=table)
    _set(conn, table, old_done, "status = 'done', done_at = now() - interval '8 days'")
    _set(conn, table, recent_done, "status = 'done', done_at = now() - interval '6 days'")
    # Old rows of every other status are never purged, however old.
    _set(conn, table, others, "created_at = now() - interval '30 days'")
    _set(conn, table, others[:1], "status = 'dead'")
    _set(conn, table, others[1:2], "status = 'processing', lease_until = now() + interval '1 minute'")

    assert ops.count_purgeable(conn, table, older_than=7 * 86400) == 7
    assert count(conn, table) == 12  # the count changed nothing
    assert ops.purge_done(conn, table, older_than=7 * 86400, batch_size=3, max_batches=1) == 3
    assert ops.purge_done(conn, table, older_than=7 * 86400, batch_size=3) == 4
    assert ops.purge_done(conn, table, older_than=7 * 86400, batch_size=3) == 0
    remaining = {r["id"]: r["status"] for r in fetch_all(conn, table)}
    assert sorted(remaining) == sorted(recent_done + others)


def test_purge_runs_each_batch_in_its_own_transaction(conn: psycopg.Connection[Any], table: str) -> None:
    """A failure in the third batch leaves the first two committed: no long transaction."""
    ids = add(conn, 6, table=table)
    conn.execute(
        sql.SQL(
            "UPDATE {} SET status = 'done',"
            " done_at = now() - interval '10 days' + make_interval(secs => id::float8)"
        ).format(TableName.parse(table).identifier())
    )
    poison = ids[-1]  # the newest, so it is in the last batch (batches go by done_at)
    conn.execute(
        """
        CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF OLD.id = %s THEN RAISE EXCEPTION 'refused'; END IF;
            RETURN OLD;
        END $$
        """.replace("%s", str(int(poison)))
    )
    conn.execute(
        sql.SQL(
            "CREATE TRIGGER refuse BEFORE DELETE ON {} FOR EACH ROW EXECUTE FUNCTION refuse_delete()"
        ).format(TableName.parse(table).identifier())
    )
    with pytest.raises(psycopg.errors.RaiseException):
        ops.purge_done(conn, table, older_than=86400, batch_size=2)
    assert sorted(r["id"] for r in fetch_all(conn, table)) == ids[4:]


def test_purge_skips_rows_locked_by_someone_else_instead_of_waiting(
    conn: psycopg.Connection[Any], table: str, connect: Connect
) -> None:
    ids = add(conn, 4, table=table)
    _set(conn, table, ids, "status = 'done', done_at = now() - interval '10 days'")
    other = connect()
    locked = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with other.transaction():
            other.execute(
                sql.SQL("SELECT id FROM {} WHERE id = %s FOR UPDATE").format(
                    TableName.parse(table).identifier()
                ),
                [ids[0]],
            )
            locked.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert locked.wait(10)
        assert ops.purge_done(conn, table, older_than=86400, batch_size=10) == 3
    finally:
        release.set()
        t.join(30)
    assert [r["id"] for r in fetch_all(conn, table)] == ids[:1]
    assert ops.purge_done(conn, table, older_than=86400, batch_size=10) == 1


def test_batched_writes_refuse_a_connection_inside_a_transaction(
    conn: psycopg.Connection[Any], table: str
) -> None:
    with conn.transaction():
        with pytest.raises(ops.AdminError, match="not inside a transaction"):
            ops.purge_done(conn, table, older_than=0, batch_size=10)
        with pytest.raises(ops.AdminError, match="not inside a transaction"):
            ops.requeue_all(conn, table)


def test_retention_task_purges_per_config_and_is_scheduled_by_default(
    conn: psycopg.Connection[Any], migrated_dsn: str, table: str
) -> None:
    ids = add(conn, 5, table=table)
    _set(conn, table, ids[:3], "status = 'done', done_at = now() - interval '2 hours'")
    _set(conn, table, ids[3:4], "status = 'done', done_at = now() - interval '10 minutes'")

    app = Celery("retention-test", broker="memory://", set_as_current=False)
    outbox = Outbox(app, dsn=migrated_dsn, table=table, retention=3600, retention_batch_size=2)
    try:
        assert outbox.config.retention == 3600
        schedule = app.conf.beat_schedule
        assert schedule["outbox-purge"]["task"] == outbox.purge_task.name == "outbox.purge"
        # What the beat-triggered task runs, in this process.
        assert outbox.purge_task.run() == 3
    finally:
        outbox.close()
    assert sorted(r["id"] for r in fetch_all(conn, table)) == ids[3:]

    default = Celery("retention-default", broker="memory://", set_as_current=False)
    assert Outbox(default, dsn=migrated_dsn).config.retention == 7 * 86400
    assert "outbox-purge" in default.conf.beat_schedule
    off = Celery("retention-off", broker="memory://", set_as_current=False)
    assert Outbox(off, dsn=migrated_dsn, retention=None).purge() == 0
    assert "outbox-purge" not in off.conf.beat_schedule


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "-"),
        (0, "0s"),
        (45.9, "45s"),
        (60, "1m"),
        (725, "12m 5s"),
        (7200, "2h"),
        (18720, "5h 12m"),
        (7 * 86400, "7d"),
        (273600, "3d 4h"),
    ],
)
def test_durations_format_for_humans(seconds: float | None, text: str) -> None:
    assert ops.format_duration(seconds) == text


def test_invariant_10_requeue_and_skip_take_expired_processing_rows_and_refuse_live_leases(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    # A task lost for good, or an event type whose handler a deploy removed: the row sits in
    # processing with an expired lease and no worker. The operator can move it; a live lease,
    # which a worker may be running, is refused with one line and nothing changes.
    [lost, skipped, live] = add(conn, 3, table=table)
    expired = steps.claim(store, conn, limit=2, lease=SHORT, owner="t", max_attempts=5).claimed
    assert [c.id for c in expired] == [lost, skipped]
    [held] = steps.claim(store, conn, limit=1, lease=LONG, owner="t", max_attempts=5).claimed
    assert held.id == live
    time.sleep(PAST_SHORT)
    before = [stable(r) for r in fetch_all(conn, table)]
    for action in (
        lambda: ops.requeue(conn, table, [lost, live]),
        lambda: ops.skip(conn, table, [skipped, live], reason="x"),
    ):
        with pytest.raises(ops.AdminError) as refused:
            action()
        message = str(refused.value)
        assert f"message {live} is processing under a live lease" in message
        assert "\n" not in message
    assert [stable(r) for r in fetch_all(conn, table)] == before

    assert ops.requeue(conn, table, [lost], reason="queue fixed") == [lost]
    row = fetch(conn, table, lost)
    assert (row["status"], row["attempts"], row["lease_until"]) == ("pending", 0, None)
    assert row["started_version"] == row["lease_version"] == 1
    assert row["last_error"] == "requeued by operator: queue fixed (attempts were 0)"
    assert ops.skip(conn, table, [skipped], reason="obsolete") == [skipped]
    row = fetch(conn, table, skipped)
    assert row["status"] == "done"
    assert row["last_error"] == "skipped by operator: obsolete (was processing, attempts 0)"
    # The lost tasks, should they still arrive, are stale.
    for c in expired:
        assert steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5) is None
    assert claim_ids(store, conn) == [lost]


def _as_an_old_release(conn: psycopg.Connection[Any], table: str) -> tuple[list[int], list[int]]:
    """Keys left without a head by a producer and a worker of a release before migration 0004.

    Key "old-insert": an old producer inserted its messages (no head flag). Key "old-done": its
    head was finished by an old worker, whose done does not move the flag to the next message.
    """
    t = TableName.parse(table).identifier()
    inserted = [
        int(r[0])
        for r in conn.execute(
            sql.SQL(
                "INSERT INTO {} (event_type, aggregate_type, aggregate_id, payload, ordering_key)"
                " SELECT 'thing.happened', 'thing', 'x', '{{}}', 'old-insert' FROM generate_series(1, 3)"
                " RETURNING id"
            ).format(t)
        )
    ]
    moved = add(conn, 3, table=table, key="old-done")
    conn.execute(
        sql.SQL("UPDATE {} SET status = 'done', done_at = now() WHERE id = %s").format(t), [moved[0]]
    )
    return sorted(inserted), moved


def test_invariant_9_keys_left_without_a_head_are_counted_and_repaired_while_producers_run(
    conn: psycopg.Connection[Any], store: Store, table: str, connect: Connect
) -> None:
    # Such keys were neither ready nor blocked in stats, never claimed, and nothing
    # repaired them.
    healthy = add(conn, 2, table=table, key="healthy")
    inserted, moved = _as_an_old_release(conn, table)
    assert claim_ids(store, conn, lease=LONG) == [healthy[0]]  # in flight throughout
    s = ops.stats(conn, table)
    assert (s.headless_keys, s.blocked_keys, s.ready) == (2, 0, 0)
    # Show names the flagged head, the claim's own definition: such a key has none.
    shown = ops.get_message(conn, table, inserted[1])
    assert shown is not None and shown["key_head"] is None
    # A producer of this release holds key "old-insert"'s lock while the repair runs: the repair
    # waits for it, and then sees its message (flagged or not, the key gets one head only).
    producer = connect()
    with producer.transaction():
        ProducerWrites(store).lock_keys(producer, ["old-insert"])
        repaired: list[list[str]] = []
        repair = threading.Thread(target=lambda: repaired.append(ops.repair_heads(connect(), table)))
        repair.start()
        time.sleep(0.3)
        assert repaired == []  # waiting on the producer's key lock
    repair.join(10)
    assert repaired == [["old-done", "old-insert"]]
    assert ops.stats(conn, table).headless_keys == 0
    assert ops.repair_heads(conn, table) == []
    heads = {r["id"] for r in fetch_all(conn, table) if r["head"] and r["status"] != "done"}
    assert heads == {healthy[0], inserted[0], moved[1]}
    assert sorted(claim_ids(store, conn)) == sorted([inserted[0], moved[1]])


def test_stats_with_a_timeout_inside_the_callers_transaction_leaves_its_statement_timeout_alone(
    conn: psycopg.Connection[Any], table: str
) -> None:
    # The Django changelist runs stats(timeout=2.0) on Django's connection;
    # under ATOMIC_REQUESTS that is inside the request's transaction, where the statement's
    # local statement_timeout (a savepoint does not undo it) stayed for the rest of the request:
    # the list, and an admin action run in the same request, were cut at 2 s.
    add(conn, 3, table=table)
    with conn.transaction():
        conn.execute("SET LOCAL statement_timeout = '45s'")
        assert ops.stats(conn, table, timeout=2.0).counts["pending"] == 3
        assert conn.execute("SHOW statement_timeout").fetchone() == ("45s",)
    assert conn.execute("SHOW statement_timeout").fetchone() == ("0",)
