"""One trace from enqueue to handler through a real Celery worker instrumented by
``opentelemetry-instrumentation-celery``: the claim's context rides in the delivery task's
headers (the worker's ``run`` span is a child of the claim run), and the handler's span
continues the producer's trace with a link to that ``run`` span.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

pytest.importorskip("opentelemetry.instrumentation.celery")

from celery import Celery
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from outbox_celery import Outbox, enqueue, migrate

pytestmark = pytest.mark.slow
TIMEOUT = 90.0  # seconds; bounds waiting, never asserts speed

WORKER_APP = """
import json, os
from celery import Celery
from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from outbox_celery import Outbox


class FileExporter(SpanExporter):
    def export(self, spans):
        with open(os.environ["SPANS_FILE"], "a") as f:
            for s in spans:
                f.write(json.dumps({
                    "name": s.name,
                    "trace_id": s.context.trace_id,
                    "span_id": s.context.span_id,
                    "parent": s.parent.span_id if s.parent else None,
                    "links": [link.context.span_id for link in s.links],
                }) + "\\n")
        return SpanExportResult.SUCCESS


provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(FileExporter()))
trace.set_tracer_provider(provider)
CeleryInstrumentor().instrument()

app = Celery("tracing_app", broker=os.environ["BROKER_URL"])
outbox = Outbox(app, name="traced", dsn=os.environ["DSN"])


@outbox.handler("order.created", queue="traced.orders")
def order_created(message):
    pass
"""


@pytest.fixture
def tracer() -> Iterator[trace.Tracer]:
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    yield trace.get_tracer("test")


def _status(dsn: str, outbox_id: int) -> str:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute("SELECT status FROM outbox WHERE id = %s", [outbox_id]).fetchone()
    assert row is not None
    return str(row[0])


def test_one_trace_from_enqueue_through_a_celery_worker_to_the_handler(
    dsn: str, redis_url: str, tmp_path: Path, tracer: trace.Tracer
) -> None:
    (tmp_path / "tracing_app.py").write_text(WORKER_APP)
    spans_file = tmp_path / "spans.jsonl"
    env = {**os.environ, "SPANS_FILE": str(spans_file), "BROKER_URL": redis_url, "DSN": dsn}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        with tracer.start_as_current_span("checkout") as checkout, conn.transaction():
            outbox_id = enqueue(
                conn, event_type="order.created", payload={}, aggregate_type="order", aggregate_id=1
            )

    # The claim runs here, in a process without Celery instrumentation: only the outbox's own
    # header carries the claim's context to the worker.
    app = Celery("tracing_app", broker=redis_url, set_as_current=False)
    outbox = Outbox(app, name="traced", dsn=dsn)
    outbox.handler("order.created", queue="traced.orders")(lambda message: None)
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tracing_app", "worker", "-P", "solo", "-Q", "traced.orders"],
        cwd=tmp_path,
        env=env,
        stdout=(tmp_path / "worker.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        with tracer.start_as_current_span("claim run") as claim:
            assert outbox.claim().published == 1
        deadline = time.monotonic() + TIMEOUT
        while _status(dsn, outbox_id) != "done":
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()
            time.sleep(0.2)
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(TIMEOUT)
        outbox.close()
        app.close()

    spans: list[dict[str, Any]] = [json.loads(line) for line in spans_file.read_text().splitlines()]
    (run,) = [s for s in spans if s["name"].startswith("run/")]
    (handle,) = [s for s in spans if s["name"] == "outbox.handle order.created"]
    claim_ctx, producer = claim.get_span_context(), checkout.get_span_context()
    # Celery's instrumentation connected claim and delivery through the task's headers...
    assert (run["trace_id"], run["parent"]) == (claim_ctx.trace_id, claim_ctx.span_id)
    # ...and the handler continues the producer's trace, linked to the delivery's run span.
    assert (handle["trace_id"], handle["parent"]) == (producer.trace_id, producer.span_id)
    assert handle["links"] == [run["span_id"]]
