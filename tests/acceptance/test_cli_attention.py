"""``outbox-celery stats`` flags what nobody claims, run as an operator runs it.

A ready message that waits many claim intervals is the first sign of a stopped claim worker or
beat, and the only sign, without ``-A``, of an event type that no claiming app has a handler for
(it stays pending for ever). ``stats`` must say so under ``attention`` instead of ``none``.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import psycopg
import pytest
from support.processes import REPO_ROOT, TESTS_DIR

from acceptance.conftest import DEFAULT_EVENT, HarnessFactory
from acceptance.test_cli import ok, run
from outbox_celery import Event, enqueue_many

pytestmark = pytest.mark.slow

# stats' default threshold without -A: one claim interval of the default 5 s plus a 5-s margin.
DEFAULT_THRESHOLD = 10.0


def _attention(out: str) -> str:
    [line] = [line for line in out.splitlines() if line.startswith("attention: ")]
    return line.removeprefix("attention: ")


def test_ready_messages_nobody_claims_are_flagged_without_a_loaded_app(
    conn: psycopg.Connection[Any], migrated_dsn: str
) -> None:
    """The claim worker is stopped: seven messages wait; at first fine, then flagged."""
    with conn.transaction():
        enqueue_many(conn, [Event("order.created", {"n": n}, "order", n) for n in range(7)])
    enqueued = time.monotonic()
    assert _attention(ok(run("stats", dsn=migrated_dsn))) == "none"  # just enqueued: nothing late
    time.sleep(max(0.0, DEFAULT_THRESHOLD + 2 - (time.monotonic() - enqueued)))
    attention = _attention(ok(run("stats", dsn=migrated_dsn)))
    assert "event type 'order.created': 7 ready message(s) unclaimed for 1" in attention, attention  # 12s
    assert "no claim worker running" in attention and "no handler for this event type" in attention
    report = json.loads(ok(run("stats", "--json", dsn=migrated_dsn)))
    assert report["unclaimed_after"] == DEFAULT_THRESHOLD
    assert [(u["event_type"], u["messages"]) for u in report["unclaimed"]] == [("order.created", 7)]
    [flagged] = report["attention"]
    assert re.sub(r"for \d+s", "", flagged) == re.sub(r"for \d+s", "", attention)
    # An operator who knows the claim interval is longer says so.
    assert _attention(ok(run("stats", "--unclaimed-after", "1h", dsn=migrated_dsn))) == "none"


def test_an_event_type_no_claiming_app_handles_is_flagged_while_the_others_flow(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    """A real worker and beat deliver their event type; the one they have no handler for waits."""
    h = harness_factory(redis_url)
    h.configure(claim_interval=5.0)  # the default: stats without -A assumes it
    h.worker()
    h.beat()
    h.enqueue(3)
    h.enqueue(2, event_type="nobody.handles")
    enqueued = time.monotonic()
    h.wait_finished(3)
    time.sleep(max(0.0, DEFAULT_THRESHOLD + 2 - (time.monotonic() - enqueued)))
    h.enqueue(1)  # still flowing
    h.wait_finished(4)
    out = ok(run("stats", dsn=h.dsn, OUTBOX_TABLE=h.table))
    attention = _attention(out)
    assert "event type 'nobody.handles': 2 ready message(s) unclaimed" in attention, out
    assert DEFAULT_EVENT not in attention

    # With the claiming app loaded, the same messages are named for what they are: no handler.
    app_env = {
        "OUTBOX_TEST_APP": h.spec.to_json(),
        "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(REPO_ROOT)]),
    }
    loaded = ok(run("-A", "support.worker_app:outbox", "stats", dsn=None, **app_env))
    assert _attention(loaded) == "no handler for nobody.handles", loaded
