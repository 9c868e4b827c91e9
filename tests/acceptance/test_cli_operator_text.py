"""What the CLI prints of producer- and operator-supplied text, and what it refuses.

Event types, limit keys, aggregate ids, ordering keys and errors come from producers (and
handlers); a terminal escape sequence among them must be shown escaped, never sent to the
operator's terminal where it can clear the screen or forge a line. ``pause`` and ``resume``
refuse an event type the loaded Outbox has no handler for (a typo), naming the close match, and
say what they changed. Each command runs as an operator runs it: a subprocess against a real
database.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import psycopg

from acceptance.test_cli import add, ok, one_line_error, run, update
from outbox_celery import ops
from outbox_celery.ops import subscriptions

# Clears the screen, homes the cursor and writes a forged line; then a bidi override.
HOSTILE = "\x1b[2J\x1b[Hpaused: none\x1b]0;owned\x07\u202e"

APP_MODULE = """
import os

from celery import Celery

from outbox_celery.app.outbox import Outbox

app = Celery("pause_test_app", broker="memory://")
outbox = Outbox(app, dsn=os.environ["PAUSE_TEST_APP_DSN"], table=os.environ["PAUSE_TEST_APP_TABLE"])


@outbox.handler("order.created")
def deliver_order(message):
    pass


@outbox.handler("invoice.sent")
def deliver_invoice(message):
    pass


@outbox.handler("order.paid", name="receipt")
def send_receipt(message):
    pass


@outbox.handler("order.paid", name="search")
def index(message):
    pass
"""


def _no_control_characters(text: str) -> None:
    bad = sorted({c for c in text if not c.isprintable() and c != "\n"})
    assert not bad, f"control/format characters reached the terminal: {bad!r}\n{text!r}"


def test_stats_and_dead_letters_escape_producer_supplied_text(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    ids = add(conn, 2, table=table, event_type="order." + HOSTILE, key="k" + HOSTILE)
    update(conn, table, ids[:1], "status = 'dead', last_error = 'boom " + HOSTILE.replace("'", "''") + "'")
    ops.pause(conn, table, "order.created", limit_key=HOSTILE)
    ops.pause(conn, table, "invoice." + HOSTILE)

    out = ok(run("stats", dsn=migrated_dsn, OUTBOX_TABLE=table))
    _no_control_characters(out)
    # Shown escaped, recognisably: the operator can still read (and copy) what is there.
    assert "\\x1b[2J\\x1b[Hpaused: none" in out, out
    assert f"paused (claimed by nobody until resumed): {'invoice.' + HOSTILE!r}" in out.splitlines(), out
    assert not any(line.startswith("paused: none") for line in out.splitlines()), out

    for args in (("dead", "list"), ("dead", "show", str(ids[0])), ("dead", "show", str(ids[1]))):
        shown = ok(run(*args, dsn=migrated_dsn, OUTBOX_TABLE=table))
        _no_control_characters(shown)
        assert "\\x1b[2J" in shown, shown

    # --json stays exact for scripts: the value round-trips (JSON escapes control characters).
    report = json.loads(ok(run("stats", "--json", dsn=migrated_dsn, OUTBOX_TABLE=table)))
    assert {e["event_type"] for e in report["event_types"]} == {"order." + HOSTILE}


def _app(tmp_path: Path, dsn: str, table: str) -> dict[str, Any]:
    (tmp_path / "pause_test_app.py").write_text(textwrap.dedent(APP_MODULE))
    return {"cwd": tmp_path, "PAUSE_TEST_APP_DSN": dsn, "PAUSE_TEST_APP_TABLE": table}


def test_pause_refuses_an_event_type_the_loaded_outbox_does_not_handle(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str, tmp_path: Path
) -> None:
    env = _app(tmp_path, migrated_dsn, table)
    typo = run("-A", "pause_test_app:outbox", "pause", "order.craeted", dsn=None, **env)
    error = one_line_error(typo)
    assert "no handler for event type 'order.craeted'" in error and "did you mean 'order.created'?" in error
    assert ops.flow_states(conn, table) == []  # nothing was paused

    # Nothing close: the handled types are listed.
    far = one_line_error(run("-A", "pause_test_app:outbox", "pause", "zzz", dsn=None, **env))
    assert "its handlers: invoice.sent, order.created" in far, far

    # The right spelling pauses, and says so; a second pause says nothing changed.
    assert "paused 'order.created': its messages are claimed by nobody until resumed" in ok(
        run("-A", "pause_test_app:outbox", "pause", "order.created", dsn=None, **env)
    )
    again = ok(run("-A", "pause_test_app:outbox", "pause", "order.created", dsn=None, **env))
    assert "'order.created' was already paused: nothing changed" in again
    assert [f.event_type for f in ops.flow_states(conn, table)] == ["order.created"]

    # Without -A the handlers are unknown: a type can be paused before its first deploy.
    assert "paused 'report.built'" in ok(run("pause", "report.built", dsn=migrated_dsn, OUTBOX_TABLE=table))


def test_resume_says_what_was_not_paused_and_refuses_an_unknown_type(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str, tmp_path: Path
) -> None:
    env = _app(tmp_path, migrated_dsn, table)
    ops.pause(conn, table, "order.created")

    # Not paused, and a close match is: named; exit 0 (nothing to undo), but it says so.
    out = ok(run("resume", "order.craeted", dsn=migrated_dsn, OUTBOX_TABLE=table))
    assert "'order.craeted' was not paused or held: nothing changed; did you mean 'order.created'?" in out
    assert [f.event_type for f in ops.flow_states(conn, table)] == ["order.created"]

    # With -A the typo is refused outright.
    error = one_line_error(run("-A", "pause_test_app:outbox", "resume", "order.craeted", dsn=None, **env))
    assert "did you mean 'order.created'?" in error

    # A paused type whose handler is gone can still be resumed.
    ops.pause(conn, table, "retired.type")
    assert "resumed 'retired.type'" in ok(
        run("-A", "pause_test_app:outbox", "resume", "retired.type", dsn=None, **env)
    )
    assert "resumed 'order.created': its messages are claimable now" in ok(
        run("-A", "pause_test_app:outbox", "resume", "order.created", dsn=None, **env)
    )
    assert ops.flow_states(conn, table) == []

    # A key: the close paused key is named.
    ops.pause(conn, table, "order.created", limit_key="tenant-42")
    keyed = ok(run("resume", "order.created", "--key", "tenant-24", dsn=migrated_dsn, OUTBOX_TABLE=table))
    assert "did you mean 'order.created' key 'tenant-42'?" in keyed, keyed


def test_pause_and_resume_of_a_type_with_subscriptions_reach_every_route_and_name_them(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str, tmp_path: Path
) -> None:
    """DESIGN invariants 23 and 28: ``pause order.paid`` pauses each subscription of it."""
    env = _app(tmp_path, migrated_dsn, table)
    for name in ("receipt", "search"):
        subscriptions.add(conn, table, "order.paid", name)
    out = ok(run("-A", "pause_test_app:outbox", "pause", "order.paid", dsn=None, **env))
    assert (
        "paused 'order.paid' with its subscriptions 'order.paid@receipt', 'order.paid@search': "
        "its messages are claimed by nobody until resumed"
    ) in out, out
    paused = ["order.paid", "order.paid@receipt", "order.paid@search"]
    assert [f.event_type for f in ops.flow_states(conn, table) if f.paused] == paused

    shown = json.loads(ok(run("resume", "order.paid", "--json", dsn=migrated_dsn, OUTBOX_TABLE=table)))
    assert shown["routes"] == paused[1:] and shown["changed"] is True, shown
    assert ops.flow_states(conn, table) == []

    # A route alone is that subscription alone; resuming the type resumes it too.
    assert "paused 'order.paid@search':" in ok(
        run("-A", "pause_test_app:outbox", "pause", "order.paid@search", dsn=None, **env)
    )
    assert [f.event_type for f in ops.flow_states(conn, table)] == ["order.paid@search"]
    assert "resumed 'order.paid' with its subscriptions" in ok(
        run("resume", "order.paid", dsn=migrated_dsn, OUTBOX_TABLE=table)
    )
    assert ops.flow_states(conn, table) == []
