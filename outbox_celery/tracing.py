"""Trace context through the outbox (OpenTelemetry, the optional ``otel`` extra).

* At enqueue, the context current in the producer (W3C ``traceparent``/``tracestate``, and
  ``baggage``: whatever the globally configured propagator writes) is stored with the row.
* Around the handler, :func:`handler_span` opens a span ``outbox.handle <event_type>`` whose
  parent is that stored context, so the handler continues the producer's trace; the span
  current in the worker at that moment (Celery's own ``run`` span of the delivery task, when
  Celery is instrumented) is attached as a link.
* When the claim publishes delivery tasks, :func:`task_headers` adds the claim's current context
  to each task's headers, where Celery's OpenTelemetry instrumentation finds it in the worker:
  the delivery task's span becomes a child of the claim run.

No cost and no import without OpenTelemetry: a span can only be current if the application
imported ``opentelemetry.trace``, so until then every function here returns at once and nothing
is imported.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .message import Message

__all__ = ["capture", "handler_span", "task_headers"]

TRACER_NAME = "outbox_celery"


def _active() -> bool:
    # Whoever creates spans has imported opentelemetry.trace; without it there is no context.
    return "opentelemetry.trace" in sys.modules


def _carrier() -> dict[str, str]:
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def capture() -> str | None:
    """The current trace context as JSON for the row's ``trace_context``, or ``None``."""
    if not _active():
        return None
    carrier = _carrier()
    return json.dumps(carrier, separators=(",", ":")) if carrier else None


def task_headers(headers: dict[str, Any]) -> dict[str, Any]:
    """``headers`` plus the current trace context (the claim run's), for a delivery task."""
    if _active():
        headers.update(_carrier())
    return headers


@contextlib.contextmanager
def handler_span(message: Message) -> Iterator[None]:
    """Run the handler in a span continuing the producer's trace (no-op without one)."""
    stored = message.trace_context
    if not stored or not _active():
        yield
        return
    from opentelemetry import propagate, trace

    carrier: Mapping[str, str] = stored if isinstance(stored, Mapping) else json.loads(stored)
    parent = propagate.extract(carrier)
    current = trace.get_current_span().get_span_context()
    links = [trace.Link(current)] if current.is_valid else []
    tracer = trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(
        f"outbox.handle {message.route}",
        context=parent,
        kind=trace.SpanKind.CONSUMER,
        links=links,
        attributes={
            "messaging.system": "outbox_celery",
            "messaging.operation.type": "process",
            "messaging.message.id": message.idempotency_key,
            "outbox.event_type": message.event_type,
            "outbox.attempt": message.attempts,
            "outbox.lease_version": message.lease_version,
        },
    ):
        yield
