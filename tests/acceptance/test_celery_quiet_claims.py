"""Claims that find nothing make no noise: real worker and beat at INFO.

Beat sends a claim every ``claim_interval``; most runs find nothing. Their Celery lines
(``received``, ``succeeded``, beat's ``Sending due task``) must not fill an INFO log, and no
claim may store a Celery result, while a claim that did deliver still says so at INFO.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import time
from pathlib import Path

import pytest
import redis
from support.processes import CeleryProcess

from acceptance.conftest import HarnessFactory

pytestmark = pytest.mark.slow


def _claim_lines(proc: CeleryProcess) -> list[str]:
    """Celery's lines about claim tasks (a task ``outbox.claim[id]``, beat's entry ``outbox-claim``)."""
    return [line for line in proc.log().splitlines() if "outbox.claim[" in line or "outbox-claim" in line]


def test_idle_claims_log_nothing_at_info_and_store_no_result(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    h = harness_factory(redis_url)
    # A result backend, as many apps have, with the task's queue in each stored result.
    h.configure(celery={"result_backend": redis_url, "result_extended": True})
    worker = h.worker()
    beat = h.beat()
    # Beat sends a claim every 0.3 s: a few seconds is a few dozen idle claims.
    worker.wait_for_log("listening on", timeout=30)
    time.sleep(4)
    assert _claim_lines(worker) == []
    assert _claim_lines(beat) == []

    h.enqueue(3)
    h.wait_finished(3)
    worker.wait_for_log("outbox claim run: claimed=", timeout=30)  # a claim that did something
    assert _claim_lines(worker) == []

    client = redis.Redis.from_url(redis_url)
    stored = [json.loads(client.get(key) or b"{}") for key in client.scan_iter("celery-task-meta-*")]
    assert [m for m in stored if m.get("queue") == h.claim_queue] == []


def test_the_examples_rely_on_push_not_a_fast_beat() -> None:
    """With push on, the examples keep beat's default interval: it is only the safety net."""
    root = Path(__file__).resolve().parents[2]
    if str(root) not in sys.path:  # the examples package lives at the repository root
        sys.path.insert(0, str(root))
    orders = importlib.import_module("examples.orders.app").outbox.config
    assert orders.listen and orders.claim_interval >= 5.0
    settings = (root / "examples" / "django_shop" / "shop" / "settings.py").read_text(encoding="utf-8")
    interval = re.search(r"^CELERY_OUTBOX_CLAIM_INTERVAL\s*=\s*(\S+)", settings, re.MULTILINE)
    assert interval is None or float(interval.group(1)) >= 5.0
    assert not re.search(r"^CELERY_OUTBOX_LISTEN\s*=\s*False", settings, re.MULTILINE)
