"""A broker publish that hangs (a half-open TCP connection) ends, and its rows go back.

The claim run holds the claim lock while it publishes; a publish waiting forever for a reply
stops every claim. A :class:`~support.tcp_proxy.FreezableProxy` sits between the app and Redis
and is frozen (nothing forwarded, nothing closed) while the claim publishes. With
``broker_timeout`` the publish fails and the rows are released (invariant 12: back to
``pending``, no attempt spent); with a socket timeout out of reach, the claim task's time limit
ends the run the same way.
"""

from __future__ import annotations

import threading
import time
from typing import Any
from urllib.parse import urlparse

import pytest
from celery import Celery
from support.db import calls
from support.tcp_proxy import FreezableProxy

from acceptance.conftest import HarnessFactory
from outbox_celery.claim.claimer import ClaimRun

pytestmark = pytest.mark.slow


def _target(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname or "127.0.0.1", parsed.port or 6379


def _assert_released(rows: list[dict[str, Any]], n: int) -> None:
    assert len(rows) == n
    for r in rows:
        # Claimed once (version 1), given back: pending, no attempt spent, no lease left.
        assert (r["status"], r["attempts"], r["lease_version"]) == ("pending", 0, 1), r
        assert r["lease_until"] is None


def test_invariant_12_a_hung_publish_times_out_and_releases_its_rows(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    with FreezableProxy(_target(redis_url)) as proxy:
        h = harness_factory(proxy.url())
        h.configure(broker_timeout=1.0)
        h.enqueue(5)
        outbox = h.outbox
        proxy.freeze()
        result: list[ClaimRun] = []
        runner = threading.Thread(target=lambda: result.append(outbox.claim()), daemon=True)
        started = time.monotonic()
        runner.start()
        runner.join(timeout=30)
        elapsed = time.monotonic() - started
        hung = runner.is_alive()
        proxy.thaw()
        assert not hung, "the claim run still hangs in its publish 30 s later"
        [run] = result
        assert (run.claimed, run.published, run.released) == (5, 0, 5), run
        assert run.stopped_by == "publish_failed"
        assert elapsed < 30
        _assert_released(h.rows(), 5)


def test_a_claim_task_stuck_in_a_publish_is_ended_by_its_time_limit(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    """The worker consumes straight from Redis and publishes through the frozen proxy, with a
    socket timeout far away: the claim task's soft time limit ends the run."""
    with FreezableProxy(_target(redis_url)) as proxy:
        h = harness_factory(redis_url)
        h.configure(
            # The claim task is what is under test: no push listener claiming first.
            listen=False,
            broker_timeout=600.0,
            claim_time_limit=2.0,
            celery={"broker_write_url": proxy.url()},
        )
        h.enqueue(3)
        worker = h.worker([h.claim_queue], name="claims", concurrency=1)
        proxy.freeze()
        sender = Celery("sender", broker=redis_url, set_as_current=False)
        try:
            sender.send_task("outbox.claim", queue=h.claim_queue)
        finally:
            sender.close()
        worker.wait_for_log("SoftTimeLimitExceeded", timeout=60)
        h.wait(lambda: all(r["status"] == "pending" for r in h.rows()), 30, "rows released")
        proxy.thaw()
        _assert_released(h.rows(), 3)
        assert calls(h.conn) == []
