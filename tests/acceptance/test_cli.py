"""The ``outbox-celery`` CLI as operators run it: a real subprocess against a real database.

Every command is run as ``python -m outbox_celery`` (and some as the ``outbox-celery`` console
script and as ``celery -A proj outbox``); the tests check output, exit code and what the table
holds afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row
from support import steps

from outbox_celery import Event, Store, TableName, enqueue_many
from outbox_celery.db.migrations import available

BIN = Path(sys.executable).parent
PYTHON_M = [sys.executable, "-m", "outbox_celery"]
TIMEOUT = 120  # seconds; bounds a hung subprocess, never asserts speed


def _script(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"console script {name!r} is not installed (pip install -e .)")
    return found


def _env(dsn: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_") or k.startswith("OUTBOX_TEST_")}
    if dsn is not None:
        env["OUTBOX_DSN"] = dsn
    env.update(extra)
    return env


def run(
    *args: str,
    dsn: str | None,
    command: list[str] | None = None,
    cwd: Path | None = None,
    **env: str,
) -> subprocess.CompletedProcess[str]:
    """Run the CLI; ``dsn`` goes in ``OUTBOX_DSN`` (``None``: no DSN at all)."""
    return subprocess.run(
        [*(command or PYTHON_M), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_env(dsn, **env),
        cwd=cwd,
        check=False,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    """stdout of a command that must have succeeded."""
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result.stdout


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The message of a refused command: exit 1, one ``Error:`` line, no traceback."""
    assert result.returncode == 1, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    return lines[0]


def _t(table: str) -> sql.Identifier:
    return TableName.parse(table).identifier()


def add(
    conn: psycopg.Connection[Any],
    n: int,
    *,
    table: str,
    event_type: str = "order.created",
    key: str | None = None,
    delay: float | None = None,
) -> list[int]:
    events = [Event(event_type, {"n": i}, "order", str(i), ordering_key=key, delay=delay) for i in range(n)]
    with conn.transaction():
        return enqueue_many(conn, events, table=table)


def update(conn: psycopg.Connection[Any], table: str, ids: list[int], assignments: str) -> None:
    """``UPDATE ... SET <assignments>`` for ``ids`` (assignments are written by the test)."""
    conn.execute(sql.SQL("UPDATE {} SET " + assignments + " WHERE id = ANY(%s)").format(_t(table)), [ids])


def snapshot(conn: psycopg.Connection[Any], table: str) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(sql.SQL("SELECT * FROM {} ORDER BY id").format(_t(table))).fetchall()


def status_of(conn: psycopg.Connection[Any], table: str, outbox_id: int) -> dict[str, Any]:
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(sql.SQL("SELECT * FROM {} WHERE id = %s").format(_t(table)), [outbox_id]).fetchone()
    assert row is not None
    return row


def kill(store: Store, conn: psycopg.Connection[Any], outbox_id: int, error: str) -> None:
    """Claim, start and dead-finalize ``outbox_id`` the way a worker would."""
    result = steps.claim(store, conn, limit=100, lease=60, owner="test", max_attempts=5)
    mine = [c for c in result.claimed if c.id == outbox_id]
    steps.release(store, conn, [c for c in result.claimed if c.id != outbox_id])
    assert mine, f"{outbox_id} was not claimable"
    [c] = mine
    assert steps.start(store, conn, c.id, c.lease_version, lease=60, max_attempts=5) is not None
    assert steps.dead(store, conn, c.id, c.lease_version, error=error)


def claim(store: Store, conn: psycopg.Connection[Any]) -> list[int]:
    return [c.id for c in steps.claim(store, conn, limit=100, lease=60, owner="test", max_attempts=5).claimed]


# -- migrate -----------------------------------------------------------------------------------


def test_migrate_check_is_a_deploy_gate_and_migrate_is_idempotent(dsn: str) -> None:
    versions = [m.version for m in available()]
    first = f"{available()[0].version:04d}_{available()[0].name}"

    behind = run("migrate", "--check", dsn=dsn)
    assert behind.returncode == 1
    assert "is behind" in behind.stdout and first in behind.stdout
    with psycopg.connect(dsn, autocommit=True) as conn:
        # --check changed nothing: no table, no ledger.
        row = conn.execute(
            "SELECT to_regclass('outbox') IS NULL AND to_regclass('outbox_celery_migrations') IS NULL"
        ).fetchone()
        assert row == (True,)

    out = ok(run("migrate", dsn=dsn, command=[_script("outbox-celery")]))
    assert f"applied version(s) {', '.join(map(str, versions))}" in out
    assert "already up to date" in ok(run("migrate", dsn=dsn))
    assert "is up to date" in ok(run("migrate", "--check", dsn=dsn))
    report = json.loads(ok(run("migrate", "--check", "--json", dsn=dsn)))
    assert report == {"table": "outbox", "up_to_date": True, "applied": versions, "pending": []}


def test_dsn_and_table_after_the_command(dsn: str) -> None:
    """``outbox-celery migrate --dsn ...`` (as the README shows it) works; after the command,
    ``--dsn``/``--table`` win over the ones before it and over the environment."""
    out = ok(
        run("migrate", "--dsn", dsn, "--table", "after_cmd", dsn=None, command=[_script("outbox-celery")])
    )
    assert "migrated after_cmd" in out
    wrong = "host=127.0.0.1 port=1 dbname=nowhere connect_timeout=2"
    out = ok(
        run(
            "--dsn",
            wrong,
            "--table",
            "before",
            "stats",
            "--json",
            "--table",
            "after_cmd",
            "--dsn",
            dsn,
            dsn=wrong,
        )
    )
    assert json.loads(out)["table"] == "after_cmd"
    out = ok(run("dead", "list", "--table", "after_cmd", dsn=dsn))
    assert "no dead messages" in out
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('outbox') IS NULL").fetchone() == (True,)


# -- stats -------------------------------------------------------------------------------------


def test_stats_matches_the_table(migrated_dsn: str, conn: psycopg.Connection[Any], table: str) -> None:
    add(conn, 4, table=table, event_type="order.created")
    add(conn, 2, table=table, event_type="order.created", delay=3600)
    invoices = add(conn, 3, table=table, event_type="invoice.sent")
    update(conn, table, invoices[:1], "status = 'dead', attempts = 5, last_error = 'gone'")
    update(
        conn,
        table,
        invoices[1:2],
        "status = 'processing', attempts = 1, lease_until = now() - interval '1 minute'",
    )
    done = add(conn, 2, table=table, event_type="mail.sent")
    update(conn, table, done, "status = 'done', done_at = now()")
    first = add(conn, 1, table=table, event_type="order.created")
    update(conn, table, first, "created_at = now() - interval '2 hours'")

    truth = dict(
        conn.execute(sql.SQL("SELECT status, count(*) FROM {} GROUP BY status").format(_t(table))).fetchall()
    )
    s = json.loads(ok(run("stats", "--json", dsn=migrated_dsn)))
    assert s["table"] == table
    assert s["counts"] == {
        status: truth.get(status, 0) for status in ("pending", "processing", "done", "dead")
    }
    assert s["counts"] == {"pending": 8, "processing": 1, "done": 2, "dead": 1}
    assert (s["ready"], s["scheduled"], s["expired_leases"]) == (6, 2, 1)
    assert 7200 <= s["oldest_pending_age"] < 7300
    assert s["unroutable"] is None
    types = {e["event_type"]: e for e in s["event_types"]}
    assert types["order.created"]["pending"] == 7
    assert (types["invoice.sent"]["processing"], types["invoice.sent"]["dead"]) == (1, 1)
    assert {a["attempts"]: a["dead"] for a in s["attempts"]}[5] == 1

    human = ok(run("stats", dsn=migrated_dsn))
    for status, n in s["counts"].items():
        assert re.search(rf"^{status}\s+{n}\b", human, re.M), human
    assert re.search(r"^expired leases:\s+1$", human, re.M), human
    assert re.search(r"^oldest pending \(since created\):\s+2h$", human, re.M), human
    assert re.search(r"^invoice\.sent\s+1\s+1\s+1\s+1\b", human, re.M), human
    assert "pass -A module:outbox" in human
    assert "attention: 1 dead (outbox-celery dead list); 1 expired lease(s)" in human


APP_MODULE = """
import os

from celery import Celery

from outbox_celery.app.outbox import Outbox

app = Celery("cli_test_app", broker="memory://")
outbox = Outbox(app, dsn=os.environ["CLI_TEST_APP_DSN"], table=os.environ["CLI_TEST_APP_TABLE"])


@outbox.handler("order.created")
def deliver_order(message):
    pass
"""


def test_stats_with_an_app_reports_event_types_that_have_no_handler(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str, tmp_path: Path
) -> None:
    add(conn, 2, table=table, event_type="order.created")
    add(conn, 3, table=table, event_type="invoice.sent")
    (tmp_path / "cli_test_app.py").write_text(textwrap.dedent(APP_MODULE))
    app_env = {"CLI_TEST_APP_DSN": migrated_dsn, "CLI_TEST_APP_TABLE": table}

    # The DSN and table come from the Outbox object (no OUTBOX_DSN in the environment).
    s = json.loads(ok(run("-A", "cli_test_app:outbox", "stats", "--json", dsn=None, cwd=tmp_path, **app_env)))
    assert s["unroutable"] == ["invoice.sent"]
    assert {e["event_type"]: e["has_handler"] for e in s["event_types"]} == {
        "invoice.sent": False,
        "order.created": True,
    }

    human = ok(
        run(
            "-A",
            "cli_test_app",
            "stats",
            dsn=None,
            cwd=tmp_path,
            command=[_script("outbox-celery")],
            **app_env,
        )
    )
    assert "unroutable (pending, no handler): invoice.sent" in human
    assert "attention: no handler for invoice.sent" in human
    assert re.search(r"^invoice\.sent\s+3\s+3\s+0\s+0\s+0\s+\S+\s+NO$", human, re.M), human

    # The same through Celery's own command line.
    celery = [_script("celery"), "-A", "cli_test_app"]
    s2 = json.loads(ok(run("outbox", "stats", "--json", dsn=None, cwd=tmp_path, command=celery, **app_env)))
    assert s2["unroutable"] == ["invoice.sent"]
    assert s2["counts"] == s["counts"]

    missing = run("-A", "no_such_module:outbox", "stats", dsn=None, cwd=tmp_path)
    assert "cannot import 'no_such_module'" in one_line_error(missing)


# -- dead letters ------------------------------------------------------------------------------


def test_stats_shows_messages_whose_tasks_never_start_and_asks_about_their_queue(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str, tmp_path: Path
) -> None:
    # Invariants 10, 16: a queue with no consumer shows as claims no worker ever starts.
    lost = add(conn, 3, table=table, event_type="order.created")
    update(conn, table, lost, "lease_version = 2")  # claimed twice, never started, now pending
    expired = add(conn, 1, table=table, event_type="order.created")
    update(
        conn,
        table,
        expired,
        "status = 'processing', lease_version = 1, lease_until = now() - interval '1 minute'",
    )
    # A live lease whose task may still start is not counted (yet), nor a started one.
    live = add(conn, 2, table=table, event_type="invoice.sent")
    update(
        conn, table, live, "status = 'processing', lease_version = 1, lease_until = now() + interval '1 hour'"
    )
    update(conn, table, live[:1], "started_version = 1, attempts = 1")

    s = json.loads(ok(run("stats", "--json", dsn=migrated_dsn)))
    assert s["unstarted"] == 4
    types = {e["event_type"]: e for e in s["event_types"]}
    assert (types["order.created"]["unstarted"], types["order.created"]["unstarted_claims"]) == (4, 2)
    assert (types["invoice.sent"]["unstarted"], types["invoice.sent"]["unstarted_claims"]) == (0, 0)

    line = "event type 'order.created': 4 message(s) claimed up to 2 time(s) without a worker starting them"
    human = ok(run("stats", dsn=migrated_dsn))
    assert f"{line}: does its queue have a consumer?" in human
    (tmp_path / "cli_test_app.py").write_text(textwrap.dedent(APP_MODULE))
    app_env = {"CLI_TEST_APP_DSN": migrated_dsn, "CLI_TEST_APP_TABLE": table}
    human = ok(run("-A", "cli_test_app:outbox", "stats", dsn=None, cwd=tmp_path, **app_env))
    assert f"{line}: does queue 'outbox' have a consumer?" in human
    assert "invoice.sent': " not in human

    shown = ok(run("dead", "show", str(lost[0]), dsn=migrated_dsn))
    assert "unstarted:     2 claim(s) since a worker last started it" in shown
    shown = ok(run("dead", "show", str(expired[0]), dsn=migrated_dsn))
    assert f"fix: outbox-celery dead requeue {expired[0]}" in shown


def test_dead_list_show_and_skip(migrated_dsn: str, conn: psycopg.Connection[Any], table: str) -> None:
    store = Store(table)
    orders = add(conn, 3, table=table, event_type="order.created")
    mails = add(conn, 2, table=table, event_type="mail.sent")
    update(conn, table, orders + mails, "status = 'dead', attempts = 5, last_error = 'HTTP 410 for ' || id")
    update(conn, table, orders[:1], "created_at = now() - interval '3 days'")
    keyed = add(conn, 2, table=table, event_type="invoice.sent", key="invoice:7")
    kill(store, conn, keyed[0], "PermanentError: invoice 7 rejected\nTraceback (most recent call last): ...")

    listing = ok(run("dead", "list", dsn=migrated_dsn))
    for i in orders + mails + keyed[:1]:
        assert re.search(rf"^\s*{i}\s+\S+", listing, re.M), listing
    assert f"HTTP 410 for {orders[0]}" in listing
    assert "6 shown of 6 matching dead message(s)" in listing
    # The ordered head shows how many messages it blocks.
    assert re.search(
        rf"^\s*{keyed[0]}\s+invoice\.sent\s+order:0\s+1\s+\S+\s+1\s+PermanentError", listing, re.M
    )

    page = json.loads(
        ok(run("dead", "list", "--event-type", "order.created", "--limit", "2", "--json", dsn=migrated_dsn))
    )
    assert [m["id"] for m in page["messages"]] == orders[:2]
    assert (page["total"], page["next_after"]) == (3, orders[1])
    rest = json.loads(
        ok(
            run(
                "dead",
                "list",
                "--event-type",
                "order.created",
                "--after",
                str(orders[1]),
                "--json",
                dsn=migrated_dsn,
            )
        )
    )
    assert [m["id"] for m in rest["messages"]] == orders[2:]
    old = json.loads(ok(run("dead", "list", "--older-than", "2d", "--json", dsn=migrated_dsn)))
    assert [m["id"] for m in old["messages"]] == orders[:1]
    assert "no dead messages match" in ok(run("dead", "list", "--event-type", "nothing", dsn=migrated_dsn))

    shown = ok(run("dead", "show", str(keyed[0]), dsn=migrated_dsn))
    assert re.search(r"^status:\s+dead$", shown, re.M)
    assert "PermanentError: invoice 7 rejected" in shown and "Traceback" in shown
    assert "head of its key; 1 message(s) wait behind it" in shown
    assert '"n": 0' in shown
    behind = ok(run("dead", "show", str(keyed[1]), dsn=migrated_dsn))
    assert f"waits behind id {keyed[0]}" in behind
    as_json = json.loads(ok(run("dead", "show", str(keyed[0]), "--json", dsn=migrated_dsn)))
    assert (as_json["status"], as_json["attempts"], as_json["payload"]) == ("dead", 1, {"n": 0})

    skipped = ok(
        run("dead", "skip", str(keyed[0]), "--reason", "invoice voided by finance", dsn=migrated_dsn)
    )
    assert skipped.strip() == f"skipped 1 message(s): {keyed[0]}"
    row = status_of(conn, table, keyed[0])
    assert row["status"] == "done"
    assert row["last_error"].startswith(
        "skipped by operator: invoice voided by finance (was dead, attempts 1)"
    )
    assert claim(store, conn) == [keyed[1]]  # the key moves on


def test_dead_requeue_and_skip_move_expired_processing_rows_and_refuse_live_ones(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    # Invariant 10: a processing row nobody holds any more (lease expired) is the operator's.
    expired = add(conn, 2, table=table)
    live = add(conn, 1, table=table)
    update(
        conn,
        table,
        expired,
        "status = 'processing', lease_version = 1, lease_until = now() - interval '1 minute'",
    )
    update(
        conn, table, live, "status = 'processing', lease_version = 1, lease_until = now() + interval '1 hour'"
    )
    before = snapshot(conn, table)
    for args in (("requeue", str(expired[0]), str(live[0])), ("skip", str(live[0]), "--reason", "x")):
        line = one_line_error(run("dead", *args, dsn=migrated_dsn))
        assert f"message {live[0]} is processing under a live lease" in line
    assert snapshot(conn, table) == before

    out = ok(run("dead", "requeue", str(expired[0]), dsn=migrated_dsn))
    assert out.strip() == f"requeued 1 dead message(s): {expired[0]}"
    assert status_of(conn, table, expired[0])["status"] == "pending"
    out = ok(run("dead", "skip", str(expired[1]), "--reason", "handler removed", dsn=migrated_dsn))
    assert out.strip() == f"skipped 1 message(s): {expired[1]}"
    assert status_of(conn, table, expired[1])["status"] == "done"
    assert status_of(conn, table, live[0])["status"] == "processing"


def test_requeue_of_an_ordered_dead_head_lets_its_key_move_again(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    store = Store(table)
    key = add(conn, 3, table=table, event_type="invoice.sent", key="invoice:42")
    kill(store, conn, key[0], "PermanentError: downstream said 500")
    assert claim(store, conn) == []  # the dead head blocks its key

    result = run("dead", "requeue", str(key[0]), "--reason", "downstream fixed", dsn=migrated_dsn)
    assert ok(result).strip() == f"requeued 1 dead message(s): {key[0]}"
    assert result.stderr == ""  # the result is said once, on stdout
    row = status_of(conn, table, key[0])
    assert (row["status"], row["attempts"]) == ("pending", 0)
    assert row["last_error"] == (
        "requeued by operator: downstream fixed (attempts were 1); "
        "previous error: PermanentError: downstream said 500"
    )

    result = steps.claim(store, conn, limit=100, lease=60, owner="test", max_attempts=5)
    assert [c.id for c in result.claimed] == [key[0]]
    [c] = result.claimed
    assert steps.start(store, conn, c.id, c.lease_version, lease=60, max_attempts=5) is not None
    assert steps.done(store, conn, c.id, c.lease_version)
    assert claim(store, conn) == [key[1]]


def test_requeue_all_of_an_event_type_says_how_many(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    a = add(conn, 3, table=table, event_type="order.created")
    b = add(conn, 2, table=table, event_type="mail.sent")
    update(conn, table, a + b, "status = 'dead', attempts = 5")
    out = ok(run("dead", "requeue", "--all", "--event-type", "order.created", dsn=migrated_dsn))
    assert out.strip() == "requeued 3 dead message(s) of event type order.created"
    assert [status_of(conn, table, i)["status"] for i in a + b] == ["pending"] * 3 + ["dead"] * 2
    report = json.loads(ok(run("dead", "requeue", "--all", "--json", dsn=migrated_dsn)))
    assert report == {"requeued": 2, "ids": None}
    assert "requeued 0 dead message(s)" in ok(run("dead", "requeue", "--all", dsn=migrated_dsn))


# -- purge -------------------------------------------------------------------------------------


def test_purge_removes_only_old_done_rows(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    old_done = add(conn, 5, table=table)
    recent_done = add(conn, 2, table=table)
    dead, pending, processing = (add(conn, 1, table=table) for _ in range(3))
    update(conn, table, old_done, "status = 'done', done_at = now() - interval '8 days'")
    update(conn, table, recent_done, "status = 'done', done_at = now() - interval '6 days'")
    everything_else = dead + pending + processing
    update(conn, table, everything_else, "created_at = now() - interval '60 days'")
    update(conn, table, dead, "status = 'dead'")
    update(conn, table, processing, "status = 'processing', lease_until = now() + interval '1 minute'")
    before = snapshot(conn, table)

    dry = ok(run("purge", "--older-than", "7d", "--dry-run", dsn=migrated_dsn))
    assert dry.strip() == "dry run: would delete 5 done message(s) older than 7d"
    assert snapshot(conn, table) == before

    out = ok(
        run(
            "purge",
            "--older-than",
            "7d",
            "--batch-size",
            "2",
            dsn=migrated_dsn,
            command=[_script("outbox-celery")],
        )
    )
    assert out.strip() == "deleted 5 done message(s) older than 7d"
    kept = snapshot(conn, table)
    assert [r["id"] for r in kept] == sorted(recent_done + everything_else)
    assert kept == [r for r in before if r["id"] not in old_done]

    again = json.loads(ok(run("purge", "--older-than", "7d", "--json", dsn=migrated_dsn)))
    assert again == {"dry_run": False, "older_than_seconds": 7 * 86400, "deleted": 0}


def test_durations_on_the_command_line(migrated_dsn: str) -> None:
    for text, seconds in [("7d", 604800), ("12h", 43200), ("30m", 1800), ("45s", 45), ("1w", 604800)]:
        report = json.loads(ok(run("purge", "--older-than", text, "--dry-run", "--json", dsn=migrated_dsn)))
        assert report == {"dry_run": True, "older_than_seconds": seconds, "would_delete": 0}


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["dead", "requeue", "999999"], "no message with id 999999 in outbox"),
        (["dead", "requeue", "{dead}", "999999"], "no message with id 999999"),
        (["dead", "requeue", "{pending}"], "cannot requeue: message {pending} is pending"),
        (["dead", "requeue"], "nothing to requeue: give message ids or --all"),
        (["dead", "requeue", "{dead}", "--all"], "give message ids or --all, not both"),
        (["dead", "requeue", "{dead}", "--event-type", "x"], "--event-type filters --all"),
        (["dead", "requeue", "abc"], "invalid message id 'abc'"),
        (["dead", "skip", "{dead}"], "skip needs --reason"),
        (["dead", "skip", "{dead}", "--reason", " "], "skip needs --reason"),
        (["dead", "skip", "--reason", "x"], "nothing to skip"),
        (["dead", "skip", "{dead}", "999999", "--reason", "x"], "no message with id 999999"),
        (["dead", "show", "999999"], "no message with id 999999 in outbox"),
        (["dead", "list", "--older-than", "soon"], "--older-than: malformed duration 'soon'"),
        (["purge", "--older-than", "7x"], "--older-than: malformed duration '7x'"),
        (["purge", "--older-than", "7"], "--older-than: malformed duration '7'"),
        (["--table", "missing_table", "stats"], "run `outbox-celery migrate`"),
        (["--table", "a.b.c", "stats"], "invalid table name 'a.b.c'"),
        (["-A", "json:dumps", "stats"], "'json:dumps' is a function, not an Outbox"),
    ],
)
def test_bad_input_gets_one_line_and_changes_nothing(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str, args: list[str], message: str
) -> None:
    [dead] = add(conn, 1, table=table)
    [pending] = add(conn, 1, table=table)
    update(conn, table, [dead], "status = 'dead', attempts = 5, last_error = 'x'")
    before = snapshot(conn, table)
    ids = {"dead": str(dead), "pending": str(pending)}
    line = one_line_error(run(*(a.format(**ids) for a in args), dsn=migrated_dsn))
    assert message.format(**ids) in line
    assert snapshot(conn, table) == before


def test_no_dsn_is_a_one_line_error() -> None:
    line = one_line_error(run("stats", dsn=None))
    assert line == "Error: no database: pass --dsn or set OUTBOX_DSN (or -A module:outbox with a dsn)"


def test_passwords_are_never_printed(migrated_dsn: str) -> None:
    secret = "Pw-s3cret-91"
    unreachable = f"postgresql://someone:{secret}@127.0.0.1:1/nothing?connect_timeout=2"
    line = one_line_error(run("stats", dsn=unreachable))
    assert line.startswith("Error: cannot connect to ") and "password=***" in line
    assert secret not in line

    garbled = f"host=127.0.0.1 password={secret} 'unterminated"
    line = one_line_error(run("--dsn", garbled, "stats", dsn=None))
    assert secret not in line and "invalid DSN" in line

    # A password the server may ignore (trust) or check: either way it never appears.
    with_password = make_conninfo(migrated_dsn, password=secret)
    for args in (
        ["stats"],
        ["dead", "list"],
        ["migrate", "--check"],
        ["purge", "--older-than", "1d", "--dry-run"],
    ):
        result = run(*args, dsn=with_password)
        assert secret not in result.stdout + result.stderr
    stats = run("stats", dsn=with_password)
    if stats.returncode == 0:
        assert "password=***" in stats.stdout


def test_both_entry_points_run_the_same_cli() -> None:
    for command in (PYTHON_M, [_script("outbox-celery")]):
        out = ok(run("--help", dsn=None, command=command))
        for name in ("migrate", "stats", "dead", "purge", "metrics"):
            assert re.search(rf"^\s+{name}\s", out, re.M), out
        assert "outbox-celery, version" in ok(run("--version", dsn=None, command=command))


def test_stats_names_the_session_that_holds_the_xmin_horizon(migrated_dsn: str) -> None:
    # Invariant 18: the claim stays fast under a pinned horizon; stats says who pins it.
    with psycopg.connect(migrated_dsn, application_name="nightly-report") as held:
        pid = held.info.backend_pid
        held.execute("SELECT pg_current_xact_id()")  # wrote, then left idle in transaction
        human = ok(run("stats", dsn=migrated_dsn))
        s = json.loads(ok(run("stats", "--json", dsn=migrated_dsn)))
    line = re.search(r"^xmin horizon held by:\s+(.*)$", human, re.M)
    assert line, human
    assert line.group(1).startswith(f"transaction {pid} (nightly-report), idle in transaction")
    assert re.search(r"^dead row versions \(table statistics\):\s+\d", human, re.M), human
    assert s["horizon"]["application"] == "nightly-report"
    assert s["horizon"]["state"] == "idle in transaction"


def test_stats_asks_for_attention_once_the_horizon_is_held_for_a_minute(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    import dataclasses

    from outbox_celery import ops
    from outbox_celery.cli.stats import HORIZON_ATTENTION_SECONDS, attention

    with psycopg.connect(migrated_dsn, application_name="nightly-report") as held:
        held.execute("SELECT pg_current_xact_id()")
        s = ops.stats(conn, table)
    assert s.horizon is not None and s.horizon.application == "nightly-report"
    assert attention(s) == []  # held for a moment only
    old = dataclasses.replace(s, horizon=dataclasses.replace(s.horizon, seconds=HORIZON_ATTENTION_SECONDS))
    [item] = attention(old)
    assert item.startswith(f"the xmin horizon is held by transaction {s.horizon.name} (nightly-report)")
    slot = dataclasses.replace(
        s.horizon, kind="replication slot", name="replica1", seconds=None, state="inactive"
    )
    assert "replication slot replica1" in attention(dataclasses.replace(s, horizon=slot))[0]


def test_invariant_9_stats_shows_keys_without_a_head_and_repair_heads_mends_them(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    # Keys an old release left without a head showed as neither ready nor blocked.
    store = Store(table)
    lost = add(conn, 3, table=table, key="k")
    add(conn, 2, table=table, key="fine")
    update(conn, table, lost, "head = false")
    human = ok(run("stats", dsn=migrated_dsn))
    assert "attention: 1 ordered key(s) without a head (outbox-celery repair-heads)" in human
    assert re.search(r"^ordered keys without a head:\s+1$", human, re.M), human
    assert json.loads(ok(run("stats", "--json", dsn=migrated_dsn)))["headless_keys"] == 1
    # Show reads the head as the claim does, from the flag: this key has none.
    shown = ok(run("dead", "show", str(lost[1]), dsn=migrated_dsn))
    assert "no message of the key is its head: none is claimed (outbox-celery repair-heads)" in shown
    assert json.loads(ok(run("repair-heads", "--json", dsn=migrated_dsn))) == {"repaired": 1, "keys": ["k"]}
    shown = ok(run("dead", "show", str(lost[1]), dsn=migrated_dsn))
    assert f"waits behind id {lost[0]}, the head of its key" in shown
    assert lost[0] in claim(store, conn)
    assert ok(run("repair-heads", dsn=migrated_dsn)).strip() == "repaired 0 ordering key(s) without a head"
    assert "(outbox-celery repair-heads)" not in ok(run("stats", dsn=migrated_dsn))
