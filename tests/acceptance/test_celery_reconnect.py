"""Recovery after the server drops the library's connections: at most a lease and a claim
interval after the drops stop, every row is delivered.

The library's backends (every ``outbox-celery:`` application name: the workers' pools, the push
listener, the claim) are ended with ``pg_terminate_backend`` every 2 s while events are written
(what a failover, a restart or an idle-session reaper does to them). A connection wait that
outlives the lease (a pool child killed by its hard time limit while it waited, a main process
waiting out the pool's default 30 s) would delay the last rows by a minute.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from support.db import statuses

from acceptance.conftest import HarnessFactory

pytestmark = pytest.mark.slow

LEASE = 5.0
CLAIM_INTERVAL = 1.0


def _terminate(dsn: str, stop: threading.Event, every: float, ended: list[int]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.wait(every):
            found = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name LIKE 'outbox-celery%%' AND pid <> pg_backend_pid()"
            ).fetchall()
            ended.append(len(found))


def test_after_dropped_connections_every_row_is_delivered_within_a_lease_and_a_claim_interval(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    h = harness_factory(redis_url)
    h.configure(lease=LEASE, claim_interval=CLAIM_INTERVAL)
    h.worker()
    h.beat()
    stop = threading.Event()
    ended: list[int] = []
    killer = threading.Thread(target=_terminate, args=(h.dsn, stop, 2.0, ended), daemon=True)
    killer.start()
    ids: list[int] = []
    try:
        until = time.monotonic() + 20.0
        while time.monotonic() < until:
            ids += h.enqueue(10)
            time.sleep(0.5)
    finally:
        stop.set()
        killer.join()
    stopped = time.monotonic()
    assert sum(ended) >= 6, ended  # the drops did hit the library's connections

    def delivered() -> Any:
        return statuses(h.conn, h.table).get("done", 0) == len(ids)

    h.wait(delivered, timeout=120, what="every row done")
    took = time.monotonic() - stopped
    assert statuses(h.conn, h.table) == {"done": len(ids)}
    # A lease (a delivery whose worker died holds its row that long) and a claim interval (the
    # claim that hands it out again), plus the time this loaded machine takes to run them.
    assert took <= LEASE + CLAIM_INTERVAL + 4.0, (
        f"the last row was delivered {took:.1f}s after the drops stopped"
    )
