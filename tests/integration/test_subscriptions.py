"""Subscriptions (DESIGN invariant 28) at the statements' level: the producers' insert fans an
event out to its type's live subscriptions in one statement, the payload stored once; each
subscription has its own rows, routes and order per key; dedup keys, removal, replay and the
purge keep every delivery's payload.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from typing import Any

import psycopg
import pytest
from psycopg import sql
from support import steps

from outbox_celery import Event, Store, TableName, enqueue, enqueue_many
from outbox_celery.claim.marks import ScanMarks
from outbox_celery.db import statements
from outbox_celery.errors import ProducerError
from outbox_celery.ops import console, flow_states, pause, purge_done, resume, retention, stats, subscriptions
from outbox_celery.produce.writes import ProducerWrites

from .helpers import LONG, Connect, fetch_all, lock_waiters

PAID = {"event_type": "order.paid", "aggregate_type": "order", "aggregate_id": "7"}
SINCE = datetime(2000, 1, 1)


def _subscribe(
    conn: psycopg.Connection[Any], table: str, *names: str, event_type: str = "order.paid"
) -> None:
    for name in names:
        subscriptions.add(conn, table, event_type, name)


def _rows(conn: psycopg.Connection[Any], table: str) -> list[dict[str, Any]]:
    return sorted(fetch_all(conn, table), key=lambda r: r["id"])


def _deliver_all(store: Store, conn: psycopg.Connection[Any], route: str | None = None) -> list[Any]:
    """Claim, start and finish (done) everything claimable of ``route``; the messages, in order."""
    got = []
    while True:
        claimed = steps.claim(store, conn, limit=100, lease=LONG, owner="t", max_attempts=5).claimed
        mine = [c for c in claimed if route is None or c.event_type == route]
        if not claimed:
            return got
        steps.release(store, conn, [c for c in claimed if c not in mine])
        for c in mine:
            msg = steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5)
            assert msg is not None
            got.append(msg)
            steps.done(store, conn, c.id, c.lease_version)
        if not mine:
            return got


def test_invariant_28_one_enqueue_writes_one_row_per_subscription_and_the_payload_once(
    conn: psycopg.Connection[Any], table: str, store: Store
) -> None:
    _subscribe(conn, table, "search", "receipt", "analytics")
    with conn.transaction():
        fact = enqueue(conn, payload={"total": "9.90"}, table=table, **PAID)
    rows = _rows(conn, table)
    assert [r["event_type"] for r in rows] == [
        "order.paid@analytics",
        "order.paid@receipt",
        "order.paid@search",
    ]
    owner, *others = rows
    assert fact == owner["id"]
    assert owner["payload"] == {"total": "9.90"} and owner["payload_of"] is None
    assert all(r["payload"] is None and r["payload_of"] == fact for r in others)
    msgs = _deliver_all(store, conn)
    assert sorted((m.event_type, m.subscription, m.payload["total"]) for m in msgs) == [
        ("order.paid", name, "9.90") for name in ("analytics", "receipt", "search")
    ]
    assert {m.route for m in msgs} == {r["event_type"] for r in rows}
    # A type without subscriptions: one row, as always.
    with conn.transaction():
        plain = enqueue(
            conn, payload=1, table=table, event_type="order.created", aggregate_type="o", aggregate_id="1"
        )
    last = _rows(conn, table)[-1]
    assert (last["id"], last["event_type"], last["payload"], last["payload_of"]) == (
        plain,
        "order.created",
        1,
        None,
    )


def test_invariant_28_enqueue_many_fans_out_every_event_in_input_order(
    conn: psycopg.Connection[Any], table: str
) -> None:
    _subscribe(conn, table, "a", "b")
    events = [
        Event("order.paid", {"n": 0}, "order", "1", ordered=True),
        Event("order.created", {"n": 1}, "order", "1", ordered=True),
        Event("order.paid", {"n": 2}, "order", "1", ordered=True),
        Event("order.paid", {"n": 3}, "order", "2", dedup_key="d3"),
    ]
    with conn.transaction():
        ids = enqueue_many(conn, events, table=table)
    rows = _rows(conn, table)
    by_id = {r["id"]: r for r in rows}
    assert [by_id[i]["payload"] for i in ids] == [{"n": 0}, {"n": 1}, {"n": 2}, {"n": 3}]
    assert len(rows) == 7  # 3 order.paid x 2 subscriptions + 1 order.created
    routes = {(r["event_type"], r["ordering_key"]): r for r in rows if r["ordering_key"]}
    # Each subscription orders its own rows of key order:1: the first one is its head.
    heads = sorted((r["event_type"], r["ordering_key"]) for r in rows if r["head"])
    assert heads == [
        ("order.created", "order:1"),
        ("order.paid@a", "order:1\x1forder.paid@a"),
        ("order.paid@b", "order:1\x1forder.paid@b"),
    ]
    assert len(routes) == 3  # keys are per route; two rows each for order.paid@a and @b
    dedup = [r for r in rows if r["aggregate_id"] == "2"]
    assert [r["dedup_key"] for r in dedup] == ["d3", None]
    assert dedup[1]["payload_of"] == dedup[0]["id"]


def test_invariant_28_a_taken_dedup_key_inserts_nothing_for_any_subscription(
    conn: psycopg.Connection[Any], table: str
) -> None:
    _subscribe(conn, table, "a", "b", "c")
    with conn.transaction():
        first = enqueue(conn, payload=1, table=table, dedup_key="k", **PAID)
    with conn.transaction():
        assert enqueue(conn, payload=2, table=table, dedup_key="k", **PAID) == first
        assert enqueue_many(conn, [Event("order.paid", 3, "o", "1", dedup_key="k")], table=table) == [first]
    assert len(_rows(conn, table)) == 3


def test_invariant_28_a_key_blocked_on_one_subscription_does_not_block_the_others(
    conn: psycopg.Connection[Any], table: str, store: Store
) -> None:
    _subscribe(conn, table, "fast", "stuck")
    with conn.transaction():
        for n in range(3):
            enqueue(conn, payload=n, table=table, ordered=True, **PAID)
    # The stuck subscription's head goes dead: its key stays blocked there.
    claimed = steps.claim(store, conn, limit=10, lease=LONG, owner="t", max_attempts=5).claimed
    assert sorted(c.event_type for c in claimed) == ["order.paid@fast", "order.paid@stuck"]
    for c in claimed:
        assert steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5) is not None
        if c.event_type.endswith("stuck"):
            steps.dead(store, conn, c.id, c.lease_version, error="down")
        else:
            steps.done(store, conn, c.id, c.lease_version)
    got = [m.payload for m in _deliver_all(store, conn, "order.paid@fast")]
    assert got == [1, 2]
    assert _deliver_all(store, conn, "order.paid@stuck") == []


def test_invariant_28_a_removed_subscription_gets_nothing_new_and_keeps_its_rows(
    conn: psycopg.Connection[Any], table: str
) -> None:
    _subscribe(conn, table, "a", "gone")
    with conn.transaction():
        enqueue(conn, payload=1, table=table, **PAID)
    assert subscriptions.remove(conn, table, "order.paid", "gone")
    assert not subscriptions.remove(conn, table, "order.paid", "gone")
    with conn.transaction():
        enqueue(conn, payload=2, table=table, **PAID)
    routes = [r["event_type"] for r in _rows(conn, table)]
    assert routes == ["order.paid@a", "order.paid@gone", "order.paid@a"]
    listed = {s.route: s for s in subscriptions.list_subscriptions(conn, table)}
    assert listed["order.paid@gone"].removed_at is not None and listed["order.paid@gone"].pending == 1
    assert listed["order.paid@a"].pending == 2
    # The stats speak per route; a worker without the removed one's handler sees it unroutable.
    shown = stats(conn, table, handlers=["order.paid@a"])
    assert {e.event_type: e.pending for e in shown.event_types} == {"order.paid@a": 2, "order.paid@gone": 1}
    assert "order.paid@gone" in shown.unroutable


def test_invariant_28_a_new_subscription_gets_later_events_unless_it_replays(
    conn: psycopg.Connection[Any], table: str, store: Store
) -> None:
    _subscribe(conn, table, "first")
    with conn.transaction():
        for n in range(5):
            enqueue(conn, payload=n, table=table, ordered=True, **PAID)
    subscriptions.add(conn, table, "order.paid", "late")
    replayed = subscriptions.add(
        conn, table, "order.paid", "replayed", replay_since=datetime(2000, 1, 1), batch_size=2
    )
    assert replayed == ("order.paid@replayed", True, 5)
    with conn.transaction():
        enqueue(conn, payload=5, table=table, ordered=True, **PAID)
    assert [m.payload for m in _deliver_all(store, conn, "order.paid@late")] == [5]
    assert [m.payload for m in _deliver_all(store, conn, "order.paid@replayed")] == [0, 1, 2, 3, 4, 5]
    # Replaying again adds nothing: every fact has its row.
    again = subscriptions.add(conn, table, "order.paid", "replayed", replay_since=datetime(2000, 1, 1))
    assert again == ("order.paid@replayed", False, 0)


def test_invariant_28_the_purge_keeps_a_payload_while_a_subscription_still_needs_it(
    conn: psycopg.Connection[Any], table: str, store: Store
) -> None:
    _subscribe(conn, table, "a", "b")
    with conn.transaction():
        owner = enqueue(conn, payload={"keep": True}, table=table, **PAID)
    assert [m.route for m in _deliver_all(store, conn, "order.paid@a")] == ["order.paid@a"]
    assert purge_done(conn, table, older_than=0, batch_size=10) == 0
    [msg] = _deliver_all(store, conn, "order.paid@b")
    assert msg.payload == {"keep": True} and msg.id != owner
    # Both done: the owner goes with (or after) the row that read it.
    assert purge_done(conn, table, older_than=0, batch_size=10) == 2
    assert _rows(conn, table) == []


def _delivered_facts(conn: psycopg.Connection[Any], table: str, store: Store, n: int = 50) -> list[int]:
    """``n`` events of ``order.paid`` to its one subscription ``a``, all delivered: ``n`` owners
    that the purge may delete, and that a replay may point new rows at."""
    _subscribe(conn, table, "a")
    events = [Event("order.paid", {"n": i}, "order", str(i)) for i in range(n)]
    with conn.transaction():
        ids = enqueue_many(conn, events, table=table)
    assert len(_deliver_all(store, conn)) == n
    return ids


def _orphans(conn: psycopg.Connection[Any], table: str) -> int:
    """Rows whose payload is nowhere: they would fail before their handler, at every attempt."""
    t = TableName.parse(table).identifier()
    query = sql.SQL(
        "SELECT count(*) FROM {t} AS r WHERE r.payload IS NULL"
        " AND NOT EXISTS (SELECT 1 FROM {t} AS w WHERE w.id = r.payload_of)"
    ).format(t=t)
    row = conn.execute(query).fetchone()
    return int(row[0]) if row else 0


def test_invariant_28_a_purge_while_a_replay_is_open_keeps_the_payloads_it_points_at(
    conn: psycopg.Connection[Any], table: str, store: Store, connect: Connect
) -> None:
    # The replay has written its rows and not committed (held open at the point where
    # subscriptions.add makes the subscription live and replays the last facts); a purge runs
    # on another connection. It cannot see the uncommitted rows that read the owners' payloads:
    # the owners must stay anyway, and the purge must not wait for the replay either.
    owners = _delivered_facts(conn, table, store)
    replay = connect()
    with replay.transaction():
        subscriptions._add_row(replay, table, "order.paid", "late")
        replayed, _ = subscriptions._replay(replay, table, "order.paid", "late", SINCE, 0, None, None)
        assert replayed == len(owners)
        assert purge_done(connect(), table, older_than=0, batch_size=100) == 0
    assert _orphans(conn, table) == 0
    got = _deliver_all(store, conn, "order.paid@late")
    assert sorted(m.payload["n"] for m in got) == list(range(len(owners)))
    # Once the replayed rows are done, the owners go with them.
    assert purge_done(conn, table, older_than=0, batch_size=100) == 2 * len(owners)


def test_invariant_28_a_replay_while_a_purge_is_open_skips_the_facts_it_deletes(
    conn: psycopg.Connection[Any], table: str, store: Store, connect: Connect
) -> None:
    # The purge has deleted the owners and not committed; the operator adds a subscription with
    # --replay-since on another connection. The replay reads the facts with its own snapshot,
    # which still holds them: it must wait for the purge, then skip the facts it deleted,
    # rather than write rows whose payload is gone when the purge commits.
    owners = _delivered_facts(conn, table, store)
    purger = connect()
    replayed: list[int] = []
    errors: list[BaseException] = []

    def replay() -> None:
        try:
            added = subscriptions.add(connect(), table, "order.paid", "late", replay_since=SINCE)
            replayed.append(added.replayed)
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    thread = threading.Thread(target=replay)
    with purger.transaction():
        cutoff = retention.cutoff(purger, table, 0)
        assert retention._purge_batch(purger, table, cutoff=cutoff, limit=100).deleted == len(owners)
        thread.start()
        deadline = time.monotonic() + 10
        while thread.is_alive() and lock_waiters(conn) == 0:
            assert time.monotonic() < deadline, "the replay neither ended nor waited"
            time.sleep(0.02)
        waited = lock_waiters(conn) == 1
    thread.join(30)
    assert not errors, errors
    assert _orphans(conn, table) == 0
    assert waited and replayed == [0]
    assert _rows(conn, table) == []


def test_invariant_28_a_worker_role_without_insert_registers_what_a_deploy_step_added(
    conn: psycopg.Connection[Any], table: str
) -> None:
    # Workers register their subscriptions at start; one whose role may only read the
    # subscription table starts once the deploy step (migrate -A, subscriptions sync) added them.
    role = sql.Identifier("outbox_worker_0011")
    subscription_table = TableName.parse(table).identifier(statements.SUBSCRIPTION_SUFFIX)
    routes = ["order.paid@a", "order.paid@b", "order.created"]
    conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(role))
    conn.execute(sql.SQL("CREATE ROLE {}").format(role))
    try:
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(role))
        conn.execute(sql.SQL("GRANT SELECT ON {} TO {}").format(subscription_table, role))
        conn.execute(sql.SQL("SET ROLE {}").format(role))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            subscriptions.register(conn, table, routes)
        conn.execute("RESET ROLE")
        found = subscriptions.declare(conn, table, routes)
        assert [(d.route, d.state) for d in found] == [("order.paid@a", "added"), ("order.paid@b", "added")]
        conn.execute(sql.SQL("SET ROLE {}").format(role))
        assert subscriptions.register(conn, table, routes) == []
    finally:
        conn.execute("RESET ROLE")
        conn.execute(sql.SQL("DROP OWNED BY {}").format(role))
        conn.execute(sql.SQL("DROP ROLE {}").format(role))
    assert [(d.route, d.state) for d in subscriptions.declare(conn, table, routes)] == [
        ("order.paid@a", "exists"),
        ("order.paid@b", "exists"),
    ]


def test_invariant_28_routes_are_refused_where_a_fact_is_expected(
    conn: psycopg.Connection[Any], table: str
) -> None:
    with pytest.raises(ProducerError, match="separates an event type"):
        enqueue(conn, payload=1, table=table, event_type="order.paid@x", aggregate_type="o", aggregate_id="1")
    with pytest.raises(ProducerError, match="unit separator"):
        enqueue(conn, payload=1, table=table, ordering_key="a\x1fb", **PAID)
    t = TableName.parse(table).identifier(statements.SUBSCRIPTION_SUFFIX)
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(sql.SQL("INSERT INTO {} (event_type, name) VALUES ('a', 'b@c')").format(t))


def test_invariant_28_the_cli_lists_adds_replays_and_removes_subscriptions(
    conn: psycopg.Connection[Any], table: str, migrated_dsn: str
) -> None:
    from click.testing import CliRunner

    from outbox_celery.cli import cli

    runner = CliRunner()
    base = ["--dsn", migrated_dsn, "--table", table]

    def run(*args: str) -> str:
        result = runner.invoke(cli, ["subscriptions", *args, *base], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    assert run("list") == "no subscriptions\n"
    assert run("add", "order.paid", "receipt") == "subscription order.paid@receipt added\n"
    with conn.transaction():
        enqueue(conn, payload=1, table=table, **PAID)
    assert "; 1 event(s) replayed" in run("add", "order.paid", "search", "--replay-since", "1h")
    listed = json.loads(run("list", "--json"))
    assert [(s["route"], s["pending"], s["removed_at"]) for s in listed] == [
        ("order.paid@receipt", 1, None),
        ("order.paid@search", 1, None),
    ]
    assert "removed: new events no longer go to it" in run("remove", "order.paid", "search")
    assert "not a live subscription" in run("remove", "order.paid", "search")
    text = run("list")
    assert "order.paid@search" in text and "removed" in text
    bad = runner.invoke(cli, ["subscriptions", "add", "order.paid", "a@b", *base])
    assert bad.exit_code == 1 and "without '@'" in bad.output
    # stats speaks per route.
    stats_text = runner.invoke(cli, ["stats", *base], catch_exceptions=False).output
    assert "order.paid@receipt" in stats_text and "order.paid@search" in stats_text


def test_invariant_28_a_subscription_reads_a_large_payload_beyond_the_start_budget(
    conn: psycopg.Connection[Any], table: str, store: Store
) -> None:
    _subscribe(conn, table, "a", "b", "c")
    big = {"blob": "x" * 20_000}
    with conn.transaction():
        enqueue(conn, payload=big, table=table, **PAID)
    store.completer.inline_bytes = 1000  # every payload read after the start, in chunks
    claimed = steps.claim(store, conn, limit=10, lease=LONG, owner="t", max_attempts=5).claimed
    pairs = [(c.id, c.lease_version) for c in claimed]
    msgs = steps.start_many(store, conn, pairs, lease=LONG, max_attempts=5, starter="w:1:a")
    assert [(m.subscription, m.payload) for m in msgs] == [("a", big), ("b", big), ("c", big)]


def test_invariant_28_a_dropped_duplicate_first_of_a_key_leaves_every_subscription_a_head(
    conn: psycopg.Connection[Any], table: str, store: Store
) -> None:
    _subscribe(conn, table, "a", "b")
    with conn.transaction():
        enqueue(
            conn,
            payload=0,
            table=table,
            dedup_key="taken",
            event_type="order.paid",
            aggregate_type="o",
            aggregate_id="x",
        )
    assert [m.payload for m in _deliver_all(store, conn, "order.paid@a")] == [0]
    assert [m.payload for m in _deliver_all(store, conn, "order.paid@b")] == [0]
    with conn.transaction():
        enqueue_many(
            conn,
            [
                Event("order.paid", 1, "o", "1", ordering_key="k", dedup_key="taken"),
                Event("order.paid", 2, "o", "2", ordering_key="k"),
            ],
            table=table,
        )
    assert [m.payload for m in _deliver_all(store, conn, "order.paid@a")] == [2]
    assert [m.payload for m in _deliver_all(store, conn, "order.paid@b")] == [2]


def test_invariant_28_show_gives_a_subscriptions_row_its_payload(
    conn: psycopg.Connection[Any], table: str
) -> None:
    from outbox_celery.ops import get_message

    _subscribe(conn, table, "a", "b")
    with conn.transaction():
        enqueue(conn, payload={"x": 1}, table=table, ordered=True, **PAID)
    second = _rows(conn, table)[1]
    shown = get_message(conn, table, second["id"])
    assert shown is not None and shown["payload"] == {"x": 1} and shown["event_type"] == "order.paid@b"
    assert shown["key_head"] == second["id"]  # its own key's head


def test_invariant_28_a_subscriptions_ordered_done_and_repair_wait_for_the_producers_key_lock(
    conn: psycopg.Connection[Any], table: str, store: Store, connect: Any
) -> None:
    from outbox_celery.ops import repair_heads

    _subscribe(conn, table, "a", "b")
    with conn.transaction():
        enqueue(conn, payload=1, table=table, ordering_key="k", **PAID)
        enqueue(conn, payload=2, table=table, ordering_key="j", **PAID)
    # Key j of subscription b without its head (as a release before heads left keys).
    t = TableName.parse(table).identifier()
    conn.execute(
        sql.SQL("UPDATE {} SET head = false WHERE ordering_key = %s").format(t), ["j\x1forder.paid@b"]
    )
    claimed = steps.claim(store, conn, limit=10, lease=LONG, owner="t", max_attempts=5).claimed
    c = min(claimed, key=lambda x: x.id)  # key k's head on subscription a
    assert steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5) is not None
    producer = connect()
    with producer.transaction():
        # A producer of key k holds its lock (invariant 9) until it commits.
        ProducerWrites(store).lock_keys(producer, ["k", "j"])
        worker = connect()
        worker.execute("SET lock_timeout = '200ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            steps.done(store, worker, c.id, c.lease_version)
        with pytest.raises(psycopg.errors.LockNotAvailable):
            repair_heads(worker, table)
    assert steps.done(store, worker, c.id, c.lease_version)
    assert repair_heads(worker, table) == ["j\x1forder.paid@b"]


def test_invariant_28_the_metrics_label_a_subscription_by_its_route(
    conn: psycopg.Connection[Any], table: str
) -> None:
    import contextlib

    from outbox_celery.ops.metrics import OutboxCollector

    _subscribe(conn, table, "a", "b")
    with conn.transaction():
        enqueue(conn, payload=1, table=table, **PAID)
    collector = OutboxCollector(lambda: contextlib.nullcontext(conn), table)
    labels = {s.labels.get("event_type") for f in collector.collect() for s in f.samples}
    assert {"order.paid@a", "order.paid@b"} <= labels


def test_invariant_28_pausing_an_event_type_pauses_every_subscription_of_it(
    conn: psycopg.Connection[Any], table: str, store: Store
) -> None:
    _subscribe(conn, table, "a", "b", "gone")
    with conn.transaction():
        enqueue(conn, payload=1, table=table, **PAID)
    subscriptions.remove(conn, table, "order.paid", "gone")  # its row is still claimable
    assert pause(conn, table, "order.paid") is True
    routes = ["order.paid", "order.paid@a", "order.paid@b", "order.paid@gone"]
    assert [f.event_type for f in flow_states(conn, table) if f.paused] == routes
    assert steps.claim(store, conn, limit=10, lease=LONG, owner="t", max_attempts=5).claimed == []
    assert pause(conn, table, "order.paid") is False  # every route was paused already

    assert resume(conn, table, "order.paid") is True
    assert flow_states(conn, table) == []
    claimed = steps.claim(store, conn, limit=10, lease=LONG, owner="t", max_attempts=5).claimed
    assert sorted(c.event_type for c in claimed) == routes[1:]
    steps.release(store, conn, claimed)

    # A route alone pauses that subscription; the type's other routes flow on.
    assert pause(conn, table, "order.paid@a") is True
    claimed = steps.claim(store, conn, limit=10, lease=LONG, owner="t", max_attempts=5).claimed
    assert sorted(c.event_type for c in claimed) == ["order.paid@b", "order.paid@gone"]
    steps.release(store, conn, claimed)
    assert pause(conn, table, "order.paid", limit_key="7") is True
    assert resume(conn, table, "order.paid") is True  # resumes the route paused alone too
    assert resume(conn, table, "order.paid", limit_key="7") is True
    assert [f.event_type for f in flow_states(conn, table)] == []


def test_invariant_28_the_consoles_key_filter_finds_a_producers_key_on_every_subscription(
    conn: psycopg.Connection[Any], table: str
) -> None:
    _subscribe(conn, table, "a", "b")
    with conn.transaction():
        ids = [  # LIKE's "_" in the key is matched literally; tenant_1x is another key
            enqueue(conn, payload=1, table=table, ordering_key="tenant_1", **PAID),
            enqueue(conn, payload=2, table=table, ordering_key="tenant_1", **{**PAID, "event_type": "e"}),
            enqueue(conn, payload=3, table=table, ordering_key="tenant_1x", **PAID),
            enqueue(conn, payload=4, table=table, ordering_key="tenantX1", **PAID),
        ]
    t = TableName.parse(table).identifier()
    conn.execute(sql.SQL("UPDATE {} SET status = 'dead', head = false").format(t))
    found = console.list_dead(conn, table, console.DeadQuery(key="tenant_1"))
    assert [(r.event_type, r.ordering_key) for r in found] == [
        ("order.paid@a", "tenant_1\x1forder.paid@a"),
        ("order.paid@b", "tenant_1\x1forder.paid@b"),
        ("e", "tenant_1"),
    ]
    assert found[0].id == ids[0] and found[2].id == ids[1]
    assert console.count_dead(conn, table, console.DeadQuery(key="tenant_1")) == (3, ids[1])
    # A subscription's stored key finds that subscription's row alone.
    one = console.list_dead(conn, table, console.DeadQuery(key="tenant_1\x1forder.paid@b"))
    assert [r.event_type for r in one] == ["order.paid@b"]


def test_invariant_28_a_claim_fans_out_bare_rows_of_a_subscribed_type_once(
    conn: psycopg.Connection[Any], table: str
) -> None:
    """Rows written while the type had no subscription (or by SQL, or by an older producer)
    are fanned out by the claim, in its transaction, as the producer's insert would have:
    the row keeps its id and payload as the first subscription's, the others read it; an
    ordered key gets one head per route; a group member's group grows by the new rows; a
    second claim finds nothing more to do."""
    from outbox_celery import group

    store = Store(table)
    free = enqueue(conn, payload={"n": 1}, table=table, allow_autocommit=True, **PAID)
    with conn.transaction():
        keyed = enqueue_many(
            conn,
            [Event("order.paid", {"n": i}, "order", "7", ordering_key="o:7") for i in (2, 3)],
            table=table,
        )
        g = group(
            conn, [Event("order.paid", {"n": 4}, "order", "8")], then=Event("x.done", {}, "x", 1), table=table
        )
    assert {r["event_type"] for r in _rows(conn, table)} == {"order.paid"}
    _subscribe(conn, table, "a", "b")
    first = steps.claim(store, conn, limit=0, lease=LONG, owner="t", max_attempts=5)
    assert first.claimed == []  # the fan-out runs even when nothing is claimed
    rows = {r["id"]: r for r in _rows(conn, table)}
    owners = [free, *keyed, *g.member_ids]
    assert [rows[i]["event_type"] for i in owners] == ["order.paid@a"] * 4
    assert [rows[i]["payload"]["n"] for i in owners] == [1, 2, 3, 4]
    others = [r for r in rows.values() if r["payload_of"] is not None]
    assert sorted((r["payload_of"], r["event_type"]) for r in others) == [(i, "order.paid@b") for i in owners]
    # One head per route key, the earliest message's.
    heads = {(r["ordering_key"], r["id"]) for r in rows.values() if r["head"]}
    b_first = next(r["id"] for r in others if r["payload_of"] == keyed[0])
    assert heads == {("o:7\x1forder.paid@a", keyed[0]), ("o:7\x1forder.paid@b", b_first)}
    # The group counts its two rows.
    total = conn.execute(
        sql.SQL("SELECT total FROM {} WHERE id = %s").format(TableName.parse(table).identifier("_group")),
        [g.id],
    ).fetchone()
    assert total is not None and total[0] == 2
    assert store.get_stats()["fanned_out"] == 4
    # Once: a second claim finds no bare row.
    steps.claim(store, conn, limit=0, lease=LONG, owner="t", max_attempts=5)
    assert len(_rows(conn, table)) == 8 and store.get_stats()["fanned_out"] == 4
    # Both routes deliver every event, each key in order.
    for route in ("order.paid@a", "order.paid@b"):
        got = [m.payload["n"] for m in _deliver_all(store, conn, route)]
        assert sorted(got) == [1, 2, 3, 4] and got.index(2) < got.index(3)


def test_invariant_28_the_heads_a_claim_fans_out_are_claimable_in_that_claim(
    conn: psycopg.Connection[Any], table: str
) -> None:
    """The claim's first statement found no head of its routes due (the rows had no route
    yet); the fan-out that follows in its transaction makes one per route, and the same claim
    takes them."""
    store = Store(table)
    events = [Event("order.paid", {"n": i}, "order", "7", ordering_key="o:7") for i in (1, 2)]
    with conn.transaction():
        keyed = enqueue_many(conn, events, table=table)
    _subscribe(conn, table, "a", "b")
    routes = ["order.paid@a", "order.paid@b"]
    claim = {"lease": LONG, "owner": "t", "max_attempts": 5, "event_types": routes}
    claimed = steps.claim(store, conn, limit=10, marks=ScanMarks(), **claim).claimed
    assert sorted(c.event_type for c in claimed) == routes
    assert keyed[0] in {c.id for c in claimed}
