"""Trace context through the outbox, seen by the OpenTelemetry SDK's in-memory exporter: the
context current at enqueue is stored with the row, the handler's span continues that trace (and
links the worker's current span), and the claim's context rides in each delivery task's headers.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from outbox_celery import Event, Message, OutboxConfig, enqueue, enqueue_many
from outbox_celery.handlers import HandlerSpec
from outbox_celery.testing import InProcess

from .helpers import fetch

ORDER = {"event_type": "order.created", "aggregate_type": "order", "aggregate_id": "42"}
_EXPORTER = InMemorySpanExporter()
_EXPORTING = False


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The SDK installed once per process (OpenTelemetry allows one global provider)."""
    global _EXPORTING
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    provider = trace.get_tracer_provider()
    if not _EXPORTING and isinstance(provider, TracerProvider):
        # Another test of this process may have installed the SDK first: export from it too.
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        _EXPORTING = True
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def _dispatcher(dsn: str, table: str, seen: list[Any]) -> InProcess:
    @contextlib.contextmanager
    def connection() -> Iterator[psycopg.Connection[Any]]:
        with psycopg.connect(dsn, autocommit=True) as c:
            yield c

    def handler(message: Message) -> None:
        seen.append(trace.get_current_span().get_span_context())

    spec = HandlerSpec(ORDER["event_type"], handler, "outbox")
    return InProcess(OutboxConfig(table=table), connection, {ORDER["event_type"]: spec})


def test_one_trace_from_enqueue_to_handler(
    spans: InMemorySpanExporter, conn: psycopg.Connection[Any], migrated_dsn: str, table: str
) -> None:
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("checkout") as checkout, conn.transaction():
        outbox_id = enqueue(conn, payload={}, table=table, **ORDER)
    producer = checkout.get_span_context()
    stored = fetch(conn, table, outbox_id)["trace_context"]
    assert stored["traceparent"].startswith(f"00-{producer.trace_id:032x}-{producer.span_id:016x}-")

    seen: list[Any] = []
    dispatcher = _dispatcher(migrated_dsn, table, seen)
    claimed: list[Any] = []
    dispatcher.claim_and_publish(lambda claims: claimed.extend(claims) or len(claims))
    assert [c.id for c in claimed] == [outbox_id]
    # The worker runs the delivery inside a span of its own (as Celery's instrumentation does).
    with tracer.start_as_current_span("run/outbox.deliver") as worker_span:
        assert dispatcher.deliver(outbox_id, claimed[0].lease_version) == "done"

    (handle,) = [s for s in spans.get_finished_spans() if s.name == "outbox.handle order.created"]
    assert handle.context.trace_id == producer.trace_id, "the handler continues the producer's trace"
    assert handle.parent is not None and handle.parent.span_id == producer.span_id
    assert handle.kind == trace.SpanKind.CONSUMER
    assert [link.context.span_id for link in handle.links] == [worker_span.get_span_context().span_id]
    assert handle.attributes is not None and handle.attributes["outbox.attempt"] == 1
    assert seen == [handle.context], "the handler runs inside that span"


def test_without_a_current_span_nothing_is_stored_and_the_handler_runs_plainly(
    spans: InMemorySpanExporter, conn: psycopg.Connection[Any], migrated_dsn: str, table: str
) -> None:
    with conn.transaction():
        ids = enqueue_many(conn, [Event("order.created", {}, "order", 1)], table=table)
    assert fetch(conn, table, ids[0])["trace_context"] is None
    seen: list[Any] = []
    dispatcher = _dispatcher(migrated_dsn, table, seen)
    claimed: list[Any] = []
    dispatcher.claim_and_publish(lambda claims: claimed.extend(claims) or len(claims))
    assert dispatcher.deliver(ids[0], claimed[0].lease_version) == "done"
    assert spans.get_finished_spans() == ()
    assert not seen[0].is_valid


def test_the_claim_context_rides_in_the_delivery_task_headers(
    spans: InMemorySpanExporter, conn: psycopg.Connection[Any], migrated_dsn: str, table: str, redis_url: str
) -> None:
    from celery import Celery

    from outbox_celery import Outbox

    app = Celery("tracing", broker=redis_url, set_as_current=False)
    outbox = Outbox(app, name="tracing", dsn=migrated_dsn, table=table)
    outbox.handler(ORDER["event_type"], queue="tracing-test")(lambda message: None)
    with conn.transaction():
        enqueue(conn, payload={}, table=table, **ORDER)
    try:
        with app.connection_for_write() as c:
            c.SimpleQueue("tracing-test").clear()
        with trace.get_tracer("test").start_as_current_span("claim run") as claim_span:
            assert outbox.claim().published == 1
        with app.connection_for_read() as c:
            queue = c.SimpleQueue("tracing-test")
            message = queue.get(timeout=10)
            message.ack()
            queue.close()
    finally:
        outbox.close()
        app.close()
    headers = message.headers
    context = claim_span.get_span_context()
    assert headers["traceparent"].startswith(f"00-{context.trace_id:032x}-{context.span_id:016x}-")
    assert headers["outbox_event_type"] == ORDER["event_type"]
    assert json.dumps(headers)  # plain strings, as Celery's instrumentation reads them
