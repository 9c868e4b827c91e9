"""A warm shutdown (Ctrl-C, SIGTERM) waits for the running deliveries only, and says so."""

from __future__ import annotations

import os
import signal
import time

import pytest
from support.db import statuses
from support.processes import wait_until

from acceptance.conftest import HarnessFactory

pytestmark = pytest.mark.slow


def test_a_warm_shutdown_says_what_it_waits_for_and_ends_when_the_handlers_do(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    h = harness_factory(redis_url)
    worker = h.worker()  # prefork, two processes
    h.beat()
    ids = h.enqueue(2, payload={"mode": "sleep", "seconds": 6})
    h.wait(lambda: statuses(h.conn, h.table).get("processing", 0) == 2, what="both running")
    time.sleep(1.0)  # the handlers are inside their sleep
    sent = time.monotonic()
    os.kill(worker.pid, signal.SIGINT)
    wait_until(lambda: not worker.alive(), 30, lambda: f"worker still running:\n{worker.log()[-3000:]}")
    took = time.monotonic() - sent
    log = worker.log()
    assert "warm shutdown waits for 2 running delivery task(s)" in log, log[-3000:]
    # What was left of the handlers' sleep, plus the worker's own stop.
    assert took <= 5.0 + 4.0, took
    assert statuses(h.conn, h.table) == {"done": len(ids)}
