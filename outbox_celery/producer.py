"""Write events in the caller's transaction: :func:`enqueue` and :func:`enqueue_many`.

The whole point of an outbox is that the event commits with the business data or not at all,
so both functions refuse a connection in autocommit mode outside a transaction block unless
``allow_autocommit=True`` is passed on purpose.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import pq

from .config import TableName
from .errors import MAX_DELAY_SECONDS, ProducerError
from .store import Store

__all__ = ["DEFAULT_MAX_PAYLOAD_BYTES", "Event", "enqueue", "enqueue_many"]

DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024
MAX_EVENT_TYPE_LENGTH = 200
MAX_AGGREGATE_LENGTH = 200

_stores: dict[str, Store] = {}

# json.dumps writes NUL as the escape \u0000 (jsonb refuses it) and a literal backslash as \\,
# so only a \u0000 preceded by an even number of backslashes is a NUL.
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def _store(table: str | TableName) -> Store:
    key = str(TableName.parse(table))
    store = _stores.get(key)
    if store is None:
        store = _stores[key] = Store(table)
    return store


@dataclass(frozen=True, slots=True)
class Event:
    """One event for :func:`enqueue_many` (same fields as :func:`enqueue`'s keywords)."""

    event_type: str
    payload: Any
    aggregate_type: str
    aggregate_id: str | int
    ordered: bool = False
    delay: float | timedelta | None = None
    ordering_key: str | None = None


def _text(value: Any, name: str, limit: int) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ProducerError(f"{name} must be a string, got {type(value).__name__}")
    text = str(value)
    if not text.strip():
        raise ProducerError(f"{name} must not be empty")
    if len(text) > limit:
        raise ProducerError(f"{name} is {len(text)} characters; the limit is {limit}")
    if "\x00" in text:
        raise ProducerError(f"{name} must not contain NUL characters")
    return text


def _row(event: Event, max_payload_bytes: int) -> dict[str, Any]:
    event_type = _text(event.event_type, "event_type", MAX_EVENT_TYPE_LENGTH)
    aggregate_type = _text(event.aggregate_type, "aggregate_type", MAX_AGGREGATE_LENGTH)
    aggregate_id = _text(event.aggregate_id, "aggregate_id", MAX_AGGREGATE_LENGTH)
    try:
        payload = json.dumps(event.payload, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
        # Raises on a lone surrogate, which jsonb would refuse inside the caller's transaction.
        size = len(payload.encode("utf-8"))
    except (TypeError, ValueError) as exc:
        raise ProducerError(f"payload of {event_type!r} is not JSON-serializable: {exc}") from exc
    if _NUL_ESCAPE.search(payload):
        raise ProducerError("payload must not contain NUL characters (jsonb rejects them)")
    if size > max_payload_bytes:
        raise ProducerError(
            f"payload of {event_type!r} is {size} bytes as JSON; the limit is {max_payload_bytes}"
        )
    delay = event.delay
    seconds = delay.total_seconds() if isinstance(delay, timedelta) else (delay or 0.0)
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not math.isfinite(seconds)
        or seconds < 0
        or seconds > MAX_DELAY_SECONDS
    ):
        raise ProducerError(f"delay must be a number of seconds between 0 and 100 years, got {delay!r}")
    key: str | None = None
    if event.ordering_key is not None:
        key = _text(event.ordering_key, "ordering_key", 2 * MAX_AGGREGATE_LENGTH + 1)
    elif event.ordered:
        key = f"{aggregate_type}:{aggregate_id}"
    return {
        "event_type": event_type,
        "aggregate_type": aggregate_type,
        "aggregate_id": aggregate_id,
        "payload": payload,
        "ordering_key": key,
        "delay": float(seconds),
    }


def _check_transaction(conn: psycopg.Connection[Any], allow_autocommit: bool) -> None:
    if not isinstance(conn, psycopg.Connection):
        raise ProducerError(
            f"expected a psycopg 3 Connection, got {type(conn).__name__} "
            "(Django/SQLAlchemy users: see docs/integrations.md)"
        )
    status = conn.info.transaction_status
    if status == pq.TransactionStatus.INERROR:
        raise ProducerError("the connection's transaction has failed; roll it back first")
    if conn.autocommit and status == pq.TransactionStatus.IDLE and not allow_autocommit:
        raise ProducerError(
            "connection is in autocommit mode outside a transaction: the event would commit "
            "on its own, apart from your business data. Use `with conn.transaction():` or pass "
            "allow_autocommit=True if that is really what you want"
        )


@contextlib.contextmanager
def _atomic(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """A transaction of our own only when ``allow_autocommit`` let an autocommit write through.

    Otherwise a key lock taken in autocommit would be released before the insert commits and
    id order could differ from commit order. Inside the caller's transaction nothing is added
    (no savepoint).
    """
    if conn.autocommit and conn.info.transaction_status == pq.TransactionStatus.IDLE:
        with conn.transaction():
            yield
    else:
        yield


@contextlib.contextmanager
def _notifying(conn: psycopg.Connection[Any], store: Store, notify: bool) -> Iterator[None]:
    """Queue the commit-time notification (#11) in the same round trip as the insert.

    In pipeline mode the notify statement is sent with what follows and the insert's result
    brings both back: NOTIFY costs the producer no extra round trip.
    """
    if not notify:
        yield
        return
    with conn.pipeline():
        store.notify(conn)
        yield


def enqueue(
    conn: psycopg.Connection[Any],
    *,
    event_type: str,
    payload: Any,
    aggregate_type: str,
    aggregate_id: str | int,
    ordered: bool = False,
    delay: float | timedelta | None = None,
    table: str | TableName = "outbox",
    ordering_key: str | None = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    allow_autocommit: bool = False,
    notify: bool = True,
) -> int:
    """Insert one event in ``conn``'s current transaction and return its id.

    :param event_type: routes the event to its handler and queue; 1-200 characters.
    :param payload: anything :func:`json.dumps` accepts (no NaN/Infinity), at most
        ``max_payload_bytes`` once encoded.
    :param aggregate_type: the kind of business object (``"order"``); 1-200 characters.
    :param aggregate_id: its id; 1-200 characters.
    :param ordered: deliver in commit order with the other ordered events of the same
        ``aggregate_type:aggregate_id`` (or ``ordering_key``). Concurrent producers of one key
        are serialized until commit, so id order equals commit order.
    :param delay: not claimable before ``now() + delay`` (database clock).
    :param table: outbox table, ``"name"`` or ``"schema.name"``.
    :param ordering_key: an explicit ordering key (implies ``ordered``).
    :param allow_autocommit: permit a write that commits on its own (defeats the pattern).
    :param notify: wake the table's listeners at commit (``pg_notify``, see docs/push.md);
        ``False`` leaves the event to the next claim run.
    :raises ProducerError: bad input or no transaction; nothing is written.
    """
    event = Event(event_type, payload, aggregate_type, aggregate_id, ordered, delay, ordering_key)
    row = _row(event, max_payload_bytes)
    _check_transaction(conn, allow_autocommit)
    store = _store(table)
    with _atomic(conn), _notifying(conn, store, notify):
        if row["ordering_key"] is not None:
            store.lock_keys(conn, [row["ordering_key"]])
        return store.insert(conn, row)


def enqueue_many(
    conn: psycopg.Connection[Any],
    messages: Iterable[Event | Mapping[str, Any]],
    *,
    table: str | TableName = "outbox",
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    allow_autocommit: bool = False,
    notify: bool = True,
) -> list[int]:
    """Insert many events with one statement; return their ids in input order.

    ``messages`` holds :class:`Event` objects or mappings with :func:`enqueue`'s keywords.
    Every event is validated before anything is written: one bad event refuses the batch.
    One notification wakes the listeners at commit unless ``notify=False`` (as in :func:`enqueue`).
    """
    rows = []
    for i, m in enumerate(messages):
        if isinstance(m, Mapping):
            try:
                m = Event(**m)
            except TypeError as exc:
                raise ProducerError(f"message {i}: {exc}") from exc
        if not isinstance(m, Event):
            raise ProducerError(f"message {i}: expected Event or mapping, got {type(m).__name__}")
        try:
            rows.append(_row(m, max_payload_bytes))
        except ProducerError as exc:
            raise ProducerError(f"message {i}: {exc}") from exc
    _check_transaction(conn, allow_autocommit)
    if not rows:
        return []
    store = _store(table)
    keys = [r["ordering_key"] for r in rows if r["ordering_key"] is not None]
    with _atomic(conn), _notifying(conn, store, notify):
        if keys:
            store.lock_keys(conn, keys)
        return store.insert_many(conn, rows)
