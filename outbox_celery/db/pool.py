"""A connection pool per process: opened lazily, replaced after ``fork()``.

Celery's prefork workers fork after the parent may have opened a pool; a child must never use
the parent's sockets, nor close them under the parent.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

__all__ = ["DatabaseUnavailable", "ForkSafePool", "IdleCheck"]

# Pools inherited across fork() are never touched (closing them would talk on the parent's
# sockets) nor garbage collected (their finalizer would wait on threads that did not survive).
_ORPHANED_POOLS: list[ConnectionPool[Any]] = []


class DatabaseUnavailable(psycopg.OperationalError):
    """A database of an Outbox that serves several failed to give a connection moments ago and
    is not tried again until its pause ends (DESIGN invariant 34): the caller fails at once
    instead of waiting ``connection_wait`` for it again. A fenced write is not retried on it,
    and nothing is written about it: there is nothing to write on."""


class ForkSafePool:
    """This process's :class:`~psycopg_pool.ConnectionPool`, made by ``open_pool`` on first use.

    :param open_pool: opens a pool (called at most once per process while the pool is open).
    """

    def __init__(self, open_pool: Callable[[], ConnectionPool[Any]]) -> None:
        self._open_pool = open_pool
        self._lock = threading.Lock()
        self._pool: ConnectionPool[Any] | None = None
        self._pid: int | None = None

    def get(self) -> ConnectionPool[Any]:
        """The pool of the calling process, opened now if it has none."""
        pid = os.getpid()
        if self._pool is None or self._pid != pid:
            with self._lock:
                if self._pool is None or self._pid != pid:
                    if self._pool is not None:
                        _ORPHANED_POOLS.append(self._pool)
                    self._pool = self._open_pool()
                    self._pid = pid
        return self._pool

    @property
    def opened(self) -> bool:
        """Whether the calling process holds an open pool."""
        return self._pool is not None and self._pid == os.getpid()

    def close(self, timeout: float = 5.0) -> None:
        """Close the pool if this process opened it (idempotent); ``timeout``: seconds its
        threads are waited for."""
        with self._lock:
            pool, self._pool = self._pool, None
            if pool is not None and self._pid == os.getpid():
                pool.close(timeout=timeout)
            self._pid = None

    def after_fork(self) -> None:
        """In a forked child: set the parent's pool aside, untouched; the next use opens one."""
        with self._lock:
            if self._pool is not None and self._pid != os.getpid():
                _ORPHANED_POOLS.append(self._pool)
                self._pool = None
                self._pid = None


class IdleCheck:
    """A pool ``check`` callback that tests only connections that sat idle ``after`` seconds.

    A connection the server closed while idle (a restart, a failover, ``pg_terminate_backend``)
    is replaced before use instead of failing the statement given to it. Checking every checkout
    cost a round trip per statement: as much as the fenced start and ``done`` together.
    A connection returned less than ``after`` seconds ago is handed out unchecked; should the
    server have closed it meanwhile, the statement fails with ``OperationalError`` and the
    caller retries on a checked connection (the worker's fenced writes do, DESIGN
    invariant 4).

    :param after: seconds of idleness after which a connection is checked before use.
    """

    def __init__(self, after: float) -> None:
        self.after = after
        self._returned: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()

    def __call__(self, conn: Any) -> None:
        returned = self._returned.get(conn)
        if returned is None or time.monotonic() - returned >= self.after:
            ConnectionPool.check_connection(conn)

    def returned(self, conn: Any) -> None:
        """Note that ``conn`` was just used (called as it goes back to the pool)."""
        self._returned[conn] = time.monotonic()
