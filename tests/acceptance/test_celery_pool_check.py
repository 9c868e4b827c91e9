"""Pooled connections are checked before use: a backend the server ended while it sat idle
in the pool is replaced, and the delivery that would have used it finishes with its lease.

The pool's idle backends are ended with ``pg_terminate_backend`` (what a PostgreSQL restart,
a failover or an idle-session reaper does to them); the next delivery in that process must call
the handler once and finish ``done`` under its own lease, with no lost lease.
"""

from __future__ import annotations

from typing import Any

import psycopg
from support import steps
from support.db import calls, row

from acceptance.conftest import HarnessFactory


def _pool_backends(conn: psycopg.Connection[Any], name: str) -> list[int]:
    found = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = %s AND pid <> pg_backend_pid()",
        [f"outbox-celery:{name}"],
    ).fetchall()
    return [int(r[0]) for r in found]


def test_a_pool_connection_the_server_closed_is_not_handed_to_a_delivery(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    h = harness_factory(redis_url)
    h.configure(lease=30.0)
    ids = h.enqueue(3)
    outbox = h.outbox
    claimed = steps.claim(outbox.store, h.conn, limit=3, lease=30.0, owner="test", max_attempts=5).claimed
    assert [c.id for c in claimed] == ids
    first, *rest = claimed
    assert outbox.deliver(first.id, first.lease_version) == "done"  # the pool is open and used

    backends = _pool_backends(h.conn, outbox.name)
    assert backends, "the pool holds no idle connection"
    for pid in backends:
        h.conn.execute("SELECT pg_terminate_backend(%s)", [pid])
    h.wait(lambda: not set(_pool_backends(h.conn, outbox.name)) & set(backends), 10, "backends gone")

    for c in rest:
        assert outbox.deliver(c.id, c.lease_version) == "done"
        r = row(h.conn, h.table, c.id)
        assert (r["status"], r["attempts"], r["lease_version"]) == ("done", 1, c.lease_version)
    assert outbox.store.get_stats().get("lost_leases", 0) == 0
    assert sorted(c["outbox_id"] for c in calls(h.conn)) == ids
