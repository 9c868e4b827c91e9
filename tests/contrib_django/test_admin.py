"""The admin through Django's test client, on a real PostgreSQL."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import django
import psycopg
import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from outbox_celery import Event, enqueue_many
from outbox_celery.contrib.django.models import OutboxMessage, ReadOnlyError

LIST = "admin:outbox_celery_outboxmessage_changelist"


def _url(**query: str) -> str:
    base = reverse(LIST)
    return base + ("?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else "")


def _detail(outbox_id: int) -> str:
    return reverse("admin:outbox_celery_outboxmessage_change", args=[outbox_id])


@pytest.fixture
def client(django_db: str) -> Client:
    user = User.objects.create_superuser("ops", "ops@example.com", "pw")
    c = Client()
    c.force_login(user)
    return c


@pytest.fixture
def pg(django_db: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(django_db, autocommit=True) as c:
        yield c


def add(pg: psycopg.Connection[Any], *events: Event) -> list[int]:
    with pg.transaction():
        return enqueue_many(pg, events)


def make_dead(pg: psycopg.Connection[Any], ids: list[int], error: str = "PermanentError: 410 Gone") -> None:
    pg.execute(
        "UPDATE outbox SET status = 'dead', attempts = 12, last_error = %s,"
        " lease_version = lease_version + 12 WHERE id = ANY(%s)",
        [error, ids],
    )


def make_processing(pg: psycopg.Connection[Any], ids: list[int], *, expired: bool = False) -> None:
    pg.execute(
        "UPDATE outbox SET status = 'processing', attempts = 1, lease_version = lease_version + 1,"
        " lease_owner = 'celery@web-1', lease_until = now() + %s * interval '1 minute' WHERE id = ANY(%s)",
        [-5 if expired else 5, ids],
    )


def status(pg: psycopg.Connection[Any], outbox_id: int) -> str:
    row = pg.execute("SELECT status FROM outbox WHERE id = %s", [outbox_id]).fetchone()
    assert row is not None
    return str(row[0])


def listed(response: Any) -> list[int]:
    """Message ids on a changelist page, in display order."""
    assert response.status_code == 200, response.content[:2000]
    return [int(i) for i in re.findall(r'name="_selected_action" value="(\d+)"', response.content.decode())]


@pytest.fixture
def shop(pg: psycopg.Connection[Any]) -> dict[str, int]:
    """One message in every state, an ordered key blocked by a dead head and a done one."""
    ids = add(
        pg,
        Event("order.created", {"order_id": 1, "lines": [{"sku": "A-1", "qty": 2}]}, "order", 1),
        Event("order.paid", {"order_id": 2}, "order", 2, ordered=True),  # dead head of order:2
        Event("order.shipped", {"order_id": 2}, "order", 2, ordered=True),  # waits behind it
        Event("invoice.sent", {"invoice": 7}, "invoice", 7),  # processing, live lease
        Event("invoice.sent", {"invoice": 8}, "invoice", 8),  # processing, expired lease
        Event("order.created", {"order_id": 3}, "order", 3),  # done
        Event("order.created", {"order_id": 4}, "order", 4),  # dead, unordered
    )
    names = ["pending", "dead_head", "behind", "processing", "expired", "done", "dead"]
    shop = dict(zip(names, ids, strict=True))
    make_dead(pg, [shop["dead_head"], shop["dead"]])
    make_processing(pg, [shop["processing"]])
    make_processing(pg, [shop["expired"]], expired=True)
    pg.execute("UPDATE outbox SET status = 'done', done_at = now() WHERE id = %s", [shop["done"]])
    return shop


def test_the_list_shows_live_messages_newest_first_with_a_summary(
    client: Client, shop: dict[str, int]
) -> None:
    response = client.get(_url())
    live = sorted((v for k, v in shop.items() if k != "done"), reverse=True)
    assert listed(response) == live
    page = response.content.decode()
    assert "dead 2" in page and "1 ordering key(s) blocked" in page
    assert "1 waiting" in page, "the dead head shows what it blocks"


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({"status": "pending"}, ["pending", "behind"]),
        ({"status": "processing"}, ["processing", "expired"]),
        ({"status": "dead"}, ["dead_head", "dead"]),
        ({"status": "done"}, ["done"]),
        ({"status": "all"}, ["pending", "dead_head", "behind", "processing", "expired", "done", "dead"]),
        ({"event_type": "invoice.sent"}, ["processing", "expired"]),
        ({"event_type": "order.created", "status": "all"}, ["pending", "done", "dead"]),
        ({"ordering_key": "order:2"}, ["dead_head", "behind"]),
        ({"blocked": "heads"}, ["dead_head"]),
        ({"age": "lt1h"}, ["pending", "dead_head", "behind", "processing", "expired", "dead"]),
        ({"age": "gt1h"}, []),
    ],
)
def test_filters(client: Client, shop: dict[str, int], query: dict[str, str], expected: list[str]) -> None:
    assert listed(client.get(_url(**query))) == sorted((shop[n] for n in expected), reverse=True)


def test_filter_choices_list_live_event_types_and_blocked_keys(client: Client, shop: dict[str, int]) -> None:
    page = client.get(_url()).content.decode()
    assert "?event_type=invoice.sent" in page and "?event_type=order.paid" in page
    assert "order:2 (blocked)" in page


def test_a_rows_ordering_key_links_to_every_message_of_its_key(
    client: Client, shop: dict[str, int], pg: psycopg.Connection[Any]
) -> None:
    (odd,) = add(pg, Event("x", {}, "a", 1, ordering_key="tenant #1 & co"))
    page = client.get(_url()).content.decode()
    link = re.search(r'<a href="\?(ordering_key=tenant[^"]*)">tenant #1 &amp; co</a>', page)
    assert link is not None, page
    assert listed(client.get(_url() + "?" + link.group(1).replace("&amp;", "&"))) == [odd]
    link = re.search(r'<a href="\?(ordering_key=order[^"]*)">order:2</a>', page)
    assert link is not None
    expected = [shop["behind"], shop["dead_head"]]
    assert listed(client.get(_url() + "?" + link.group(1).replace("&amp;", "&"))) == expected


def test_the_detail_page_explains_a_dead_message_and_edits_nothing(
    client: Client, shop: dict[str, int]
) -> None:
    page = client.get(_detail(shop["dead_head"])).content.decode()
    assert "PermanentError: 410 Gone" in page
    assert "dead after 12 attempt(s): requeue or skip it; blocks 1 message(s) of its ordering key" in page
    assert "head of its key; 1 unfinished message(s) after it" in page
    form = page.split('id="outboxmessage_form"')[1].split("</form>")[0]
    assert 'type="submit"' not in form and "<textarea" not in form and "<select" not in form
    payload = client.get(_detail(shop["pending"])).content.decode()
    assert "{\n  &quot;lines&quot;: [\n    {\n      &quot;qty&quot;: 2," in payload
    assert "claimable now" in payload


def test_invariant_32_the_detail_page_lists_every_failed_attempt_latest_first_escaped(
    client: Client, shop: dict[str, int], pg: psycopg.Connection[Any]
) -> None:
    assert "failed attempts" in client.get(_detail(shop["pending"])).content.decode().lower()
    entries = [
        {"attempt": 1, "at": "2026-01-02T15:04:05+00:00", "error": "TimeoutError: <b>slow</b> gateway"},
        {"attempt": 2, "at": "2026-01-02T15:09:05+00:00", "error": "PermanentError: 410 Gone"},
    ]
    pg.execute(
        "UPDATE outbox SET errors = %s WHERE id = %s", [psycopg.types.json.Jsonb(entries), shop["dead_head"]]
    )
    page = client.get(_detail(shop["dead_head"])).content.decode()
    table = page.split("<th>attempt</th>")[1].split("</table>")[0]
    assert table.index("410 Gone") < table.index("slow")  # the latest first
    assert "TimeoutError: &lt;b&gt;slow&lt;/b&gt; gateway" in table and "<b>slow" not in table
    assert "2026-01-02" in table and "<td>2</td>" in table and "<td>1</td>" in table


def test_the_detail_page_shows_the_lease(client: Client, shop: dict[str, int]) -> None:
    live = client.get(_detail(shop["processing"])).content.decode()
    assert "leased to celery@web-1 for 4m" in live or "leased to celery@web-1 for 5m" in live
    expired = client.get(_detail(shop["expired"])).content.decode()
    assert "lease expired 4m" in expired or "lease expired 5m" in expired
    assert f"behind #{shop['dead_head']}" in client.get(_detail(shop["behind"])).content.decode()


def test_a_key_without_a_flagged_head_is_shown_as_such_not_as_claimable(
    client: Client, shop: dict[str, int], pg: psycopg.Connection[Any]
) -> None:
    # The head is the flagged message, as the claim reads it (DESIGN invariant 9): a key an
    # older release left without one is never claimed, and the page says so.
    pg.execute("UPDATE outbox SET head = false WHERE ordering_key IS NOT NULL")
    pg.execute("UPDATE outbox SET status = 'pending' WHERE id = %s", [shop["dead_head"]])
    page = client.get(_detail(shop["behind"])).content.decode()
    assert "no message of its ordering key is its head (outbox-celery repair-heads)" in page
    assert "no head in its key (outbox-celery repair-heads)" in page
    assert "claimable now" not in page
    assert listed(client.get(_url(blocked="heads"))) == []


def test_the_model_and_the_detail_page_show_the_newer_columns(
    client: Client, shop: dict[str, int], pg: psycopg.Connection[Any]
) -> None:
    [keyed] = add(pg, Event("order.created", {"order_id": 9}, "order", 9, dedup_key="order-9-created"))
    pg.execute(
        "UPDATE outbox SET started_version = 1, trace_context = %s WHERE id = %s",
        [
            psycopg.types.json.Jsonb(
                {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
            ),
            keyed,
        ],
    )
    row = OutboxMessage.objects.get(pk=keyed)
    assert (row.dedup_key, row.started_version, row.head) == ("order-9-created", 1, False)
    assert row.trace_context == {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    assert OutboxMessage.objects.get(pk=shop["dead_head"]).head
    assert not OutboxMessage.objects.get(pk=shop["behind"]).head
    page = client.get(_detail(keyed)).content.decode()
    for label, value in [
        ("Dedup key", "order-9-created"),
        ("Started version", "1"),
        ("Trace context", "traceparent"),
    ]:
        assert label in page and value in page, label


def _act(client: Client, action: str, ids: list[int], **extra: str) -> str:
    response = client.post(_url(), {"action": action, "_selected_action": ids, **extra}, follow=True)
    assert response.status_code == 200
    return str(response.content.decode())


def test_requeue_moves_dead_messages_back_to_pending(
    client: Client, shop: dict[str, int], pg: psycopg.Connection[Any]
) -> None:
    page = _act(client, "requeue_dead", [shop["dead"], shop["dead_head"]])
    assert "Requeued 2 message(s)" in page
    assert status(pg, shop["dead"]) == status(pg, shop["dead_head"]) == "pending"
    row = pg.execute("SELECT attempts, last_error FROM outbox WHERE id = %s", [shop["dead"]]).fetchone()
    assert row is not None
    assert row[0] == 0 and row[1].startswith("requeued by operator: Django admin user ops (attempts were 12)")


def test_requeue_refuses_the_whole_selection_if_one_is_not_dead(
    client: Client, shop: dict[str, int], pg: psycopg.Connection[Any]
) -> None:
    page = _act(client, "requeue_dead", [shop["dead"], shop["pending"]])
    assert f"Nothing requeued: cannot requeue: message {shop['pending']} is pending" in page
    assert status(pg, shop["dead"]) == "dead"


def test_skip_asks_for_a_reason_then_unblocks_the_key(
    client: Client, shop: dict[str, int], pg: psycopg.Connection[Any]
) -> None:
    page = _act(client, "skip_messages", [shop["dead_head"]])
    assert "Reason (required)" in page and status(pg, shop["dead_head"]) == "dead"
    page = _act(client, "skip_messages", [shop["dead_head"]], confirm="yes", reason="")
    assert "This field is required" in page and status(pg, shop["dead_head"]) == "dead"
    page = _act(client, "skip_messages", [shop["dead_head"]], confirm="yes", reason="refunded by hand")
    assert "Skipped 1 message(s)" in page
    assert status(pg, shop["dead_head"]) == "done"
    error = pg.execute("SELECT last_error FROM outbox WHERE id = %s", [shop["dead_head"]]).fetchone()
    assert error is not None and error[0].startswith(
        "skipped by operator: refunded by hand (Django admin user ops)"
    )
    assert listed(client.get(_url(blocked="heads"))) == []


def test_a_skipped_message_reads_as_skipped_not_delivered(
    client: Client, shop: dict[str, int], pg: psycopg.Connection[Any]
) -> None:
    """Its row stays done (the state machine is unchanged); the admin says what it is."""
    assert "Skipped 1" in _act(client, "skip_messages", [shop["dead"]], confirm="yes", reason="refunded")
    assert status(pg, shop["dead"]) == "done"
    rows = {
        int(i): row
        for i, row in re.findall(
            r'name="_selected_action" value="(\d+)"(.*?)</tr>',
            client.get(_url(status="done")).content.decode(),
            re.S,
        )
    }
    assert ">skipped</b>" in rows[shop["dead"]] and ">done</b>" not in rows[shop["dead"]]
    assert ">done</b>" in rows[shop["done"]] and ">skipped</b>" not in rows[shop["done"]]
    assert (
        "skipped by an operator: done without delivery" in client.get(_detail(shop["dead"])).content.decode()
    )
    assert "done: delivered" in client.get(_detail(shop["done"])).content.decode()


def test_the_detail_page_is_never_stale(client: Client, shop: dict[str, int]) -> None:
    assert (
        "head of its key; 1 unfinished message(s) after it"
        in client.get(_detail(shop["dead_head"])).content.decode()
    )
    assert "Skipped 1" in _act(client, "skip_messages", [shop["behind"]], confirm="yes", reason="obsolete")
    assert (
        "head of its key; 0 unfinished message(s) after it"
        in client.get(_detail(shop["dead_head"])).content.decode()
    )


def test_skip_refuses_a_processing_message(
    client: Client, shop: dict[str, int], pg: psycopg.Connection[Any]
) -> None:
    page = _act(client, "skip_messages", [shop["dead"], shop["processing"]], confirm="yes", reason="x")
    assert f"Nothing skipped: cannot skip: message {shop['processing']} is processing" in page
    assert status(pg, shop["dead"]) == "dead" and status(pg, shop["processing"]) == "processing"


def test_nothing_can_be_added_changed_or_deleted(
    client: Client, shop: dict[str, int], pg: psycopg.Connection[Any]
) -> None:
    assert client.get(reverse("admin:outbox_celery_outboxmessage_add")).status_code == 403
    assert client.post(_detail(shop["dead"]), {"status": "pending"}).status_code == 403
    assert (
        client.get(reverse("admin:outbox_celery_outboxmessage_delete", args=[shop["done"]])).status_code
        == 403
    )
    assert "delete_selected" not in client.get(_url()).content.decode()
    message = OutboxMessage.objects.get(pk=shop["dead"])
    with pytest.raises(ReadOnlyError):
        message.save()
    with pytest.raises(ReadOnlyError):
        message.delete()
    assert status(pg, shop["dead"]) == "dead"


def test_the_list_never_counts_the_whole_table(client: Client, pg: psycopg.Connection[Any]) -> None:
    """1,500 rows: above the exact-count cap, so the paginator takes PostgreSQL's estimate."""
    pg.execute(
        "INSERT INTO outbox (event_type, aggregate_type, aggregate_id, payload, status)"
        " SELECT 'bulk', 'o', i::text, '{}', 'dead' FROM generate_series(1, 1500) AS i"
    )
    pg.execute("ANALYZE outbox")
    pages: list[dict[str, str]] = [{}, {"status": "dead"}, {"status": "all"}, {"event_type": "bulk"}]
    if django.VERSION >= (5, 0):  # Django 5's "Show counts" would count the table per filter choice
        pages.append({"_facets": "1"})
    for query in pages:
        with CaptureQueriesContext(connection) as queries:
            ids = listed(client.get(_url(**query)))
        assert len(ids) == 50 and ids[0] > ids[-1]
        run = [q["sql"] for q in queries.captured_queries if not q["sql"].startswith("EXPLAIN")]
        counts = [sql for sql in run if sql.startswith("SELECT COUNT(")]
        assert counts, "the paginator counted"
        # Bounded counts only: the paginator's capped count and Django's count of the page.
        assert all(re.search(r"LIMIT (1001|50)\b", sql) for sql in counts), counts
        assert any("LIMIT 1001" in sql for sql in counts), counts
        assert any(q["sql"].startswith("EXPLAIN (FORMAT JSON)") for q in queries.captured_queries)


# -- plans on a table with history: every list query reaches rows through an index ------------


QUERIES: list[dict[str, str]] = [
    {},
    {"status": "pending"},
    {"status": "processing"},
    {"status": "dead"},
    {"blocked": "heads"},
    {"event_type": "order.created"},
    {"ordering_key": "order:2"},
    {"age": "gt5m"},
]


def test_list_queries_use_the_partial_indexes_not_a_scan_of_the_history(
    client: Client, shop: dict[str, int], pg: psycopg.Connection[Any]
) -> None:
    """100,000 done rows of history: every query of every filtered page reaches rows by an index."""
    pg.execute(
        "INSERT INTO outbox"
        " (event_type, aggregate_type, aggregate_id, payload, status, done_at, ordering_key)"
        " SELECT 'order.created', 'order', i::text, '{}', 'done', now(),"
        "        CASE WHEN i % 3 = 0 THEN 'order:' || i END"
        " FROM generate_series(1, 100000) AS i"
    )
    pg.execute("ANALYZE outbox")
    for query in QUERIES:
        with CaptureQueriesContext(connection) as queries:
            listed(client.get(_url(**query)))
        on_outbox = [q["sql"] for q in queries.captured_queries if '"outbox"' in q["sql"]]
        assert on_outbox
        for sql in on_outbox:
            explain = sql if sql.startswith("EXPLAIN") else "EXPLAIN " + sql
            plan = "\n".join(str(r[0]) for r in pg.execute(explain).fetchall())
            assert "Seq Scan on outbox" not in plan, f"{query}: {sql}\n{plan}"


def _paused(pg: psycopg.Connection[Any], event_type: str) -> bool:
    row = pg.execute(
        "SELECT coalesce(bool_or(paused), false) FROM outbox_flow WHERE event_type = %s", [event_type]
    ).fetchone()
    return bool(row and row[0])


def test_pause_and_resume_the_event_types_of_a_selection(
    client: Client, shop: dict[str, int], pg: psycopg.Connection[Any]
) -> None:
    """The admin pauses what `outbox-celery pause` pauses, shows it, and resumes it."""
    page = _act(client, "pause_event_types", [shop["pending"], shop["dead"], shop["processing"]])
    assert "Paused invoice.sent, order.created" in page
    assert _paused(pg, "order.created") and _paused(pg, "invoice.sent")
    assert not _paused(pg, "order.paid")
    summary = client.get(_url()).content.decode()
    flow = summary[summary.index('id="outbox-flow"') :]
    assert "<b>invoice.sent</b>" in flow and "<b>order.created</b>" in flow and "paused" in flow
    assert "already paused: order.created" in _act(client, "pause_event_types", [shop["pending"]]).lower()

    page = _act(client, "resume_event_types", [shop["pending"]])
    assert "Resumed order.created" in page
    assert not _paused(pg, "order.created") and _paused(pg, "invoice.sent")
    page = _act(client, "resume_event_types", [shop["dead"]]).lower()
    assert "neither paused nor held: order.created" in page
    summary = client.get(_url()).content.decode()
    assert "<b>order.created</b>" not in summary[summary.index('id="outbox-summary"') :].split("</div>")[0]


def test_pause_and_resume_the_limit_keys_of_a_selection(client: Client, pg: psycopg.Connection[Any]) -> None:
    """A limit key paused from the admin, shown above the list, resumed; other keys untouched."""
    a, b, _ = add(
        pg,
        Event("webhook.sent", {"n": 1}, "tenant", 1, limit_key="tenant-1"),
        Event("webhook.sent", {"n": 2}, "tenant", 2, limit_key="tenant-2"),
        Event("webhook.sent", {"n": 3}, "tenant", 3),
    )

    def key_paused(key: str) -> bool:
        row = pg.execute(
            "SELECT coalesce(bool_or(paused), false) FROM outbox_flow_key WHERE limit_key = %s", [key]
        ).fetchone()
        return bool(row and row[0])

    page = _act(client, "pause_limit_keys", [a])
    assert "Paused webhook.sent key tenant-1" in page
    assert key_paused("tenant-1") and not key_paused("tenant-2") and not _paused(pg, "webhook.sent")
    summary = client.get(_url()).content.decode()
    held = summary[summary.index('id="outbox-flow-keys"') :]
    assert "<b>tenant-1</b>" in held and "paused" in held and "tenant-2" not in held.split("</p>")[0]

    page = _act(client, "resume_limit_keys", [a, b])
    assert "Resumed webhook.sent key tenant-1" in page
    assert "neither paused nor held: webhook.sent key tenant-2" in page.lower()
    assert not key_paused("tenant-1")
    assert 'id="outbox-flow-keys"' not in client.get(_url()).content.decode()


def test_invariant_28_a_subscriptions_row_shows_its_route_and_the_payload_stored_once(
    client: Client, pg: psycopg.Connection[Any]
) -> None:
    from outbox_celery.ops import subscriptions

    for name in ("receipt", "search"):
        subscriptions.add(pg, "outbox", "order.paid", name)
    add(pg, Event("order.paid", {"total": "9.90"}, "order", "1"))
    rows = list(OutboxMessage.objects.filter(event_type__startswith="order.paid@").order_by("pk"))
    assert [r.event_type for r in rows] == ["order.paid@receipt", "order.paid@search"]
    assert rows[1].payload is None and rows[1].payload_of == rows[0].pk
    page = client.get(_detail(rows[1].pk)).content.decode()
    assert "&quot;total&quot;: &quot;9.90&quot;" in page and "order.paid@search" in page
    assert "order.paid@search" in client.get(_url()).content.decode()


GROUPS = "admin:outbox_celery_outboxgroup_changelist"


def test_invariant_29_groups_are_listed_with_their_progress_and_finished_or_cancelled_by_hand(
    client: Client, pg: psycopg.Connection[Any]
) -> None:
    from outbox_celery import group

    made = []
    for n in range(2):
        with pg.transaction():
            parts = [Event("part", {"i": i}, "p", i) for i in range(3)]
            made.append(group(pg, parts, then=Event("done", {"n": n}, "p", n)).id)
    page = client.get(reverse(GROUPS)).content.decode()
    assert "0 of 3" in page and "open" in page
    assert "2 open group(s)" in client.get(_url()).content.decode()
    r = client.post(reverse(GROUPS), {"action": "finish_groups", "_selected_action": [made[0]]}, follow=True)
    assert "Finished 1 group(s)" in r.content.decode()
    r = client.post(reverse(GROUPS), {"action": "cancel_groups", "_selected_action": made}, follow=True)
    assert "Cancelled 1 group(s)" in r.content.decode() and "Not open" in r.content.decode()
    states = pg.execute("SELECT state FROM outbox_group ORDER BY id").fetchall()
    assert states == [("finished",), ("cancelled",)]
    assert pg.execute("SELECT count(*) FROM outbox WHERE event_type = 'done'").fetchone() == (1,)


def test_invariant_28_the_ordering_key_filter_finds_a_producers_key_on_every_subscription(
    client: Client, pg: psycopg.Connection[Any]
) -> None:
    from outbox_celery.ops import subscriptions

    for name in ("receipt", "search"):
        subscriptions.add(pg, "outbox", "order.paid", name)
    add(
        pg,
        Event("order.paid", {}, "order", "1", ordering_key="tenant_1"),
        Event("order.created", {}, "order", "1", ordering_key="tenant_1"),
        Event("order.paid", {}, "order", "2", ordering_key="tenantX1"),  # "_" is not a wildcard
    )
    rows = {(r.event_type, r.ordering_key): r.pk for r in OutboxMessage.objects.all()}
    assert len(rows) == 5
    receipt = rows[("order.paid@receipt", "tenant_1\x1forder.paid@receipt")]
    search = rows[("order.paid@search", "tenant_1\x1forder.paid@search")]
    created = rows[("order.created", "tenant_1")]
    assert listed(client.get(_url(ordering_key="tenant_1"))) == sorted(
        [created, search, receipt], reverse=True
    )
    # A subscription's stored key (a row's link) is that subscription's rows alone.
    assert listed(client.get(reverse(LIST) + "?ordering_key=tenant_1%1Forder.paid%40search")) == [search]
