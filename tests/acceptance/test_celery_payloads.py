"""A payload arrives in the handler as what was enqueued, through a real worker.

Any JSON value is a payload: an object, a list, a number, ``null``, a boolean, and a string,
including the ``json.dumps(...)`` string many producers pass out of habit, which must come back
as that same ``str`` (not parsed into a dict). And when the library's own code fails between the
claim and the handler, the row says so at once, never later as a lost worker.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import kombu.utils.json
import pytest
from support.db import calls, row, signals
from support.payloads import same

from acceptance.conftest import DEFAULT_EVENT, HarnessFactory
from outbox_celery import ProducerError, enqueue
from outbox_celery.codec import MAX_DEPTH
from outbox_celery.db.statements import named

pytestmark = pytest.mark.slow

# How last_error starts when the library, not the handler, failed (docs/celery.md).
PRE_HANDLER_FAILURE = "outbox-celery failed before calling the handler (the handler did not run)"

PAYLOADS: list[Any] = [
    "hello",
    json.dumps({"order_id": 7, "total": 42}),
    "{not json",
    "",
    "null",
    ["a", 1, None, {"b": [True, 2.5]}],
    42,
    -3.25,
    None,
    True,
    {"order": {"id": 7, "lines": [{"sku": "x-1", "qty": 2}], "note": "ünïcode", "paid": False}},
    {},
]


def test_every_json_value_arrives_in_the_handler_as_it_was_enqueued(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    h = harness_factory(redis_url)
    with h.conn.transaction():
        ids = [
            enqueue(
                h.conn,
                event_type=DEFAULT_EVENT,
                payload=payload,
                aggregate_type="thing",
                aggregate_id=str(i),
                table=h.table,
            )
            for i, payload in enumerate(PAYLOADS)
        ]
    h.worker()
    h.beat()
    h.wait_finished(len(PAYLOADS))
    received = {c["outbox_id"]: c for c in calls(h.conn)}
    assert sorted(received) == sorted(ids)
    for outbox_id, sent in zip(ids, PAYLOADS, strict=True):
        got = received[outbox_id]
        assert (got["payload_type"], json.loads(got["payload_json"])) == (type(sent).__name__, sent)
        assert row(h.conn, h.table, outbox_id)["last_error"] is None
    assert signals(h.conn, "task_failure") == []


def _nested(depth: int, leaf: Any) -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def test_the_deepest_payload_enqueue_accepts_arrives_in_the_handler(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    # The worker decodes a payload with two frames per level inside its own stack: whatever
    # depth the producer accepts must arrive (a deeper one is refused at enqueue, never dead).
    h = harness_factory(redis_url)
    sent = [_nested(MAX_DEPTH, "leaf"), _nested(MAX_DEPTH - 1, uuid.UUID(int=9))]
    with h.conn.transaction():
        ids = [
            enqueue(
                h.conn, event_type=DEFAULT_EVENT, payload=p, aggregate_type="t", aggregate_id=i, table=h.table
            )
            for i, p in enumerate(sent)
        ]
        with pytest.raises(ProducerError, match=f"nested deeper than {MAX_DEPTH} levels"):
            enqueue(h.conn, event_type=DEFAULT_EVENT, payload=[sent[0]], aggregate_type="t", aggregate_id=9)
    h.worker()
    h.beat()
    h.wait_finished(len(sent))
    received = {c["outbox_id"]: c for c in calls(h.conn)}
    for outbox_id, payload in zip(ids, sent, strict=True):
        assert same(payload, kombu.utils.json.loads(received[outbox_id]["payload_json"]))
        assert row(h.conn, h.table, outbox_id)["attempts"] == 1
    assert signals(h.conn, "task_failure") == []


# The report's cases (DESIGN invariant 27): key order, a float that jsonb made an int, and
# kombu's registered types, which Celery's own arguments carry.
TYPED: list[Any] = [
    {"b": 1, "a": 2},
    1e20,
    Decimal("1.10"),
    {
        "at": datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        "id": uuid.UUID(int=5),
        "day": date(2026, 1, 2),
    },
]


def test_invariant_27_typed_payloads_arrive_as_a_celery_argument_would(
    harness_factory: HarnessFactory, amqp_url: str
) -> None:
    h = harness_factory(amqp_url)
    with h.conn.transaction():
        ids = [
            enqueue(
                h.conn, event_type=DEFAULT_EVENT, payload=p, aggregate_type="t", aggregate_id=i, table=h.table
            )
            for i, p in enumerate(TYPED)
        ]
    h.worker()
    h.beat()
    h.wait_finished(len(TYPED))
    received = {c["outbox_id"]: c for c in calls(h.conn)}
    for outbox_id, sent in zip(ids, TYPED, strict=True):
        got = received[outbox_id]
        assert got["payload_type"] == type(sent).__name__
        assert same(sent, kombu.utils.json.loads(got["payload_json"]))
    assert list(kombu.utils.json.loads(received[ids[0]]["payload_json"])) == ["b", "a"]


def _failing_start() -> str:
    """The fenced start as shipped, returning a row the library cannot turn into a message."""
    text = named("queries.sql")["start"]
    returned = " attempts, created_at,"
    assert text.count(returned) == 1
    return text.replace(returned, " NULL::integer AS attempts, created_at,")


def test_a_library_failure_before_the_handler_is_recorded_at_once_not_as_a_lost_worker(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    h = harness_factory(redis_url)
    # A lease far longer than the wait: the failure must show before any lease runs out.
    h.configure(lease=120.0, max_attempts=2)
    h.spec.queries = {"start": _failing_start()}
    [outbox_id] = h.enqueue(1)
    h.worker()

    def recorded() -> dict[str, Any] | None:
        r = row(h.conn, h.table, outbox_id)
        return r if r["last_error"] else None

    first = h.wait(recorded, timeout=60, what="last_error of a start that failed in the library")
    assert first["last_error"].startswith(PRE_HANDLER_FAILURE), first["last_error"]
    assert "TypeError" in first["last_error"]
    # Retried after a short backoff (not a lease), then dead, saying what happened.
    dead = h.wait(
        lambda: (r := row(h.conn, h.table, outbox_id))["status"] == "dead" and r,
        timeout=60,
        what="dead after max_attempts",
    )
    assert dead["last_error"].startswith(f"attempts exhausted (2 of 2): {PRE_HANDLER_FAILURE}: TypeError")
    assert "worker lost" not in dead["last_error"]
    assert dead["attempts"] == 2
    assert calls(h.conn) == []  # the handler never ran
    # The Celery task failed visibly, too (Flower, the worker's log); its signal follows the write.
    h.wait(lambda: len(signals(h.conn, "task_failure")) == 2, timeout=30, what="two task failures")
    assert {s["task_name"] for s in signals(h.conn, "task_failure")} == {"outbox.deliver"}
