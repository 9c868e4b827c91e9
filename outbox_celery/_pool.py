"""A connection pool per process: opened lazily, replaced after ``fork()``.

Celery's prefork workers fork after the parent may have opened a pool; a child must never use
the parent's sockets, nor close them under the parent.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from psycopg_pool import ConnectionPool

__all__ = ["ForkSafePool"]

# Pools inherited across fork() are never touched (closing them would talk on the parent's
# sockets) nor garbage collected (their finalizer would wait on threads that did not survive).
_ORPHANED_POOLS: list[ConnectionPool[Any]] = []


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

    def close(self) -> None:
        """Close the pool if this process opened it (idempotent)."""
        with self._lock:
            pool, self._pool = self._pool, None
            if pool is not None and self._pid == os.getpid():
                pool.close()
            self._pid = None

    def after_fork(self) -> None:
        """In a forked child: set the parent's pool aside, untouched; the next use opens one."""
        with self._lock:
            if self._pool is not None and self._pid != os.getpid():
                _ORPHANED_POOLS.append(self._pool)
                self._pool = None
                self._pid = None
