"""``outbox_celery.contrib.django.enqueue``: Django's connection, Django's transactions."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from django.db import IntegrityError, transaction
from django.test.utils import override_settings
from support import steps

from outbox_celery import Event, ProducerError, migrate
from outbox_celery.contrib.django import enqueue, enqueue_group, enqueue_many

from .testapp.models import Order


def _events(dsn: str, table: str = "outbox") -> list[dict[str, Any]]:
    """What another session sees: only committed rows."""
    with psycopg.connect(dsn) as c, c.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute(
            psycopg.sql.SQL(
                "SELECT id, event_type, payload, ordering_key, limit_key, status FROM {} ORDER BY id"
            ).format(psycopg.sql.Identifier(*table.split(".")))
        ).fetchall()


def _order_created(order: Order, **kw: Any) -> int:
    return enqueue(
        event_type="order.created",
        payload={"order_id": order.pk, "total": order.total},
        aggregate_type="order",
        aggregate_id=order.pk,
        **kw,
    )


def test_enqueue_inside_atomic_commits_with_the_business_data(django_db: str) -> None:
    with transaction.atomic():
        order = Order.objects.create(total=42)
        outbox_id = _order_created(order)
        assert _events(django_db) == [], "visible before commit"
    rows = _events(django_db)
    assert [(r["id"], r["payload"]) for r in rows] == [(outbox_id, {"order_id": order.pk, "total": 42})]
    assert rows[0]["status"] == "pending"


def test_enqueue_outside_atomic_is_refused_and_writes_nothing(django_db: str) -> None:
    order = Order.objects.create(total=1)  # autocommit, as Django runs outside atomic()
    with pytest.raises(ProducerError, match=r"inside transaction\.atomic\(using='default'\)"):
        _order_created(order)
    with pytest.raises(ProducerError, match="atomic"):
        enqueue_many([Event("order.created", {}, "order", order.pk)])
    assert _events(django_db) == []


def test_a_rolled_back_atomic_leaves_no_event(django_db: str) -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        order = Order.objects.create(total=7)
        _order_created(order)
        raise RuntimeError("business rule failed")
    assert _events(django_db) == []
    assert not Order.objects.exists()


def test_a_rolled_back_savepoint_takes_its_event_with_it(django_db: str) -> None:
    """Nested atomic: the inner block's event goes with the inner rollback; the outer one stays."""
    with transaction.atomic():
        order = Order.objects.create(total=10)
        kept = _order_created(order)
        try:
            with transaction.atomic():
                enqueue(
                    event_type="order.discounted", payload={}, aggregate_type="order", aggregate_id=order.pk
                )
                Order.objects.create(total=-1)
                raise IntegrityError("simulated constraint failure")
        except IntegrityError:
            pass
        after = enqueue(
            event_type="order.confirmed", payload={}, aggregate_type="order", aggregate_id=order.pk
        )
    assert [r["id"] for r in _events(django_db)] == [kept, after]
    assert [r["event_type"] for r in _events(django_db)] == ["order.created", "order.confirmed"]
    assert Order.objects.count() == 1


def test_an_event_in_a_committed_savepoint_is_rolled_back_with_the_outer_block(django_db: str) -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        with transaction.atomic():
            _order_created(Order.objects.create(total=3))
        raise RuntimeError("outer block fails")
    assert _events(django_db) == []


def test_an_atomic_block_marked_for_rollback_is_refused(django_db: str) -> None:
    with transaction.atomic():
        order = Order.objects.create(total=5)
        transaction.set_rollback(True)
        with pytest.raises(ProducerError, match="marked for rollback"):
            _order_created(order)
    assert _events(django_db) == []


def test_enqueue_many_and_the_core_options_pass_through(django_db: str) -> None:
    with transaction.atomic():
        ids = enqueue_many(
            [
                Event("order.paid", {"n": 1}, "order", 9, ordered=True),
                {
                    "event_type": "order.shipped",
                    "payload": {"n": 2},
                    "aggregate_type": "order",
                    "aggregate_id": 9,
                    "ordering_key": "order:9",
                },
            ]
        )
        single = enqueue(
            event_type="x", payload=[], aggregate_type="a", aggregate_id="1", delay=3600, limit_key="tenant-1"
        )
    rows = _events(django_db)
    assert [r["id"] for r in rows] == [*ids, single]
    assert [r["ordering_key"] for r in rows] == ["order:9", "order:9", None]
    assert [r["limit_key"] for r in rows] == [None, None, "tenant-1"]


def test_bad_input_is_refused_before_anything_is_written(django_db: str) -> None:
    with transaction.atomic():
        with pytest.raises(ProducerError, match="JSON"):
            enqueue(event_type="x", payload={1, 2}, aggregate_type="a", aggregate_id=1)
        with pytest.raises(ProducerError, match="allow_autocommit"):
            enqueue(event_type="x", payload={}, aggregate_type="a", aggregate_id=1, allow_autocommit=True)
    assert _events(django_db) == []


def test_the_table_and_payload_limit_come_from_the_celery_settings(django_db: str) -> None:
    with psycopg.connect(django_db, autocommit=True) as c:
        migrate(c, "shop.events")
    with (
        override_settings(CELERY_OUTBOX_TABLE="shop.events", CELERY_OUTBOX_MAX_PAYLOAD_BYTES=20),
        transaction.atomic(),
    ):
        outbox_id = enqueue(event_type="x", payload={"a": 1}, aggregate_type="a", aggregate_id=1)
        with pytest.raises(ProducerError, match="the limit is 20"):
            enqueue(event_type="x", payload={"a": "x" * 30}, aggregate_type="a", aggregate_id=1)
    assert [r["id"] for r in _events(django_db, "shop.events")] == [outbox_id]
    assert _events(django_db) == []


def test_using_writes_on_another_alias_and_needs_its_own_atomic(django_db: str) -> None:
    """``using=`` picks the alias; ``atomic()`` on another alias does not cover it."""
    with transaction.atomic(using="default"), pytest.raises(ProducerError, match="using='other'"):
        enqueue(event_type="x", payload={}, aggregate_type="a", aggregate_id=1, using="other")
    with transaction.atomic(using="other"):
        outbox_id = enqueue(event_type="x", payload={}, aggregate_type="a", aggregate_id=1, using="other")
    assert [r["id"] for r in _events(django_db)] == [outbox_id]


def test_enqueue_before_migrate_says_to_run_migrate(django_db: str) -> None:
    """A table the migrations never made (here: another name) is named, with what to run."""
    with (
        override_settings(CELERY_OUTBOX_TABLE="never_migrated"),
        pytest.raises(ProducerError, match=r"never_migrated does not exist .*`manage\.py migrate`"),
        transaction.atomic(),
    ):
        _order_created(Order.objects.create(total=3))
    assert _events(django_db) == []


def test_invariant_27_djangos_enqueue_hands_over_what_was_enqueued(django_db: str) -> None:
    from decimal import Decimal

    from support.payloads import same

    from outbox_celery import Store
    from outbox_celery.contrib.django.models import OutboxMessage

    sent = [{"b": 1, "a": 2}, 1e20, {"total": Decimal("1.10")}, "1"]
    with transaction.atomic():
        order = Order.objects.create(total=3)
        ids = [
            enqueue(event_type="e", payload=p, aggregate_type="order", aggregate_id=order.pk) for p in sent
        ]
        ids += enqueue_many([Event("e", p, "order", order.pk) for p in sent])
    # The admin's model shows the stored JSON (kombu's typed values as their objects).
    shown = {m.pk: m.payload for m in OutboxMessage.objects.filter(pk__in=ids)}
    assert shown[ids[2]] == {"total": {"__type__": "decimal", "__value__": "1.10"}}
    assert shown[ids[3]] == "1" and list(shown[ids[0]]) == ["b", "a"]
    store = Store("outbox")
    with psycopg.connect(django_db, autocommit=True) as c:
        claimed = steps.claim(store, c, limit=20, lease=60, owner="w", max_attempts=5).claimed
        got = {
            m.id: m.payload
            for m in steps.start_many(
                store, c, [(x.id, x.lease_version) for x in claimed], lease=60, max_attempts=5, starter="t"
            )
        }
    for outbox_id, value in zip(ids, sent + sent, strict=True):
        assert same(value, got[outbox_id])


def test_invariant_29_a_group_commits_and_rolls_back_with_the_atomic_block(django_db: str) -> None:
    parts = [Event("part", {"i": i}, "order", i) for i in range(3)]
    with pytest.raises(RuntimeError), transaction.atomic():
        enqueue_group(parts, then=Event("order.ready", {}, "order", 1))
        raise RuntimeError("business rule failed")
    assert _events(django_db) == []
    with transaction.atomic():
        Order.objects.create(total=3)
        g = enqueue_group(parts, then=Event("order.ready", {}, "order", 1), skip_on_dead=True)
        assert _events(django_db) == [], "visible before commit"
    assert [r["id"] for r in _events(django_db)] == g.member_ids
    with psycopg.connect(django_db) as c:
        assert c.execute("SELECT total, skip_on_dead FROM outbox_group").fetchall() == [(3, True)]
