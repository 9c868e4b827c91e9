"""The optional lease heartbeat (``lease_heartbeat=True``) keeps a long handler's row.

Handlers sleep for three leases in a real prefork worker while beat keeps claiming every 0.3 s.
With the heartbeat the lease never expires under them: no re-claim (``lease_version`` stays 1),
one handler run per row, no lost lease, ``done`` after one attempt; the delivery's time limit is
``handler_time_limit``, not ``0.9 * lease``.
"""

from __future__ import annotations

from collections import Counter

import pytest
from support.db import calls

from acceptance.conftest import HarnessFactory

pytestmark = pytest.mark.slow

LEASE = 3.0


def test_a_handler_running_three_leases_keeps_its_lease_with_the_heartbeat(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    h = harness_factory(redis_url)
    h.configure(lease=LEASE, lease_heartbeat=True, handler_time_limit=60.0, max_attempts=3)
    ids = h.enqueue(2, payload={"mode": "sleep", "seconds": 3 * LEASE})
    worker = h.worker(concurrency=2)
    h.beat()
    h.wait_finished(2, timeout=90)

    rows = h.rows()
    assert [(r["status"], r["attempts"], r["lease_version"]) for r in rows] == [("done", 1, 1)] * 2
    seen = calls(h.conn)
    assert Counter(c["outbox_id"] for c in seen) == dict.fromkeys(ids, 1)
    assert all(c["result"] == "ok" for c in seen)
    assert "lost lease" not in worker.log()
    assert "SoftTimeLimitExceeded" not in worker.log()
