"""Registering an app's subscriptions as a deploy step, through the real CLI (DESIGN invariant 28).

``outbox-celery migrate -A`` and ``outbox-celery subscriptions sync -A`` add the subscriptions the
app's handlers declare and say what they did; running them again changes nothing and says so.
The app is :mod:`support.cli_app` (``order.paid`` to ``receipt`` and ``search``, and an unnamed
handler of ``order.created``), loaded by the CLI subprocess from the ``tests`` directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from outbox_celery import TableName, enqueue

from .test_cli import _script, ok, one_line_error, run

TESTS_DIR = Path(__file__).resolve().parents[1]
APP = "support.cli_app:outbox"


def cli(*args: str, dsn: str, table: str = "outbox", **env: str) -> Any:
    """The CLI run from the ``tests`` directory, the app's DSN and table in its environment
    (and nowhere else: no OUTBOX_DSN)."""
    return run(*args, dsn=None, cwd=TESTS_DIR, CLI_APP_DSN=dsn, CLI_APP_TABLE=table, **env)


def subscription_rows(dsn: str, table: str = "outbox") -> list[tuple[str, str, bool]]:
    t = TableName.parse(table).identifier("_subscription")
    query = sql.SQL("SELECT event_type, name, removed_at IS NULL FROM {} ORDER BY 1, 2").format(t)
    with psycopg.connect(dsn) as conn:
        return [(str(a), str(b), bool(c)) for a, b, c in conn.execute(query).fetchall()]


def test_migrate_with_the_app_adds_its_subscriptions_and_says_what_it_did(dsn: str) -> None:
    # A fresh database: --check with the app knows the schema and both subscriptions are missing.
    behind = cli("migrate", "--check", "-A", APP, dsn=dsn)
    assert behind.returncode == 1, behind.stderr
    assert behind.stdout.splitlines()[1:] == [
        "subscription order.paid@receipt is missing (outbox-celery migrate -A adds it)",
        "subscription order.paid@search is missing (outbox-celery migrate -A adds it)",
    ]

    first = ok(cli("migrate", "-A", APP, dsn=dsn, command=[_script("outbox-celery")])).splitlines()
    assert first[0].startswith("migrated outbox: applied version(s) 1, ")
    assert first[1:] == ["subscription order.paid@receipt added", "subscription order.paid@search added"]
    assert subscription_rows(dsn) == [("order.paid", "receipt", True), ("order.paid", "search", True)]

    # Again, -A before the command this time: nothing changes, and it says so.
    again = ok(cli("-A", APP, "migrate", dsn=dsn)).splitlines()
    assert again[0].startswith("outbox is already up to date (version ")
    assert again[1:] == ["subscription order.paid@receipt exists", "subscription order.paid@search exists"]
    assert ok(cli("migrate", "--check", "-A", APP, dsn=dsn)).splitlines()[1:] == again[1:]

    # An operator removed one: the deploy step leaves it removed, and says how to bring it back.
    ok(run("subscriptions", "remove", "order.paid", "search", dsn=dsn))
    doc = json.loads(ok(cli("migrate", "-A", APP, "--json", dsn=dsn)))
    assert doc["applied_now"] == [] and doc["subscriptions"] == [
        {"route": "order.paid@receipt", "state": "exists"},
        {"route": "order.paid@search", "state": "removed"},
    ]
    line = ok(cli("migrate", "-A", APP, dsn=dsn)).splitlines()[2]
    assert line == (
        "subscription order.paid@search was removed by an operator: left removed "
        "(outbox-celery subscriptions add order.paid search brings it back)"
    )
    assert subscription_rows(dsn)[1] == ("order.paid", "search", False)
    # The removed one does not fail the gate: an operator decided it.
    assert cli("migrate", "--check", "-A", APP, dsn=dsn).returncode == 0

    # Without the app, migrate is what it always was: the schema, one line.
    assert ok(run("migrate", dsn=dsn)).splitlines() == again[:1]
    assert "subscriptions" not in json.loads(ok(run("migrate", "--json", dsn=dsn)))


def test_subscriptions_sync_adds_what_the_app_declares_and_lists_every_subscription(
    migrated_dsn: str, table: str
) -> None:
    dsn = migrated_dsn
    # One added by hand, that the app does not declare; adding it twice says it exists.
    assert ok(run("subscriptions", "add", "order.paid", "analytics", dsn=dsn)) == (
        "subscription order.paid@analytics added\n"
    )
    assert ok(run("subscriptions", "add", "order.paid", "analytics", dsn=dsn)) == (
        "subscription order.paid@analytics exists: nothing changed\n"
    )
    assert json.loads(ok(run("subscriptions", "add", "order.paid", "analytics", "--json", dsn=dsn))) == {
        "route": "order.paid@analytics",
        "added": False,
        "replayed": 0,
    }

    out = ok(cli("subscriptions", "sync", "-A", APP, dsn=dsn, table=table)).splitlines()
    assert out[0] == (
        "2 subscription(s) declared by the app: 2 added, 0 existed, 0 removed by an operator (left removed)"
    )
    assert out[1].split() == ["route", "declared", "state", "pending", "processing", "dead"]
    assert [ln.split() for ln in out[2:5]] == [
        ["order.paid@analytics", "no", "live", "0", "0", "0"],
        ["order.paid@receipt", "yes", "added", "0", "0", "0"],
        ["order.paid@search", "yes", "added", "0", "0", "0"],
    ]
    assert out[5:] == ["order.paid@analytics: live, not declared by the app: its events wait for its handler"]

    # Events now reach all three; an operator removes one the app declares; sync again.
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        enqueue(conn, event_type="order.paid", payload={}, aggregate_type="o", aggregate_id="1", table=table)
    ok(run("subscriptions", "remove", "order.paid", "search", dsn=dsn))
    out = ok(cli("subscriptions", "sync", "-A", APP, dsn=dsn, table=table)).splitlines()
    assert out[0] == (
        "2 subscription(s) declared by the app: 0 added, 1 existed, 1 removed by an operator (left removed)"
    )
    rows = [ln.split() for ln in out[2:5]]
    assert rows[0] == ["order.paid@analytics", "no", "live", "1", "0", "0"]
    assert rows[1] == ["order.paid@receipt", "yes", "live", "1", "0", "0"]
    assert rows[2][:3] == ["order.paid@search", "yes", "removed"] and rows[2][-3:] == ["1", "0", "0"]
    assert out[5:] == [
        "order.paid@analytics: live, not declared by the app: its events wait for its handler",
        "order.paid@search: declared by the app, removed by an operator: "
        "outbox-celery subscriptions add order.paid search brings it back",
    ]
    doc = json.loads(ok(cli("subscriptions", "sync", "--json", "-A", APP, dsn=dsn, table=table)))
    assert doc["declared"] == [
        {"route": "order.paid@receipt", "state": "exists"},
        {"route": "order.paid@search", "state": "removed"},
    ]
    assert [(s["route"], s["declared"], s["removed_at"] is None) for s in doc["subscriptions"]] == [
        ("order.paid@analytics", False, True),
        ("order.paid@receipt", True, True),
        ("order.paid@search", True, False),
    ]

    # The same through Celery's own command line, which loaded the app.
    celery = [_script("celery"), "-A", "support.cli_app"]
    via_celery = cli("outbox", "subscriptions", "sync", dsn=dsn, table=table, command=celery)
    assert ok(via_celery).splitlines()[0] == out[0]

    # Without an app there is nothing to sync: one line, exit 1.
    refused = run("subscriptions", "sync", dsn=dsn, table=table)
    assert one_line_error(refused) == (
        "Error: subscriptions sync adds the subscriptions an app declares: pass -A module:outbox"
    )
