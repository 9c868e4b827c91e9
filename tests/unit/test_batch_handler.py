"""Batch handlers: registration is checked at decoration time; how claims are grouped."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery

from outbox_celery import ConfigurationError, Outbox
from outbox_celery.app.outbox import MAX_BATCH, MAX_WAIT
from outbox_celery.claim.executor import Claimed
from outbox_celery.claim.units import publish_units
from outbox_celery.handlers import HandlerSpec


def _outbox() -> Outbox:
    return Outbox(Celery("batch", set_as_current=False), retention=None)


def test_a_batch_handler_is_registered_with_its_size() -> None:
    outbox = _outbox()
    outbox.handler("metrics.sample", batch=100)(lambda msgs: None)
    outbox.handler("one", batch=1)(lambda msgs: None)
    assert outbox.handlers["metrics.sample"].batch == 100
    assert outbox.handlers["one"].batch == 1
    assert "outbox.deliver_batch" in outbox.app.tasks


@pytest.mark.parametrize("batch", [0, -1, MAX_BATCH + 1, "10", 2.5, True, None.__class__])
def test_a_batch_size_that_is_not_an_int_from_1_is_refused(batch: Any) -> None:
    with pytest.raises(ConfigurationError, match="batch must be"):
        _outbox().handler("metrics.sample", batch=batch)


@pytest.mark.parametrize("transactional", [True, "psycopg", "django"])
def test_batch_and_transactional_together_are_refused(transactional: Any) -> None:
    outbox = _outbox()
    with pytest.raises(ConfigurationError, match="both batch= and transactional="):
        outbox.handler("metrics.sample", batch=10, transactional=transactional)
    assert outbox.handlers == {}


def test_max_wait_is_registered_in_seconds() -> None:
    outbox = _outbox()
    outbox.handler("metrics.sample", batch=100, max_wait=0.5)(lambda msgs: None)
    outbox.handler("logs.line", batch=100, max_wait=timedelta(seconds=2))(lambda msgs: None)
    outbox.handler("plain", batch=10)(lambda msgs: None)
    assert outbox.handlers["metrics.sample"].max_wait == 0.5
    assert outbox.handlers["logs.line"].max_wait == 2.0
    assert outbox.handlers["plain"].max_wait == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_wait": 0.5}, "max_wait is for batch handlers"),
        ({"batch": 10, "max_wait": -0.1}, "max_wait must be a non-negative number of seconds"),
        ({"batch": 10, "max_wait": float("nan")}, "max_wait must be a non-negative number of seconds"),
        ({"batch": 10, "max_wait": "1s"}, "max_wait must be a non-negative number of seconds"),
        ({"batch": 10, "max_wait": True}, "max_wait must be a non-negative number of seconds"),
        ({"batch": 10, "max_wait": MAX_WAIT + 0.1}, "max_wait must be at most"),
        ({"batch": 10, "max_wait": 1, "concurrency": 2}, "max_wait cannot be combined with concurrency"),
        ({"batch": 10, "max_wait": 1, "rate": "10/s"}, "max_wait cannot be combined with concurrency"),
    ],
)
def test_a_bad_max_wait_is_refused_at_registration(kwargs: dict[str, Any], message: str) -> None:
    outbox = _outbox()
    with pytest.raises(ConfigurationError, match=message):
        outbox.handler("metrics.sample", **kwargs)
    assert outbox.handlers == {}


def _claims(*event_types: str) -> list[Claimed]:
    now = datetime.now(UTC)
    return [Claimed(i, 1, et, now) for i, et in enumerate(event_types, start=1)]


def test_claims_are_grouped_per_batch_handler_in_claim_order() -> None:
    handlers = {
        "b": HandlerSpec("b", lambda msgs: None, "", batch=2),
        "p": HandlerSpec("p", lambda m: None, ""),
    }
    claims = _claims("b", "p", "b", "b", "p", "x", "b", "b")
    units = publish_units(claims, handlers, max_attempts=10)
    assert [[c.id for c in u] for u in units] == [[1, 3], [2], [4, 7], [5], [6], [8]]
    flat = [c for u in units for c in u]
    assert publish_units(flat, handlers, max_attempts=10) == units


def test_the_delivery_counter_counts_each_row_of_a_batch_task() -> None:
    pytest.importorskip("prometheus_client")
    from celery import signals
    from prometheus_client import CollectorRegistry

    from outbox_celery.metrics import track_deliveries

    outbox = _outbox()
    registry = CollectorRegistry()
    # It stays connected: it counts only this outbox's tasks, into this private registry.
    track_deliveries(outbox, registry=registry)
    task = outbox.deliver_batch_task
    signals.task_postrun.send(
        sender=task, task=task, retval={"done": 3, "retry": 1}, state="SUCCESS", args=([1, 2, 3, 4], [1] * 4)
    )
    signals.task_postrun.send(sender=task, task=task, retval=None, state="FAILURE", args=([5, 6], [1, 1]))
    got = {
        s.labels["outcome"]: s.value
        for metric in registry.collect()
        for s in metric.samples
        if s.name == "outbox_deliveries_total"
    }
    assert got == {"done": 3, "retry": 1, "error": 2}
