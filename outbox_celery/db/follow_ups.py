"""The rows enqueued inside a transactional handler's transaction: its follow-ups.

The deliverer watches that transaction's connection while the handler runs; the producer notes
the ids it inserted there, per outbox table. A long transaction's follow-ups are then moved to
the time of its commit before its done (DESIGN invariants 18, 20).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import psycopg

from ..table import TableName

__all__ = ["FOLLOW_UPS", "FollowUps", "Noted"]

#: What :class:`FollowUps` collects: table -> ids enqueued.
Noted = dict[TableName, list[int]]


class FollowUps:
    """The rows enqueued on the connections being watched, by connection.

    Connections nobody watches (every producer outside a transactional handler) cost one
    dictionary lookup.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: weakref.WeakKeyDictionary[Any, Noted] = weakref.WeakKeyDictionary()

    @contextlib.contextmanager
    def watch(self, conn: psycopg.Connection[Any]) -> Iterator[Noted]:
        """Collect what is enqueued on ``conn`` inside the block: table -> ids."""
        noted: Noted = {}
        with self._lock:
            self._watched[conn] = noted
        try:
            yield noted
        finally:
            with self._lock:
                self._watched.pop(conn, None)

    def note(self, conn: psycopg.Connection[Any], table: TableName, ids: list[int]) -> None:
        """``ids`` were inserted into ``table`` on ``conn`` (the producer calls this)."""
        if not ids:
            return
        with self._lock:
            noted = self._watched.get(conn)
            if noted is not None:
                noted.setdefault(table, []).extend(ids)


#: The process's one registry (producers and deliverers of every outbox table share it).
FOLLOW_UPS = FollowUps()
