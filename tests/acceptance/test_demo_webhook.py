"""The example's webhook client against a real HTTP server: every answer becomes the outcome its
README promises (429 -> RetryableError with the Retry-After delay, 5xx and dropped connections ->
RetryableError, other 4xx -> PermanentError), and the Idempotency-Key is sent every time."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from outbox_celery import Message, PermanentError, RetryableError

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the examples package lives at the repository root, not installed
    sys.path.insert(0, str(ROOT))

from examples.orders.webhook import post_event  # noqa: E402


class Downstream:
    """A webhook that answers what the test scripts, and records what it received."""

    def __init__(self) -> None:
        self.answer: tuple[int, dict[str, str]] | None = (200, {})
        self.received: list[dict[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.received.append(dict(self.headers))
                if outer.answer is None:  # drop the connection without an answer
                    self.close_connection = True
                    return
                status, headers = outer.answer
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/webhooks"


@pytest.fixture
def downstream() -> Iterator[Downstream]:
    d = Downstream()
    thread = threading.Thread(target=d.server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield d
    finally:
        d.server.shutdown()
        thread.join()
        d.server.server_close()


def _message() -> Message:
    return Message(
        id=42,
        event_type="order.paid",
        aggregate_type="order",
        aggregate_id="7",
        payload={"order_id": 7},
        attempts=1,
        created_at=datetime.now(UTC),
        lease_version=3,
        ordering_key=None,
        idempotency_key="outbox:42",
    )


def test_2xx_is_delivered_with_the_idempotency_key(downstream: Downstream) -> None:
    post_event(_message(), url=downstream.url)
    assert downstream.received[-1]["Idempotency-Key"] == "outbox:42"
    assert downstream.received[-1]["X-Event-Type"] == "order.paid"


def test_429_retries_after_the_retry_after_header(downstream: Downstream) -> None:
    downstream.answer = (429, {"Retry-After": "7"})
    with pytest.raises(RetryableError) as caught:
        post_event(_message(), url=downstream.url)
    assert caught.value.delay == 7.0

    later = datetime.now(UTC) + timedelta(seconds=120)
    downstream.answer = (429, {"Retry-After": format_datetime(later, usegmt=True)})
    with pytest.raises(RetryableError) as caught:
        post_event(_message(), url=downstream.url)
    assert caught.value.delay is not None and 100 < caught.value.delay <= 120


@pytest.mark.parametrize("status", [500, 502, 503, 408])
def test_server_errors_are_retryable_with_the_outbox_backoff(downstream: Downstream, status: int) -> None:
    downstream.answer = (status, {})
    with pytest.raises(RetryableError) as caught:
        post_event(_message(), url=downstream.url)
    assert caught.value.delay is None
    assert str(status) in str(caught.value)


@pytest.mark.parametrize("status", [400, 401, 404, 410, 422])
def test_other_client_errors_are_permanent(downstream: Downstream, status: int) -> None:
    downstream.answer = (status, {})
    with pytest.raises(PermanentError, match=str(status)):
        post_event(_message(), url=downstream.url)


def test_a_dropped_connection_is_retryable(downstream: Downstream) -> None:
    downstream.answer = None
    with pytest.raises(RetryableError, match="unreachable"):
        post_event(_message(), url=downstream.url)
    assert len(downstream.received) == 1  # it did arrive: the receiver must de-duplicate


def test_a_refused_connection_is_retryable(downstream: Downstream) -> None:
    url = downstream.url
    downstream.server.shutdown()
    downstream.server.server_close()
    with pytest.raises(RetryableError, match="unreachable"):
        post_event(_message(), url=url)
