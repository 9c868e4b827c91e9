"""``outbox-celery stats`` says a claim is overdue as soon as it is (DESIGN invariants 10, 16).

A running outbox claims a due message at its next claim run, within one claim interval. A ready
message left one interval plus a short margin means no claim ran: ``attention`` must say so
then, not several intervals later. The messages' ``available_at`` is set back in the database
(its own clock) instead of waiting, so the test takes a second.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg

from acceptance.test_cli import add, ok, run, update
from outbox_celery.cli.target import DEFAULT_CLAIM_INTERVAL
from outbox_celery.ops.durations import CLAIM_OVERDUE_MARGIN

# Without -A: the default claim interval (5 s) plus the margin (5 s).
OVERDUE_AFTER = DEFAULT_CLAIM_INTERVAL + CLAIM_OVERDUE_MARGIN


def _attention(out: str) -> str:
    [line] = [line for line in out.splitlines() if line.startswith("attention: ")]
    return line.removeprefix("attention: ")


def test_stats_flags_a_claim_overdue_by_one_interval_plus_the_margin(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    assert OVERDUE_AFTER == 10.0  # the documented default (docs/operations.md)
    late = add(conn, 3, table=table, event_type="order.created")
    fresh = add(conn, 2, table=table, event_type="invoice.sent")
    # Three messages due 12 s ago: two claim intervals passed without a claim taking them.
    update(conn, table, late, "available_at = now() - interval '12 seconds'")
    # Two due 7 s ago: within one interval plus the margin, a running claim may not have come yet.
    update(conn, table, fresh, "available_at = now() - interval '7 seconds'")

    attention = _attention(ok(run("stats", dsn=migrated_dsn, OUTBOX_TABLE=table)))
    assert "event type 'order.created': 3 ready message(s) unclaimed for 12s" in attention, attention
    assert "invoice.sent" not in attention, attention

    report = json.loads(ok(run("stats", "--json", dsn=migrated_dsn, OUTBOX_TABLE=table)))
    assert report["unclaimed_after"] == OVERDUE_AFTER
    assert [(u["event_type"], u["messages"]) for u in report["unclaimed"]] == [("order.created", 3)]
    assert any("order.created" in a for a in report["attention"]), report["attention"]
    # The exported figure an alert uses (outbox_oldest_ready_wait_seconds) is the same wait.
    assert report["oldest_ready_wait"] >= 12.0
