"""Transactional handlers with real workers (DESIGN invariant 20).

The handler writes its effect (a row in ``effects``) and, when asked, a follow-up event in the
transaction whose last statement is the fenced done. Workers are SIGKILLed before the commit,
outlive their lease, fail and retry; every test then checks that each committed step left its
effect exactly once, and a follow-up exactly when its step committed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from support.apps import CLEAN_PROBE
from support.db import calls

from acceptance.conftest import Harness

pytestmark = pytest.mark.slow

# Every kind of transaction a handler can ask for (psycopg: the outbox's pool). What differs
# between kinds is how the handler's transaction is opened, committed and rolled back, all of it
# between the worker and PostgreSQL: each kind runs once per test, on Redis. The broker matters
# only where a killed worker's task comes back, so that test also runs on RabbitMQ (with the
# outbox's own pool; the other kinds' kill path is the same server-side rollback).
KINDS = pytest.mark.parametrize(
    ("kind", "broker_url"),
    [(k, "redis") for k in ("psycopg", "sqlalchemy", "django")],
    indirect=["broker_url"],
)
KINDS_AND_A_KILL_ON_EACH_BROKER = pytest.mark.parametrize(
    ("kind", "broker_url"),
    [("psycopg", "redis"), ("psycopg", "amqp"), ("sqlalchemy", "redis"), ("django", "redis")],
    indirect=["broker_url"],
)

POST = "tx.post"
NEXT = "tx.next"


def _effects(harness: Harness) -> list[dict[str, Any]]:
    with harness.conn.cursor() as cur:
        cur.execute("SELECT outbox_id, lease_version, attempts, ordering_key FROM effects ORDER BY n")
        return [{"outbox_id": a, "lease_version": b, "attempts": c, "ordering_key": d} for a, b, c, d in cur]


def _follow_ups(harness: Harness) -> Counter[int]:
    """How many follow-up events each step enqueued (by the id of the step)."""
    return Counter(int(r["payload"]["after"]) for r in harness.rows() if r["event_type"] == NEXT)


@KINDS_AND_A_KILL_ON_EACH_BROKER
def test_invariant_20_a_worker_killed_before_commit_leaves_nothing_and_the_redelivery_applies_it_once(
    harness: Harness, kind: str
) -> None:
    harness.spec.transactional_kind = kind
    harness.configure(lease=3.0, max_attempts=5, transactional={POST: None, NEXT: None})
    [victim] = harness.enqueue(1, event_type=POST, payload={"mode": "kill", "times": 1, "follow_up": NEXT})
    others = harness.enqueue(4, event_type=POST, payload={"follow_up": NEXT})
    harness.worker(concurrency=2)
    harness.beat()
    harness.wait_finished(10)  # 5 steps and their 5 follow-ups

    runs = [c for c in calls(harness.conn) if c["outbox_id"] == victim]
    # Attempt 1 wrote its effect and its follow-up, then its process was SIGKILLed before the
    # commit: the server rolled both back. Attempt 2, under a new claim, committed them once.
    assert [(c["attempts"], c["lease_version"]) for c in runs] == [(1, 1), (2, 2)]
    assert runs[0]["finished_at"] is None
    effects = _effects(harness)
    assert [(e["lease_version"], e["attempts"]) for e in effects if e["outbox_id"] == victim] == [(2, 2)]
    steps = [victim, *others]
    assert Counter(e["outbox_id"] for e in effects if e["outbox_id"] in steps) == Counter(steps)
    assert _follow_ups(harness) == Counter(steps)
    # The follow-ups were delivered too, each effect once.
    follow_ids = [r["id"] for r in harness.rows() if r["event_type"] == NEXT]
    assert Counter(e["outbox_id"] for e in effects if e["outbox_id"] in follow_ids) == Counter(follow_ids)


@KINDS
def test_invariant_20_a_stale_worker_commits_nothing(harness: Harness, kind: str) -> None:
    """Its lease ran out and another claim finished the row while its transaction was open."""
    harness.spec.transactional_kind = kind
    # NEXT has no handler here: its follow-ups stay pending, where they can be counted.
    harness.configure(lease=2.0, transactional={POST: None})
    stalled = harness.worker([harness.default_queue], name="stalled", pool="solo")
    [i] = harness.enqueue(1, event_type=POST, payload={"mode": "stall", "times": 1, "follow_up": NEXT})
    assert harness.outbox.claim().published == 1
    harness.wait(lambda: calls(harness.conn), what="the stalled worker to start the handler")
    rescuer = harness.worker([harness.default_queue], name="rescuer", concurrency=1)
    harness.wait(lambda: harness.outbox.claim().published == 1, what="a re-claim once the lease ran out")
    harness.wait(
        lambda: [r for r in harness.rows() if r["id"] == i and r["status"] == "done"], what="the rescue"
    )
    first, second = calls(harness.conn)
    assert (first["lease_version"], first["hostname"].split("@")[0]) == (1, "stalled")
    assert second["lease_version"] == 2
    if harness.conn.info.server_version >= 170000:
        # PostgreSQL 17+: transaction_timeout (the delivery's time limit, 0.9 x lease) ends the
        # stalled transaction before its lease runs out; the server rolls it back, effect and
        # follow-up included, and the row comes back through its lease as for a lost worker
        # (either worker may then run it).
        stalled.wait_for_log(f"outbox id {i} transactional handler raised", timeout=60)
        first, second = calls(harness.conn)
        assert str(first["result"]).startswith("raised "), first["result"]
    else:
        # Statements stay short, so the transaction outlives the lease: the fence refuses its done.
        stalled.wait_for_log(
            f"lost lease: finish_done of outbox id {i} version 1 changed nothing", timeout=60
        )
        stalled.wait_for_log(f"outbox id {i} {POST} -> lost_lease", timeout=10)
        first, second = calls(harness.conn)
        assert first["result"] == "stalled past a newer run"  # it returned: the fence refused its done
        assert second["hostname"].split("@")[0] == "rescuer"
        assert first["finished_at"] > second["finished_at"]
    # The stale run's effect and follow-up were rolled back with its done; the rescue's stand.
    assert [(e["outbox_id"], e["lease_version"]) for e in _effects(harness)] == [(i, 2)]
    assert _follow_ups(harness) == Counter({i: 1})
    assert "lost lease" not in rescuer.log()


@KINDS
def test_invariant_20_a_retry_or_a_permanent_failure_rolls_the_effect_back(
    harness: Harness, kind: str
) -> None:
    harness.spec.transactional_kind = kind
    harness.configure(max_attempts=5, transactional={POST: None, NEXT: None})
    [retried] = harness.enqueue(1, event_type=POST, payload={"mode": "retry", "times": 2, "follow_up": NEXT})
    [failed] = harness.enqueue(1, event_type=POST, payload={"mode": "permanent", "follow_up": NEXT})
    harness.worker(concurrency=2)
    harness.beat()
    harness.wait_finished(3, statuses_=("done", "dead"))  # retried, its follow-up, failed
    harness.wait(lambda: len(_effects(harness)) == 2, what="the follow-up's effect")

    rows = {r["id"]: r for r in harness.rows()}
    assert (rows[retried]["status"], rows[retried]["attempts"]) == ("done", 3)
    assert rows[failed]["status"] == "dead"
    assert [c["result"] for c in calls(harness.conn) if c["outbox_id"] == retried] == [
        "raised RetryableError",
        "raised RetryableError",
        "ok",
    ]
    # Only the run that committed left an effect and a follow-up; the failed step neither.
    effects = [e for e in _effects(harness) if e["outbox_id"] in (retried, failed)]
    assert [(e["outbox_id"], e["attempts"]) for e in effects] == [(retried, 3)]
    assert _follow_ups(harness) == Counter({retried: 1})


# The head moves inside the step's transaction, in PostgreSQL: one broker shows it.
@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_invariant_20_ordered_transactional_messages_keep_their_order(harness: Harness) -> None:
    harness.configure(lease=3.0, max_attempts=5, transactional={POST: None})

    def script(key: str) -> Any:
        def payload(i: int) -> dict[str, Any]:
            if i == 2:  # a failure in the middle of each key: kill for one, retry for the other
                return {"mode": "kill" if key == "a" else "retry", "times": 1}
            return {"mode": "sleep", "seconds": 0.02}

        return payload

    keys = {k: harness.enqueue(6, event_type=POST, ordering_key=f"acct:{k}", payload=script(k)) for k in "ab"}
    harness.worker(concurrency=2)
    harness.beat()
    harness.wait_finished(12)

    effects = _effects(harness)
    for k, ids in keys.items():
        # Committed once each, in id order: the head moved in each step's own transaction.
        assert [e["outbox_id"] for e in effects if e["ordering_key"] == f"acct:{k}"] == ids
    rows = {r["id"]: r for r in harness.rows()}
    assert [rows[keys[k][2]]["attempts"] for k in "ab"] == [2, 2]


@KINDS
def test_invariant_20_a_handler_s_session_state_never_reaches_later_claims_or_runs_on_prefork_and_threads(
    harness: Harness, kind: str
) -> None:
    """A handler leaves settings, LISTEN, a WITH HOLD cursor, an advisory lock, a row factory and
    a text loader on its connection; every later run and claim, in the same processes, meets
    none of it."""
    harness.spec.transactional_kind = kind
    queues = {"prefork": harness.q("tx.prefork"), "threads": harness.q("tx.threads")}
    types = {pool: f"tx.{pool}" for pool in queues}
    harness.configure(lease=5.0, transactional={types[p]: q for p, q in queues.items()})
    # Each worker consumes the claim queue too: with threads, the claims run in the process
    # whose pool the leaking handler used (the listener's claims crash-looped on it).
    for pool, queue in queues.items():
        harness.worker([harness.claim_queue, queue], name=pool, pool=pool, concurrency=2)
    harness.beat()
    for event_type in types.values():
        # Server-side state only (the psycopg kind resets the connection), then the Python side
        # too (every kind discards it).
        harness.enqueue(2, event_type=event_type, payload=lambda i: {"mode": "leak", "python_side": i == 1})
    harness.wait_finished(4, timeout=60)
    probes = {p: harness.enqueue(6, event_type=et, payload={"mode": "probe"}) for p, et in types.items()}
    harness.wait_finished(16, timeout=60)
    results = {c["outbox_id"]: c["result"] for c in calls(harness.conn)}
    for pool, ids in probes.items():
        assert [results.get(i) for i in ids] == [CLEAN_PROBE] * len(ids), pool
