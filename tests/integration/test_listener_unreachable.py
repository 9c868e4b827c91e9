"""The listener gives up after ``exit_after`` seconds without a working database session, and
only then (``unreachable_exit_after``; the Celery step turns giving up into a worker exit, tested
with a real worker in tests/acceptance/test_celery_unreachable.py).
"""

from __future__ import annotations

import socket
import threading
import time

from outbox_celery import Store
from outbox_celery.claim.listener import Listener


def _closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return int(s.getsockname()[1])


def _listener(exit_after: float | None, gave_up: threading.Event) -> Listener:
    return Listener(
        dsn=f"postgresql://postgres@127.0.0.1:{_closed_port()}/nowhere",
        store=Store("outbox"),
        claim=lambda: None,
        event_types=lambda: ["e"],
        exit_after=exit_after,
        on_unreachable=gave_up.set,
        name="t",
    )


def test_the_listener_gives_up_once_the_database_stayed_unreachable_past_the_bound() -> None:
    gave_up = threading.Event()
    listener = _listener(0.5, gave_up)
    started = time.monotonic()
    listener.start()
    try:
        assert gave_up.wait(10)
        assert time.monotonic() - started >= 0.5
        deadline = time.monotonic() + 5
        while listener.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not listener.running  # the thread ended with it
        assert listener.get_stats()["errors"] >= 2  # it retried within the bound
    finally:
        listener.stop()


def test_without_the_bound_the_listener_keeps_retrying() -> None:
    gave_up = threading.Event()
    listener = _listener(None, gave_up)
    listener.start()
    try:
        assert not gave_up.wait(2.0)
        assert listener.running and listener.get_stats()["errors"] >= 2
    finally:
        listener.stop()
