"""The operator console (outbox_celery.web) through Starlette's TestClient, on a real PostgreSQL.

What the console shows, what it changes, and above all what it refuses: a POST without auth,
with actions off, without or with a wrong CSRF token, or from another origin changes nothing;
untrusted text renders as text; no DSN or password reaches a page or an error.
"""

from __future__ import annotations

import html
import re
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from starlette.testclient import TestClient
from support import steps

from outbox_celery import Event, Store, enqueue_many, ops
from outbox_celery.cli import cli
from outbox_celery.db.migrations import migrate
from outbox_celery.ops import console, subscriptions
from outbox_celery.web import Database, create_app

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SCRIPT = "<script>window.pwned = 1</script>"


def _dead(conn: psycopg.Connection[Any], ids: list[int], error: str) -> None:
    conn.execute(
        "UPDATE outbox SET status = 'dead', attempts = 3, last_error = %s WHERE id = ANY(%s)", [error, ids]
    )


def _statuses(conn: psycopg.Connection[Any]) -> dict[int, str]:
    return {int(r[0]): str(r[1]) for r in conn.execute("SELECT id, status FROM outbox ORDER BY id")}


@pytest.fixture
def seeded(conn: psycopg.Connection[Any]) -> dict[str, list[int]]:
    with conn.transaction():
        hooks = enqueue_many(
            conn, [Event("webhook.sent", {"n": i, "to": "partner-a"}, "hook", str(i)) for i in range(4)]
        )
        mails = enqueue_many(
            conn, [Event("mail.sent", {"n": i, "body": SCRIPT}, "mail", str(i)) for i in range(3)]
        )
    _dead(conn, hooks[:3], "HTTP 410 gone from partner-a")
    _dead(conn, [hooks[3]], "HTTP 500 from partner-b")
    _dead(conn, [mails[0]], f"mailer said {SCRIPT}")
    return {"hooks": hooks, "mails": mails}


@pytest.fixture
def client(migrated_dsn: str) -> Iterator[TestClient]:
    app = create_app([Database("main", migrated_dsn)], actions=True, token=TOKEN)
    with TestClient(app, headers=AUTH) as c:
        yield c


def _form(client: TestClient, url: str) -> dict[str, str]:
    """The hidden fields of the first POST form on ``url`` (its CSRF token among them)."""
    page = client.get(url)
    assert page.status_code == 200, page.text
    form = re.search(r'<form method="post".*?</form>', page.text, re.S)
    assert form is not None, page.text
    return dict(re.findall(r'<input type="hidden" name="([a-z_]+)" value="([^"]*)"', form.group(0)))


def test_overview_counts_each_type_and_two_tables_side_by_side(
    migrated_dsn: str, conn: psycopg.Connection[Any], seeded: dict[str, list[int]]
) -> None:
    with psycopg.connect(migrated_dsn, autocommit=True) as other:
        other.execute("CREATE SCHEMA billing")
        migrate(other, "billing.outbox")
        with other.transaction():
            enqueue_many(other, [Event("invoice.paid", {}, "invoice", "1")], table="billing.outbox")
    app = create_app([Database("shop", migrated_dsn), Database("billing", migrated_dsn, "billing.outbox")])
    with TestClient(app) as c:
        page = c.get("/")
    assert page.status_code == 200
    panels = re.findall(r'<section class="panel database" data-db="([^"]+)">(.*?)</section>', page.text, re.S)
    assert [name for name, _ in panels] == ["shop", "billing"]
    shop, billing = (body for _, body in panels)
    row = re.search(r"<td>webhook.sent</td>(.*?)</tr>", shop, re.S)
    assert row is not None
    cells = re.findall(r'<td class="n">(.*?)</td>', row.group(1), re.S)
    # ready, in flight, retrying, scheduled, behind key, dead
    assert [re.sub(r"<[^>]+>", "", c) for c in cells[:6]] == ["0", "0", "0", "0", "0", "4"]
    assert "<td>mail.sent</td>" in shop and "invoice.paid" not in shop
    assert "<td>invoice.paid</td>" in billing and "webhook.sent" not in billing
    assert "read-only" in page.text


def test_a_count_past_the_cap_reads_as_a_lower_bound(migrated_dsn: str, seeded: dict[str, list[int]]) -> None:
    with TestClient(create_app([Database("main", migrated_dsn)], cap=3)) as c:
        page = c.get("/").text
    assert re.search(
        r'<tr class="total"><td>all</td>.*?<td class="n"><a [^>]*>3\+</a></td><td class="n">[^<]*</td></tr>',
        page,
        re.S,
    ), page


def test_dead_letters_filter_by_type_key_error_and_payload(
    client: TestClient, seeded: dict[str, list[int]]
) -> None:
    def ids(query: str) -> list[int]:
        page = client.get(f"/db/main/dead?{query}")
        assert page.status_code == 200
        return [int(i) for i in re.findall(r'<a href="/db/main/message/(\d+)">', page.text)]

    hooks, mails = seeded["hooks"], seeded["mails"]
    assert ids("") == sorted(hooks + mails[:1])
    assert ids("event_type=mail.sent") == mails[:1]
    assert ids("error=partner-A") == hooks[:3]  # case-insensitive
    assert ids(f"key={hooks[3]}") == []  # keys are matched, not ids
    assert ids("key=3") == [hooks[3]]  # the aggregate id
    assert ids("payload=window.pwned") == mails[:1]
    assert ids("error=%25") == []  # LIKE's wildcards are plain text


def test_the_payload_filter_finds_every_subscriptions_row_through_its_owner(
    client: TestClient, conn: psycopg.Connection[Any]
) -> None:
    # Invariant 28: only the first subscription's row keeps the payload; the others read it
    # through payload_of. The list, the count and "replay all" by that filter take all three.
    for name in ("receipt", "search", "warehouse"):
        subscriptions.add(conn, "outbox", "order.paid", name)
    with conn.transaction():
        enqueue_many(
            conn,
            [
                Event("order.paid", {"partner": "partner-z"}, "order", "1"),
                Event("order.paid", {"partner": "partner-y"}, "order", "2"),
            ],
        )
    fanned = [int(r[0]) for r in conn.execute("SELECT id FROM outbox ORDER BY id")]
    assert len(fanned) == 6
    _dead(conn, fanned, "HTTP 503")
    z = [
        int(r[0])
        for r in conn.execute(
            "SELECT o.id FROM outbox AS o JOIN outbox AS w ON w.id = coalesce(o.payload_of, o.id)"
            " WHERE w.payload::text LIKE '%%partner-z%%' ORDER BY o.id"
        )
    ]
    assert len(z) == 3

    page = client.get("/db/main/dead?payload=PARTNER-Z")
    assert [int(i) for i in re.findall(r'<a href="/db/main/message/(\d+)">', page.text)] == z
    assert re.search(r'id="count"><strong>3</strong>', page.text), page.text
    fields = _form(client, "/db/main/dead/confirm?action=requeue&payload=partner-z")
    assert fields["upto"] == str(z[-1])
    done = client.post("/db/main/dead/bulk", data=fields)
    assert re.search(r'id="result"><strong>3</strong>', done.text), done.text
    after = _statuses(conn)
    assert [after[i] for i in z] == ["pending"] * 3
    assert sorted(i for i in fanned if after[i] == "dead") == sorted(set(fanned) - set(z))


def _flagged(page: str, db: str = "main") -> dict[str, list[str]]:
    """The red attention lines of ``db``'s panel, by event type (kind: text)."""
    panel = re.search(rf'data-db="{db}">(.*?)</section>', page, re.S)
    assert panel is not None, page
    out: dict[str, list[str]] = {}
    for kind, event_type, text in re.findall(
        r'<li data-kind="([a-z]+)"><strong>(.*?)</strong>: (.*?)</li>', panel.group(1)
    ):
        out.setdefault(event_type, []).append(f"{kind}: {text}")
    return out


def test_a_typod_or_stuck_event_type_is_flagged_in_red_as_stats_does(
    migrated_dsn: str, conn: psycopg.Connection[Any]
) -> None:
    subscriptions.add(conn, "outbox", "order.paid", "receipt")
    subscriptions.add(conn, "outbox", "order.paid", "gone")
    with conn.transaction():
        enqueue_many(
            conn,
            [
                Event("webhook.sent", {}, "hook", "1"),
                Event("webhok.sent", {}, "hook", "2"),  # the typo: no handler takes it
                Event("order.paid", {}, "order", "3"),
                Event("mail.sent", {}, "mail", "4"),
            ],
        )
    subscriptions.remove(conn, "outbox", "order.paid", "gone")
    # A message claimed twice whose task no worker started (a queue without a consumer).
    conn.execute("UPDATE outbox SET lease_version = 2 WHERE event_type = 'mail.sent'")
    # With the app (-A): its handlers decide at once.
    app = create_app(
        [
            Database(
                "main", migrated_dsn, handlers=frozenset({"webhook.sent", "order.paid@receipt", "mail.sent"})
            )
        ]
    )
    with TestClient(app) as c:
        page = c.get("/").text
    assert _flagged(page) == {
        "order.paid@gone": [
            "unroutable: no handler in the app: its messages are never delivered (unroutable)"
        ],
        "webhok.sent": ["unroutable: no handler in the app: its messages are never delivered (unroutable)"],
        "mail.sent": [
            "unstarted: 1 message(s) claimed without a worker starting them: does its queue have a consumer?"
        ],
    }
    assert '<tr class="bad flagged" data-type="webhok.sent">' in page
    assert '<tr data-type="webhook.sent">' in page

    # Without the app: what the database knows. The removed subscription's route at once; the
    # typo once it has waited past a claim interval and a margin with nobody claiming it.
    with TestClient(create_app([Database("main", migrated_dsn)])) as c:
        page = c.get("/").text
        assert set(_flagged(page)) == {"order.paid@gone", "mail.sent"}
        assert _flagged(page)["order.paid@gone"] == [
            "unroutable: subscription removed: no handler takes its rows (skip or purge them)"
        ]
        conn.execute("UPDATE outbox SET available_at = now() - interval '2 minutes'")
        ops.pause(conn, "outbox", "webhook.sent")  # paused: unclaimed on purpose, not flagged
        page = c.get("/").text
    flagged = _flagged(page)
    assert set(flagged) == {"order.paid@gone", "mail.sent", "webhok.sent", "order.paid@receipt"}
    assert flagged["webhok.sent"] == [
        "unclaimed: ready for 2m, unclaimed: no claim worker running (a worker consuming the claim "
        "queue, and beat), or no handler for it in the app that claims"
    ]


def test_every_count_links_to_a_page_of_the_rows_behind_it(
    client: TestClient, conn: psycopg.Connection[Any]
) -> None:
    with conn.transaction():
        ids = enqueue_many(conn, [Event("webhook.sent", {"n": i}, "hook", str(i)) for i in range(8)])
        ordered = enqueue_many(
            conn, [Event("mail.sent", {"n": i}, "mail", "m", ordering_key="k") for i in range(3)]
        )
    ready, flight, retrying, scheduled, dead = ids[:2], ids[2:3], ids[3:5], ids[5:7], ids[7:]
    conn.execute(
        "UPDATE outbox SET status = 'processing', lease_until = now() + interval '1 minute',"
        " lease_version = 1 WHERE id = ANY(%s)",
        [flight],
    )
    conn.execute(
        "UPDATE outbox SET available_at = now() + interval '1 hour', attempts = 1 WHERE id = ANY(%s)",
        [retrying],
    )
    conn.execute("UPDATE outbox SET available_at = now() + interval '1 hour' WHERE id = ANY(%s)", [scheduled])
    _dead(conn, dead, "HTTP 500")
    page = client.get("/").text
    row = re.search(r'<tr data-type="webhook.sent">(.*?)</tr>', page, re.S)
    assert row is not None, page
    links = dict(
        (html.unescape(url), int(n)) for url, n in re.findall(r'<a href="([^"]+)">(\d+)</a>', row.group(1))
    )
    assert links == {
        "/db/main/messages?state=ready&event_type=webhook.sent": 2,
        "/db/main/messages?state=in_flight&event_type=webhook.sent": 1,
        "/db/main/messages?state=retrying&event_type=webhook.sent": 2,
        "/db/main/messages?state=scheduled&event_type=webhook.sent": 2,
        "/db/main/dead?event_type=webhook.sent": 1,
    }
    expected = {
        "ready": ready,
        "in_flight": flight,
        "retrying": retrying,
        "scheduled": scheduled,
    }
    for url, n in links.items():
        listed = client.get(url)
        assert listed.status_code == 200, listed.text
        shown = [int(i) for i in re.findall(r'<a href="/db/main/message/(\d+)">', listed.text)]
        state = url.partition("state=")[2].partition("&")[0]
        assert shown == expected.get(state, dead), url
        if state:
            assert re.search(rf'id="count"><strong>{n}</strong>', listed.text), listed.text
    # The totals link too, and the ordered messages waiting behind their key's head.
    behind = client.get("/db/main/messages?state=behind_key").text
    assert [int(i) for i in re.findall(r'<a href="/db/main/message/(\d+)">', behind)] == ordered[1:]
    assert client.get("/db/main/messages?state=nope").status_code == 400


def test_the_dead_page_reads_what_the_list_and_the_count_read_in_one_statement(
    conn: psycopg.Connection[Any], seeded: dict[str, list[int]]
) -> None:
    queries = [
        console.DeadQuery(),
        console.DeadQuery(error="partner-a"),
        console.DeadQuery(payload="pwned", event_type="mail.sent"),
        console.DeadQuery(key="nothing"),
    ]
    for q in queries:
        for after in (0, seeded["hooks"][1]):
            found = console.dead_page(conn, "outbox", q, after=after, limit=2)
            listed = console.list_dead(conn, "outbox", q, after=after, limit=2)
            # age is read against each statement's now()
            assert [replace(r, age=0) for r in found.rows] == [replace(r, age=0) for r in listed], (q, after)
            assert (found.matching, found.upto) == console.count_dead(conn, "outbox", q), q


def test_untrusted_text_renders_as_text(client: TestClient, seeded: dict[str, list[int]]) -> None:
    mail = seeded["mails"][0]
    for url in ("/db/main/dead", f"/db/main/message/{mail}", "/db/main/dead?payload=pwned"):
        page = client.get(url)
        assert page.status_code == 200
        assert SCRIPT not in page.text, url
        assert "&lt;script&gt;window.pwned = 1&lt;/script&gt;" in page.text, url
    # And a script that got in anyway would not run: only the page's own nonce'd script may.
    assert "script-src 'nonce-" in page.headers["content-security-policy"]


def test_a_payload_shows_as_its_handler_receives_it_not_as_kombus_envelope(
    client: TestClient, conn: psycopg.Connection[Any]
) -> None:
    order = uuid.UUID("1b4e28ba-2fa1-11d2-883f-0016d3cca427")
    body = {
        "order": order,
        "total": Decimal("12.50"),
        "at": datetime(2024, 5, 1, 12, tzinfo=UTC),
        "n": SCRIPT,
    }
    [dead] = enqueue_many(conn, [Event("order.paid", body, "order", "1")], allow_autocommit=True)
    _dead(conn, [dead], "HTTP 500")
    page = client.get(f"/db/main/message/{dead}").text
    shown = re.search(r'<pre id="payload">(.*?)</pre>', page, re.S)
    assert shown is not None, page
    assert "__type__" not in shown.group(1)
    assert "UUID 1b4e28ba-2fa1-11d2-883f-0016d3cca427" in shown.group(1)
    assert "Decimal 12.50" in shown.group(1)
    assert "datetime 2024-05-01 12:00:00+00:00" in shown.group(1)
    assert "&#34;n&#34;: &#34;&lt;script&gt;window.pwned = 1&lt;/script&gt;&#34;" in shown.group(1)
    # The dead-letter list shows it on one line, decoded too; a UUID in its usual form finds
    # the payload, which kombu stores as hex.
    listed = client.get(f"/db/main/dead?payload={order}").text
    assert f'href="/db/main/message/{dead}"' in listed
    assert "UUID 1b4e28ba-2fa1-11d2-883f-0016d3cca427" in listed and "__type__" not in listed


def test_a_bulk_replay_by_filter_moves_exactly_the_matching_rows(
    client: TestClient, conn: psycopg.Connection[Any], seeded: dict[str, list[int]]
) -> None:
    confirm = client.get("/db/main/dead/confirm?action=requeue&error=partner-a")
    assert re.search(r'id="confirm-count"><strong>3</strong>', confirm.text), confirm.text
    fields = _form(client, "/db/main/dead/confirm?action=requeue&error=partner-a")
    # A message that dies matching the filter after the count is not taken by the action.
    [late] = enqueue_many(conn, [Event("webhook.sent", {}, "hook", "9")], allow_autocommit=True)
    _dead(conn, [late], "HTTP 410 gone from partner-a")

    done = client.post("/db/main/dead/bulk", data={**fields, "reason": "partner back"})
    assert done.status_code == 200, done.text
    assert re.search(r'id="result"><strong>3</strong>', done.text)
    after = _statuses(conn)
    hooks, mails = seeded["hooks"], seeded["mails"]
    assert [after[i] for i in hooks] == ["pending", "pending", "pending", "dead"]
    assert after[mails[0]] == "dead" and after[late] == "dead"


def test_replay_and_skip_one_message(
    client: TestClient, conn: psycopg.Connection[Any], seeded: dict[str, list[int]]
) -> None:
    first, second = seeded["hooks"][:2]
    fields = _form(client, f"/db/main/message/{first}")
    assert client.post(f"/db/main/message/{first}/requeue", data=fields).status_code == 200
    assert (
        client.post(f"/db/main/message/{second}/skip", data={**fields, "reason": "obsolete"}).status_code
        == 200
    )
    after = _statuses(conn)
    assert after[first] == "pending" and after[second] == "done"
    assert "skipped" in client.get(f"/db/main/message/{second}").text
    # A second replay of a message no longer dead is refused with a clear status.
    again = client.post(f"/db/main/message/{first}/requeue", data=fields)
    assert again.status_code == 409 and "cannot requeue" in again.text


def test_a_replayed_message_delivered_since_labels_its_error_as_an_earlier_attempts(
    client: TestClient, conn: psycopg.Connection[Any], seeded: dict[str, list[int]]
) -> None:
    dead = seeded["hooks"][0]
    page = client.get(f"/db/main/message/{dead}").text
    assert re.search(r'<h3 id="error-heading">Last error <span class="muted">\(why it is dead\)', page)
    fields = _form(client, f"/db/main/message/{dead}")
    assert client.post(f"/db/main/message/{dead}/requeue", data=fields).status_code == 200
    page = client.get(f"/db/main/message/{dead}").text
    assert re.search(
        r'id="error-heading">Error of an earlier attempt <span class="muted">\(requeued since', page
    )
    # Then a worker delivers it: the error stays in the row, as history.
    conn.execute("UPDATE outbox SET status = 'done', done_at = now(), attempts = 1 WHERE id = %s", [dead])
    page = client.get(f"/db/main/message/{dead}").text
    assert re.search(
        r'id="error-heading">Error of an earlier attempt <span class="muted">\(delivered since', page
    ), page
    assert "HTTP 410 gone from partner-a" in page


def test_the_message_page_lists_each_error_the_row_keeps_the_latest_first(
    client: TestClient, seeded: dict[str, list[int]]
) -> None:
    dead = seeded["hooks"][0]
    fields = _form(client, f"/db/main/message/{dead}")
    assert client.post(f"/db/main/message/{dead}/requeue", data=fields).status_code == 200
    skip = {**fields, "reason": "obsolete"}
    assert client.post(f"/db/main/message/{dead}/skip", data=skip).status_code == 200
    page = client.get(f"/db/main/message/{dead}").text
    listed = re.search(r'<ol id="errors">(.*?)</ol>', page, re.S)
    assert listed is not None, page
    entries = re.findall(r"<li><pre>(.*?)</pre></li>", listed.group(1), re.S)
    assert [e.split(" (")[0] for e in entries] == [
        "skipped by operator: obsolete",
        "requeued by operator: replayed from the console",
        "HTTP 410 gone from partner-a",
    ]


def test_invariant_32_the_message_page_and_dead_show_list_every_failed_attempt_the_latest_first(
    client: TestClient, conn: psycopg.Connection[Any], migrated_dsn: str
) -> None:
    store = Store("outbox")
    [i] = enqueue_many(conn, [Event("mail.sent", {}, "mail", "1")], allow_autocommit=True)
    page = client.get(f"/db/main/message/{i}").text
    assert '<p class="muted" id="attempts">no failed attempt recorded</p>' in page
    for error in ("HTTP 503", f"mailer said {SCRIPT}"):
        [c] = steps.claim(store, conn, limit=1, lease=60, owner="w", max_attempts=5).claimed
        assert steps.start(store, conn, i, c.lease_version, lease=60, max_attempts=5) is not None
        assert steps.retry(store, conn, i, c.lease_version, delay=0, error=error, max_attempts=5).applied
    page = client.get(f"/db/main/message/{i}").text
    table = re.search(r'<table class="messages" id="attempts">(.*?)</table>', page, re.S)
    assert table is not None, page
    shown = re.findall(
        r'<tr><td class="n">(\d+)</td><td>([^<]+)</td><td class="err"><pre>(.*?)</pre>', table.group(1)
    )
    assert [(a, e) for a, _, e in shown] == [
        ("2", "mailer said &lt;script&gt;window.pwned = 1&lt;/script&gt;"),
        ("1", "HTTP 503"),
    ]
    assert all(datetime.fromisoformat(at) for _, at, _ in shown)
    assert SCRIPT not in page
    # The CLI's one-message view prints the same history, the latest first.
    out = CliRunner().invoke(cli, ["--dsn", migrated_dsn, "dead", "show", str(i)])
    assert out.exit_code == 0, out.output
    history = out.output.split("failed attempts (the latest first):\n", 1)[1]
    assert re.findall(r"^  attempt (\d+) at ", history, re.M) == ["2", "1"]
    assert "    mailer said <script>" in history and "    HTTP 503" in history


def test_a_table_never_vacuumed_reads_never_and_the_hours_chart_has_axes_and_a_legend(
    client: TestClient, conn: psycopg.Connection[Any], seeded: dict[str, list[int]]
) -> None:
    conn.execute(
        "UPDATE outbox SET status = 'done', done_at = now() - interval '2 minutes' WHERE id = %s",
        [seeded["mails"][1]],
    )
    page = client.get("/").text
    assert "last vacuum never" in page and "- ago" not in page
    svg = re.search(r'<svg class="chart".*?</svg>', page, re.S)
    assert svg is not None, page
    texts = re.findall(r"<text[^>]*>(.*?)</text>", svg.group(0))
    assert "done per minute (bars, left axis)" in texts
    assert "enqueue &#8594; done latency (lines, right axis)" in texts
    assert "now" in texts and any(re.fullmatch(r"\d\d:\d\d", t) for t in texts)
    assert "1" in texts  # the done axis' top: one message done in the hour
    assert re.search(r'<p class="legend">.*p50-key.*p99-key', page, re.S)


def test_pause_and_resume_a_type_and_a_limit_key(client: TestClient, conn: psycopg.Connection[Any]) -> None:
    fields = _form(client, "/db/main/flow")
    assert (
        client.post("/db/main/flow/pause", data={**fields, "event_type": "webhook.sent"}).status_code == 200
    )
    key = {**fields, "event_type": "webhook.sent", "limit_key": "partner-a"}
    assert client.post("/db/main/flow/pause", data=key).status_code == 200
    assert [(f.event_type, f.paused) for f in ops.flow_states(conn, "outbox")] == [("webhook.sent", True)]
    assert [(k.limit_key, k.paused) for k in ops.key_states(conn, "outbox")] == [("partner-a", True)]
    page = client.get("/db/main/flow").text
    assert re.search(r'<tr data-type="webhook.sent">.*?paused', page, re.S)
    assert (
        client.post("/db/main/flow/resume", data={**fields, "event_type": "webhook.sent"}).status_code == 200
    )
    assert client.post("/db/main/flow/resume", data=key).status_code == 200
    assert ops.flow_states(conn, "outbox") == [] and ops.key_states(conn, "outbox") == []


def test_refused_requests_get_a_clear_status_and_change_nothing(
    migrated_dsn: str, conn: psycopg.Connection[Any], seeded: dict[str, list[int]]
) -> None:
    dead = seeded["hooks"][0]
    before = _statuses(conn)
    url = f"/db/main/message/{dead}/requeue"
    app = create_app([Database("main", migrated_dsn)], actions=True, token=TOKEN)
    with TestClient(app) as c:
        # No auth at all: the pages and the action.
        assert c.get("/").status_code == 401
        assert c.post(url, data={"csrf": "x"}).status_code == 401
        # Authenticated, but no CSRF token, a forged one, another session's, another origin.
        c.headers.update(AUTH)
        fields = _form(c, f"/db/main/message/{dead}")
        assert c.post(url, data={}).status_code == 403
        assert c.post(url, data={"csrf": "0" * 64}).status_code == 403
        other = TestClient(app, headers=AUTH)
        assert other.post(url, data=fields).status_code == 403  # its cookie is not this token's
        evil = c.post(url, data=fields, headers={"Origin": "https://evil.example"})
        assert evil.status_code == 403 and "cross-origin" in evil.text
        # A wrong token.
        assert c.post(url, data=fields, headers={"Authorization": "Bearer wrong"}).status_code == 401
    # A read-only console refuses every action, whatever the request carries.
    with TestClient(create_app([Database("main", migrated_dsn)])) as ro:
        ro.get("/")
        refused = ro.post(url, data={"csrf": "x"})
        assert refused.status_code == 403 and "actions are disabled" in refused.text
        assert ro.post("/db/main/flow/pause", data={"event_type": "webhook.sent"}).status_code == 403
    assert _statuses(conn) == before
    assert ops.flow_states(conn, "outbox") == []


def test_every_method_passes_the_same_authentication(migrated_dsn: str, seeded: dict[str, list[int]]) -> None:
    # Starlette answers HEAD on every GET route: without the check a page's Content-Length alone
    # reads a dead letter's payload out, one filter at a time.
    dead = seeded["mails"][0]
    app = create_app([Database("main", migrated_dsn)], actions=True, token=TOKEN)
    urls = ["/", "/db/main/dead", "/db/main/dead?payload=%3Cscript", f"/db/main/message/{dead}"]
    urls += ["/db/main/flow", "/db/main/dead/confirm?action=requeue"]
    with TestClient(app) as c:
        for url in urls:
            for method in ("HEAD", "GET", "OPTIONS"):
                answer = c.request(method, url)
                assert answer.status_code in (401, 405), (method, url, answer.status_code)
        assert {c.request("HEAD", u).status_code for u in urls} == {401}
        c.headers.update(AUTH)
        assert c.request("HEAD", "/db/main/dead").status_code == 200


def test_a_named_dsn_that_libpq_cannot_parse_is_refused_without_quoting_it() -> None:
    secret = "Pw%zzsecret"
    with pytest.raises(ValueError, match="invalid DSN") as refused:
        Database("shop", f"postgresql://u:{secret}@127.0.0.1/db")
    assert "zzsecret" not in str(refused.value)
    result = CliRunner().invoke(cli, ["web", "--dsn", f"shop=postgresql://u:{secret}@127.0.0.1/db"])
    assert result.exit_code == 1 and "invalid DSN" in result.output
    assert "zzsecret" not in result.output


def test_basic_auth_guards_pages_and_actions(migrated_dsn: str, seeded: dict[str, list[int]]) -> None:
    app = create_app([Database("main", migrated_dsn)], actions=True, basic_auth=("ops", "pw"))
    with TestClient(app) as c:
        refused = c.get("/")
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic")
        assert c.get("/", auth=("ops", "wrong")).status_code == 401
        assert c.get("/", auth=("ops", "pw")).status_code == 200


def test_actions_need_authentication() -> None:
    with pytest.raises(ValueError, match="actions need authentication"):
        create_app([Database("main", "dbname=x")], actions=True)
    result = CliRunner().invoke(cli, ["web", "--dsn", "postgresql://u:pw@127.0.0.1/x", "--actions"])
    assert result.exit_code != 0 and "--actions needs --token or --basic-auth" in result.output
    assert "pw@" not in result.output


def test_no_dsn_or_password_on_any_page_or_error(migrated_dsn: str, seeded: dict[str, list[int]]) -> None:
    secret = "hunter2-Very-Secret"
    # The test server trusts local logins, so the password is carried and ignored: it must still
    # appear nowhere. A second database's server is not there at all.
    params = conninfo_to_dict(migrated_dsn)
    good = make_conninfo(migrated_dsn, password=secret)
    gone = make_conninfo(migrated_dsn, password=secret, port="9", connect_timeout="1")
    dbs = [Database("main", good), Database("gone", gone)]
    with TestClient(create_app(dbs, token=TOKEN), headers=AUTH) as c:
        pages = [
            c.get(u) for u in ("/", "/db/main/dead", "/db/main/message/1", "/db/gone/flow", "/db/x/dead")
        ]
    assert [p.status_code for p in pages] == [200, 200, 200, 503, 404]
    for p in pages:
        for text in (secret, good, str(params["dbname"]), str(params.get("host", "/"))):
            assert text not in p.text
    assert "database &#39;gone&#39; is unavailable (PoolTimeout)" in pages[3].text
    assert secret not in repr(dbs)


def test_mounted_under_a_prefix_with_the_host_apps_authorization(
    migrated_dsn: str, conn: psycopg.Connection[Any], seeded: dict[str, list[int]]
) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    def staff(request: Any) -> bool:
        return request.headers.get("x-user") == "staff"

    console = create_app([Database("main", migrated_dsn)], actions=True, authorize=staff)
    host = Starlette(routes=[Mount("/outbox", console)])
    dead = seeded["hooks"][0]
    with TestClient(host) as c:
        assert c.get("/outbox/").status_code == 401
        c.headers["x-user"] = "staff"
        page = c.get(f"/outbox/db/main/message/{dead}")
        assert page.status_code == 200
        assert f'action="/outbox/db/main/message/{dead}/requeue"' in page.text
        fields = _form(c, f"/outbox/db/main/message/{dead}")
        done = c.post(f"/outbox/db/main/message/{dead}/requeue", data=fields, follow_redirects=False)
        assert done.status_code == 303 and done.headers["location"] == f"/outbox/db/main/message/{dead}"
        c.headers["x-user"] = "visitor"
        assert c.post(f"/outbox/db/main/message/{seeded['hooks'][1]}/requeue", data=fields).status_code == 401
    after = _statuses(conn)
    assert after[dead] == "pending" and after[seeded["hooks"][1]] == "dead"
