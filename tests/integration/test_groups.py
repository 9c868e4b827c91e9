"""Groups with a callback (DESIGN invariant 29): the producer writes a group and its members in
the caller's transaction; every path that makes a member final counts it in its group's row
once, in that path's own fenced statement; the last one enqueues the callback, exactly once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row
from support import steps

from outbox_celery import (
    Event,
    ProducerError,
    Store,
    TableName,
    enqueue_group,
    enqueue_group_async,
    group,
    ops,
)
from outbox_celery.db.completer import Finish, Lease, Step

from .helpers import LONG, PAST_SHORT, SHORT, Connect, count, fetch
from .producer_kinds import ASYNC_KINDS, SYNC_KINDS

THEN = Event("report.ready", {"report": 7}, "report", 7)


def members(n: int, *, event_type: str = "part.work", dedup: str | None = None) -> list[Event]:
    return [
        Event(event_type, {"i": i}, "part", i, dedup_key=None if dedup is None else f"{dedup}{i}")
        for i in range(n)
    ]


def grp(conn: psycopg.Connection[Any], table: str, group_id: int) -> dict[str, Any]:
    t = TableName.parse(table).identifier("_group")
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(sql.SQL("SELECT * FROM {} WHERE id = %s").format(t), [group_id]).fetchone()
    assert row is not None
    return row


def callbacks(
    conn: psycopg.Connection[Any], table: str, event_type: str = "report.ready"
) -> list[dict[str, Any]]:
    t = TableName.parse(table).identifier()
    with conn.cursor(row_factory=dict_row) as cur:
        q = sql.SQL("SELECT * FROM {} WHERE event_type = %s ORDER BY id").format(t)
        return cur.execute(q, [event_type]).fetchall()


def make(conn: psycopg.Connection[Any], table: str, n: int, **kw: Any) -> tuple[int, list[int]]:
    with conn.transaction():
        g = group(conn, members(n), then=kw.pop("then", THEN), table=table, **kw)
    return g.id, g.member_ids


def start_all(store: Store, conn: psycopg.Connection[Any], *, max_attempts: int = 5) -> list[tuple[int, int]]:
    """Claim and start every due row; their (id, lease_version)."""
    got = steps.claim(store, conn, limit=20000, lease=LONG, owner="t", max_attempts=max_attempts).claimed
    pairs = [(c.id, c.lease_version) for c in got]
    if pairs:
        steps.start_many(store, conn, pairs, lease=LONG, max_attempts=max_attempts, starter="s")
    return pairs


def test_invariant_29_the_group_and_its_members_commit_with_the_caller_or_not_at_all(
    conn: psycopg.Connection[Any], table: str
) -> None:
    with pytest.raises(RuntimeError), conn.transaction():
        group(conn, members(3), then=THEN, table=table)
        raise RuntimeError("business failed")
    assert count(conn, table) == 0
    gid, ids = make(conn, table, 3)
    assert [fetch(conn, table, i)["group_id"] for i in ids] == [gid] * 3
    g = grp(conn, table, gid)
    assert (g["total"], g["done"], g["dead"], g["state"]) == (3, 0, 0, "open")
    assert callbacks(conn, table) == []


def test_invariant_29_the_last_done_enqueues_the_callback_once_with_the_outcomes(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    gid, _ids = make(conn, table, 3)
    pairs = start_all(store, conn)
    for p in pairs[:2]:
        assert steps.done(store, conn, *p)
    assert callbacks(conn, table) == [] and grp(conn, table, gid)["done"] == 2
    assert steps.done(store, conn, *pairs[2])
    assert not steps.done(store, conn, *pairs[2])  # fenced: a second done counts nothing
    [cb] = callbacks(conn, table)
    g = grp(conn, table, gid)
    assert (g["state"], g["done"], g["dead"], g["callback_id"]) == ("fired", 3, 0, cb["id"])
    assert cb["payload"] == {
        "report": 7,
        "outbox_group": {
            "id": gid,
            "state": "fired",
            "total": 3,
            "done": 3,
            "dead": 0,
            "dead_members": [],
            "truncated": False,
        },
    }
    assert cb["status"] == "pending" and cb["group_id"] is None
    # The callback is a normal message: claimed, delivered, done.
    [(cb_id, v)] = start_all(store, conn)
    assert cb_id == cb["id"] and steps.done(store, conn, cb_id, v)


@pytest.mark.parametrize("skip_on_dead", [False, True])
def test_invariant_29_a_dead_member_takes_the_declared_path(
    conn: psycopg.Connection[Any], store: Store, table: str, skip_on_dead: bool
) -> None:
    gid, _ids = make(conn, table, 3, skip_on_dead=skip_on_dead)
    a, b, c = start_all(store, conn)
    assert steps.dead(store, conn, *a, error="HTTP 410 gone")
    assert steps.retry(store, conn, *b, delay=0, error="boom", max_attempts=1).status == "dead"
    assert steps.done(store, conn, *c)
    g = grp(conn, table, gid)
    assert (g["done"], g["dead"]) == (1, 2)
    if skip_on_dead:
        assert g["state"] == "skipped" and g["callback_id"] is None
        assert callbacks(conn, table) == []
        return
    [cb] = callbacks(conn, table)
    out = cb["payload"]["outbox_group"]
    assert (out["done"], out["dead"], out["truncated"]) == (1, 2, False)
    assert out["dead_members"] == [
        {"id": a[0], "event_type": "part.work", "last_error": "HTTP 410 gone"},
        {"id": b[0], "event_type": "part.work", "last_error": "attempts exhausted (1 of 1): boom"},
    ]


def test_invariant_29_a_defer_past_max_defer_age_counts_dead(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    gid, _ = make(conn, table, 1)
    [p] = start_all(store, conn)
    assert steps.defer(store, conn, *p, delay=10, reason="later", max_age=1).status == "dead"
    assert grp(conn, table, gid)["state"] == "fired"
    assert callbacks(conn, table)[0]["payload"]["outbox_group"]["dead"] == 1


def test_invariant_29_outcomes_that_are_not_final_count_nothing(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    gid, _ = make(conn, table, 3)
    a, b, c = start_all(store, conn)
    assert steps.retry(store, conn, *a, delay=0, error="again", max_attempts=5).status == "pending"
    assert steps.defer(store, conn, *b, delay=0, reason="later", max_age=3600).status == "pending"
    assert steps.record_error(store, conn, *c, error="hm")
    g = grp(conn, table, gid)
    assert (g["done"], g["dead"], g["state"]) == (0, 0, "open")


def test_invariant_29_steps_that_are_never_final_finish_a_member_through_the_plain_statement(
    conn: psycopg.Connection[Any], store: Store, table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """release, postpone and hand_back never make a row done or dead, so they never change a
    group's count: the plain ``finish`` applies them to a member, whether the worker knows it is
    one or not, without the group's count of ``finish_grouped``; a failed attempt with attempts
    left (invariant 31) goes through ``finish_grouped`` and counts nothing either."""
    gid, _ = make(conn, table, 4)
    ran: list[str] = []
    query = store.completer._query

    def spy(name: str, rows: int) -> Any:
        ran.append(name)
        return query(name, rows)

    monkeypatch.setattr(store.completer, "_query", spy)
    claimed = steps.claim(store, conn, limit=10, lease=LONG, owner="t", max_attempts=5).claimed
    released, *rest = sorted(claimed, key=lambda c: c.id)
    assert steps.release(store, conn, [released]) == 1  # grouped unknown (None), as the claim's release
    pairs = [(c.id, c.lease_version) for c in rest]
    steps.start_many(store, conn, pairs, lease=LONG, max_attempts=5, starter="s")
    postponed, errored, handed = pairs
    assert steps.postpone(store, conn, *postponed, delay=0, error="no handler here").status == "pending"
    assert steps.record_error(store, conn, *errored, error="hm", max_attempts=5).status == "pending"
    back = Finish(Lease(*handed), Step.HAND_BACK, grouped=True)
    won = store.completer.finish(conn, [back], max_attempts=5, max_age=3600)
    assert won.of(handed[0]).status == "pending"
    assert [n for n in ran if n.startswith("finish")] == ["finish", "finish", "finish_grouped", "finish"]
    rows = {i: fetch(conn, table, i) for i in (released.id, *(p[0] for p in pairs))}
    assert [rows[i]["status"] for i in rows] == ["pending"] * 4
    assert (rows[postponed[0]]["attempts"], rows[errored[0]]["last_error"]) == (0, "hm")
    g = grp(conn, table, gid)
    assert (g["done"], g["dead"], g["state"]) == (0, 0, "open") and callbacks(conn, table) == []
    # Each member is then counted once, by its final step.
    for p in start_all(store, conn):
        assert steps.done(store, conn, *p)
    g = grp(conn, table, gid)
    assert (g["done"], g["dead"], g["state"]) == (4, 0, "fired") and len(callbacks(conn, table)) == 1


def test_invariant_29_a_batch_finish_counts_each_member_once(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    g1, _ = make(conn, table, 4)
    g2, _ = make(conn, table, 2)
    pairs = start_all(store, conn)
    stale = (pairs[0][0], pairs[0][1] + 1)  # a lost lease: fenced off, counts nothing
    assert steps.done_many(store, conn, [stale, *pairs[1:4]]).applied == {p[0] for p in pairs[1:4]}
    assert grp(conn, table, g1)["done"] == 3
    rows = [Finish(Lease(i, v), Step.DONE) for i, v in pairs]
    rows[5] = Finish(Lease(*pairs[5]), Step.DEAD, error="bad")
    won = steps.finish_many(store, conn, rows, max_attempts=5, max_age=3600)
    assert won.applied == {pairs[0][0], pairs[4][0], pairs[5][0]}
    assert [(grp(conn, table, g)["done"], grp(conn, table, g)["dead"]) for g in (g1, g2)] == [(4, 0), (1, 1)]
    assert len(callbacks(conn, table)) == 2


def test_invariant_29_the_reap_of_an_exhausted_lease_counts_dead(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    gid, _ = make(conn, table, 1)
    got = steps.claim(store, conn, limit=10, lease=SHORT, owner="t", max_attempts=1).claimed
    assert steps.start(store, conn, got[0].id, got[0].lease_version, lease=SHORT, max_attempts=1)
    time.sleep(PAST_SHORT + SHORT)
    steps.claim(store, conn, limit=10, lease=LONG, owner="t", max_attempts=1)
    assert fetch(conn, table, got[0].id)["status"] == "dead"
    g = grp(conn, table, gid)
    assert (g["dead"], g["state"]) == (1, "fired")
    [cb] = callbacks(conn, table)
    assert "attempts exhausted" in cb["payload"]["outbox_group"]["dead_members"][0]["last_error"]


def test_invariant_29_a_start_with_no_attempt_left_counts_dead(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    gid, [i] = make(conn, table, 1)
    [c] = steps.claim(store, conn, limit=10, lease=LONG, owner="t", max_attempts=5).claimed
    conn.execute(
        sql.SQL("UPDATE {} SET attempts = 5 WHERE id = %s").format(TableName.parse(table).identifier()), [i]
    )
    assert steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5) is None
    assert fetch(conn, table, i)["status"] == "dead"
    assert grp(conn, table, gid)["state"] == "fired"


def test_invariant_29_an_operator_skip_counts_done_and_a_requeue_uncounts_a_dead(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    gid, _ids = make(conn, table, 3)
    a, b, c = start_all(store, conn)
    assert steps.dead(store, conn, *a, error="x")
    assert steps.dead(store, conn, *b, error="y")
    assert (grp(conn, table, gid)["dead"], len(grp(conn, table, gid)["dead_members"])) == (2, 2)
    ops.requeue(conn, table, [a[0]])
    g = grp(conn, table, gid)
    assert (g["dead"], [m["id"] for m in g["dead_members"]]) == (1, [b[0]])
    ops.skip(conn, table, [b[0]], reason="not needed")
    g = grp(conn, table, gid)
    assert (g["done"], g["dead"], g["dead_members"], g["state"]) == (1, 0, [], "open")
    assert steps.done(store, conn, *c)
    [(i, v)] = start_all(store, conn)  # the requeued one
    assert i == a[0] and steps.done(store, conn, i, v)
    g = grp(conn, table, gid)
    assert (g["done"], g["dead"], g["state"]) == (3, 0, "fired")
    assert len(callbacks(conn, table)) == 1


def test_invariant_29_requeue_all_uncounts_the_dead(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    gid, _ = make(conn, table, 2)
    a, _b = start_all(store, conn)
    assert steps.dead(store, conn, *a, error="x")
    assert ops.requeue_all(conn, table=table) == 1
    assert grp(conn, table, gid)["dead"] == 0


def test_invariant_29_a_duplicate_member_is_none_and_an_all_duplicate_group_fires_at_once(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    with conn.transaction():
        first = group(conn, members(2, dedup="k"), then=THEN, table=table)
    with conn.transaction():
        second = group(conn, members(3, dedup="k"), then=THEN, table=table)
    assert second.member_ids[:2] == first.member_ids
    assert grp(conn, table, second.id)["total"] == 1
    with conn.transaction():
        empty = group(conn, members(2, dedup="k"), then=THEN, table=table)
    g = grp(conn, table, empty.id)
    assert (g["total"], g["state"]) == (0, "fired")
    [cb] = callbacks(conn, table)
    assert cb["id"] == g["callback_id"]


def test_invariant_29_bad_groups_are_refused_before_anything_is_written(
    conn: psycopg.Connection[Any], table: str
) -> None:
    bad: list[tuple[list[Event], Any]] = [
        ([], THEN),
        (members(1), Event("x", [1], "a", 1)),
        (members(1), Event("x", {"outbox_group": 1}, "a", 1)),
        (members(1), Event("x", {}, "a", 1, ordered=True)),
        (members(1), Event("x", {}, "a", 1, dedup_key="d")),
        (members(1), "not an event"),
    ]
    for events, then in bad:
        with pytest.raises(ProducerError), conn.transaction():
            group(conn, events, then=then, table=table)
    assert count(conn, table) == 0


def test_invariant_29_nested_groups_run_as_a_workflow_of_three_steps(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    """Each step's callback starts the next group in its own transaction (a transactional
    handler's): the step's done and the next group commit together."""
    workflow = ["step.1", "step.2", "step.3"]
    with conn.transaction():
        group(conn, members(3, event_type="work.1"), then=Event("step.1", {"n": 1}, "flow", 1), table=table)
    seen: list[str] = []
    for _ in range(20):
        claimed = steps.claim(store, conn, limit=100, lease=LONG, owner="t", max_attempts=5).claimed
        if not claimed:
            break
        for c in claimed:
            with conn.transaction():
                msg = steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5)
                assert msg is not None
                if msg.event_type in workflow:
                    seen.append(msg.event_type)
                    n = int(msg.payload["n"])
                    assert msg.payload["outbox_group"]["done"] == 3
                    if n < 3:
                        then = Event(f"step.{n + 1}", {"n": n + 1}, "flow", 1)
                        group(conn, members(3, event_type=f"work.{n + 1}"), then=then, table=table)
                assert steps.done(store, conn, c.id, c.lease_version, joined=True)
    assert seen == workflow
    assert count(conn, table, "status <> 'done'") == 0


def test_invariant_29_ten_thousand_members_with_concurrent_finalizers(
    conn: psycopg.Connection[Any], connect: Connect, table: str
) -> None:
    """10,000 members finished by 6 finalizers on their own connections, one row and many rows
    at a time: every member counts once, the callback is enqueued once, and between finalizes
    nobody holds the group's row (a NOWAIT lock of it from another session never fails while
    no finalize runs)."""
    n = 10_000
    with conn.transaction():
        g = group(conn, members(n), then=THEN, table=table, notify=False)
    store = Store(table)
    pairs = start_all(store, conn)
    assert len(pairs) == n
    shards = [pairs[i::6] for i in range(6)]
    errors: list[BaseException] = []

    def finalize(shard: list[tuple[int, int]], one_by_one: bool) -> None:
        try:
            c = connect()
            s = Store(table)
            if one_by_one:
                for p in shard:
                    assert steps.done(s, c, *p)
            else:
                for k in range(0, len(shard), 50):
                    assert len(steps.done_many(s, c, shard[k : k + 50]).applied) == len(shard[k : k + 50])
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=finalize, args=(s, i % 2 == 0)) for i, s in enumerate(shards)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    row = grp(conn, table, g.id)
    assert (row["done"], row["dead"], row["state"]) == (n, 0, "fired")
    assert len(callbacks(conn, table)) == 1
    # No finalize left a lock on the group's row behind it.
    with conn.transaction():
        t = TableName.parse(table).identifier("_group")
        conn.execute(sql.SQL("SELECT 1 FROM {} WHERE id = %s FOR UPDATE NOWAIT").format(t), [g.id])


def test_invariant_29_the_group_row_is_locked_only_for_the_length_of_one_finalize(
    conn: psycopg.Connection[Any], connect: Connect, store: Store, table: str
) -> None:
    """A finalize that holds the group's row (its transaction still open) makes a concurrent
    member's finalize wait for it, and only for it: that one completes once the first commits."""
    gid, _ = make(conn, table, 3)
    a, b, _c = start_all(store, conn)
    first = connect()
    first.execute("BEGIN")
    assert steps.done(store, first, *a, joined=True)
    other = connect()
    finished = threading.Event()

    def second() -> None:
        assert steps.done(Store(table), other, *b)
        finished.set()

    t = threading.Thread(target=second)
    t.start()
    assert not finished.wait(0.5), "the second finalize should wait for the first's commit"
    first.execute("COMMIT")
    assert finished.wait(10)
    t.join()
    assert grp(conn, table, gid)["done"] == 2


@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_invariant_29_each_kind_writes_a_group_in_its_transaction(
    kind: str, migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    with SYNC_KINDS[kind](migrated_dsn) as h:
        enqueue_group(h.conn, members(2), then=THEN, table=table)
        h.rollback()
        assert count(conn, table) == 0
        g = enqueue_group(h.conn, members(2), then=THEN, table=table)
        h.commit()
    assert grp(conn, table, g.id)["total"] == 2
    assert [fetch(conn, table, i)["group_id"] for i in g.member_ids] == [g.id, g.id]


@pytest.mark.parametrize("kind", ASYNC_KINDS)
def test_invariant_29_each_async_kind_writes_a_group_in_its_transaction(
    kind: str, migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    async def main() -> Callable[[], None]:
        async with ASYNC_KINDS[kind](migrated_dsn) as h:
            g = await enqueue_group_async(h.conn, members(2), then=THEN, table=table)
            await h.commit()
        return lambda: None if grp(conn, table, g.id)["total"] == 2 else pytest.fail("total")

    asyncio.run(main())()


def test_invariant_29_operators_see_open_groups_and_finish_or_cancel_them(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    g1, _ = make(conn, table, 2)
    g2, _ = make(conn, table, 2)
    g3, _ = make(conn, table, 150)
    pairs = start_all(store, conn)
    assert steps.dead(store, conn, *pairs[0], error="first failed")
    s = ops.stats(conn, table)
    assert (s.groups.open, s.groups.blocked) == (3, 1)
    assert s.groups.oldest_open_age is not None
    [a, _b, _c] = sorted(ops.list_groups(conn, table), key=lambda g: g.id)
    assert (a.id, a.progress, a.dead) == (g1, "1 of 2", 1)
    assert ops.get_group(conn, table, g3).progress == "0 of 150"

    callback = ops.finish_group(conn, table, g1, reason="good enough")
    [cb] = callbacks(conn, table)
    assert cb["id"] == callback
    assert cb["payload"]["outbox_group"]["state"] == "finished"
    assert cb["payload"]["outbox_group"]["dead_members"][0]["last_error"] == "first failed"
    ops.cancel_group(conn, table, g2, reason="not wanted")
    for p in pairs[1:4]:
        assert steps.done(store, conn, *p)  # members of closed groups count nothing more
    assert ops.get_group(conn, table, g1).done == 0
    assert len(callbacks(conn, table)) == 1
    with pytest.raises(ops.AdminError):
        ops.cancel_group(conn, table, g1, reason="again")
    with pytest.raises(ops.AdminError):
        ops.finish_group(conn, table, g3, reason=" ")

    # More than 100 dead: the payload carries the first 100 and says so; the rest are read.
    rest = pairs[4:]
    assert (
        len(
            steps.finish_many(
                store,
                conn,
                [Finish(Lease(i, v), Step.DEAD, error=f"e{i}") for i, v in rest],
                max_attempts=5,
                max_age=60,
            ).applied
        )
        == 150
    )
    [_, big] = callbacks(conn, table)
    out = big["payload"]["outbox_group"]
    assert (out["dead"], len(out["dead_members"]), out["truncated"]) == (150, 100, True)
    page1 = ops.group_outcomes(conn, table, g3, limit=120)
    page2 = ops.group_outcomes(conn, table, g3, after=page1[-1].id, limit=120)
    assert [d.id for d in page1 + page2] == [i for i, _ in rest]
    assert ops.stats(conn, table).groups.open == 0


def test_invariant_29_the_worker_knows_a_member_from_its_start_and_the_plain_finish_leaves_it_alone(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    """A member's start says its group; the one-message handler's finish of a row of no group
    (the statement that does not count) refuses a member, as a lost lease: a wrong flag costs a
    redelivery, never a lost count."""
    gid, [i] = make(conn, table, 1)
    [c] = steps.claim(store, conn, limit=1, lease=LONG, owner="t", max_attempts=5).claimed
    msg = steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5)
    assert msg is not None and msg.group_id == gid
    assert not steps.done(store, conn, i, c.lease_version, grouped=False)
    assert fetch(conn, table, i)["status"] == "processing"
    assert steps.done(store, conn, i, c.lease_version, grouped=True)
    assert grp(conn, table, gid)["state"] == "fired"
    # The callback is a row of no group: the plain statement finishes it.
    [c] = steps.claim(store, conn, limit=1, lease=LONG, owner="t", max_attempts=5).claimed
    assert c.id == grp(conn, table, gid)["callback_id"]
    started = steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5)
    assert started is not None and started.group_id is None
    assert steps.done(store, conn, c.id, c.lease_version, grouped=False)


def test_invariant_29_the_purge_deletes_closed_groups_past_retention_and_keeps_open_ones(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    closed, _ = make(conn, table, 1)
    kept, _ = make(conn, table, 1)
    [p, _q] = start_all(store, conn)
    assert steps.done(store, conn, *p)
    t = TableName.parse(table).identifier("_group")
    conn.execute(
        sql.SQL("UPDATE {} SET closed_at = now() - interval '2 days' WHERE id = %s").format(t), [closed]
    )
    ops.purge_done(conn, table, older_than=86400, batch_size=10)
    left = [r[0] for r in conn.execute(sql.SQL("SELECT id FROM {} ORDER BY id").format(t)).fetchall()]
    assert left == [kept]


def test_invariant_29_a_member_fanned_out_to_subscriptions_counts_each_subscription_s_row(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    # Invariant 28 and 29 together: a member of a type with subscriptions is one row per
    # subscription, each a member; the callback waits for every one of them.
    from outbox_celery.ops import subscriptions

    for name in ("mail", "search"):
        subscriptions.add(conn, table, "part.work", name)
    with conn.transaction():
        g = group(conn, members(2), then=THEN, table=table)
    rows = [r for r in (fetch(conn, table, i) for i in g.member_ids)]
    assert [r["event_type"] for r in rows] == ["part.work@mail"] * 2  # the owners answer
    assert grp(conn, table, g.id)["total"] == 4
    pairs = start_all(store, conn)
    assert len(pairs) == 4
    for p in pairs[:3]:
        assert steps.done(store, conn, *p)
    assert callbacks(conn, table) == []
    assert steps.done(store, conn, *pairs[3])
    [cb] = callbacks(conn, table)
    assert cb["payload"]["outbox_group"]["done"] == 4


def test_invariant_29_a_callback_of_a_subscribed_type_is_fanned_out_to_every_subscription(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    """Invariant 28 for callbacks: the callback's type has two subscriptions, so the group's
    completion writes one row per subscription, the first holding the payload, the second
    reading it; neither is a bare row nobody claims."""
    from outbox_celery.ops import subscriptions

    for name in ("audit", "mail"):
        subscriptions.add(conn, table, "report.ready", name)
    gid, _ = make(conn, table, 2)
    for p in start_all(store, conn):
        assert steps.done(store, conn, *p)
    assert grp(conn, table, gid)["state"] == "fired"
    assert callbacks(conn, table) == []  # no bare row
    audit, mail = callbacks(conn, table, "report.ready@audit"), callbacks(conn, table, "report.ready@mail")
    assert len(audit) == len(mail) == 1
    assert audit[0]["id"] == grp(conn, table, gid)["callback_id"]
    assert mail[0]["payload"] is None and mail[0]["payload_of"] == audit[0]["id"]
    assert audit[0]["payload"]["outbox_group"]["state"] == "fired"
    # Both are claimable by their routes' handlers.
    routes = ["report.ready@audit", "report.ready@mail"]
    got = steps.claim(store, conn, limit=10, lease=LONG, owner="t", max_attempts=5, event_types=routes)
    assert sorted(c.event_type for c in got.claimed) == routes
