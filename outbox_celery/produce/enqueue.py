"""Write events in the caller's transaction: :func:`enqueue` and :func:`enqueue_many`, and
:func:`enqueue_async` / :func:`enqueue_many_async` for asyncio.

The whole point of an outbox is that the event commits with the business data or not at all,
so every function refuses a connection in autocommit mode outside a transaction block unless
``allow_autocommit=True`` is passed on purpose. Every connection kind (psycopg 3, psycopg2,
SQLAlchemy, sync or async) goes through the same validation, the same transaction check and the
same statements (:meth:`ProducerWrites.write_plan <outbox_celery.produce.writes.ProducerWrites.write_plan>`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .. import codec
from ..db.store import Store
from ..errors import ProducerError, first_line, seconds
from ..message import KEY_SEPARATOR, ROUTE_SEPARATOR
from ..table import TableName
from ..tracing import capture
from .connections import IDLE, INERROR, _View, async_view, drive, drive_async, note_follow_ups, sync_view
from .writes import ProducerWrites, WritePlan

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "Event",
    "Group",
    "enqueue",
    "enqueue_async",
    "enqueue_group",
    "enqueue_group_async",
    "enqueue_many",
    "enqueue_many_async",
    "group",
]

#: The key a group's callback finds its members' outcomes under in its payload (invariant 29).
GROUP_KEY = "outbox_group"

DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024
MAX_EVENT_TYPE_LENGTH = 200
MAX_AGGREGATE_LENGTH = 200
MAX_DEDUP_KEY_LENGTH = 400
MAX_LIMIT_KEY_LENGTH = 400
# PostgreSQL's SQLSTATE for "relation does not exist": the schema was never migrated.
UNDEFINED_TABLE = "42P01"

_writes: dict[str, ProducerWrites] = {}

# JSON writes NUL as the escape \u0000 (PostgreSQL cannot turn it into text, so a search of the
# payload would fail on the row) and a literal backslash as \\, so only a \u0000 preceded by an
# even number of backslashes is a NUL.
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def _producer(table: str | TableName) -> ProducerWrites:
    """The producer's writes of ``table``, made once per process."""
    key = str(TableName.parse(table))
    writes = _writes.get(key)
    if writes is None:
        writes = _writes[key] = ProducerWrites(Store(table))
    return writes


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
    dedup_key: str | None = None
    limit_key: str | None = None


def checked_text(value: Any, name: str, limit: int) -> str:
    """``value`` as text, refused with :class:`ProducerError` if it is empty, too long, holds NUL
    or is not valid Unicode (a lone surrogate, which no database encoding can store)."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ProducerError(f"{name} must be a string, got {type(value).__name__}")
    text = str(value)
    if not text.strip():
        raise ProducerError(f"{name} must not be empty")
    if len(text) > limit:
        raise ProducerError(f"{name} is {len(text)} characters; the limit is {limit}")
    if "\x00" in text:
        raise ProducerError(f"{name} must not contain NUL characters")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ProducerError(
            f"{name} is not valid Unicode: a lone surrogate at position {exc.start} (decode the text "
            "with errors='strict' or 'replace' before enqueueing it)"
        ) from None
    return text


def _row(event: Event, max_payload_bytes: int) -> dict[str, Any]:
    event_type = checked_text(event.event_type, "event_type", MAX_EVENT_TYPE_LENGTH)
    if ROUTE_SEPARATOR in event_type:
        # "<event_type>@<name>" is a subscription's route (DESIGN invariant 28): the producer
        # writes the fact, the table's subscriptions decide its routes.
        raise ProducerError(
            f"event_type {event_type!r} contains {ROUTE_SEPARATOR!r}, which separates an event type "
            "from a subscription's name; enqueue the event type alone"
        )
    aggregate_type = checked_text(event.aggregate_type, "aggregate_type", MAX_AGGREGATE_LENGTH)
    aggregate_id = checked_text(event.aggregate_id, "aggregate_id", MAX_AGGREGATE_LENGTH)
    try:
        # Kombu's JSON, as Celery's task arguments: refused unless it comes back as itself
        # (DESIGN invariant 27).
        payload = codec.encode(event.payload)
    except codec.PayloadError as exc:
        raise ProducerError(f"payload of {event_type!r}: {exc}") from exc
    size = len(payload.encode("utf-8"))
    if _NUL_ESCAPE.search(payload):
        raise ProducerError("payload must not contain NUL characters (PostgreSQL cannot search them)")
    if size > max_payload_bytes:
        raise ProducerError(
            f"payload of {event_type!r} is {size} bytes as JSON; the limit is {max_payload_bytes}"
        )
    delay = event.delay
    delay_seconds = seconds(delay or 0.0, "delay", error=ProducerError, delay=True)
    key: str | None = None
    if event.ordering_key is not None:
        key = checked_text(event.ordering_key, "ordering_key", 2 * MAX_AGGREGATE_LENGTH + 1)
    elif event.ordered:
        key = f"{aggregate_type}:{aggregate_id}"
    if key is not None and KEY_SEPARATOR in key:
        # A subscription's stored key is "<key>" chr(31) route (DESIGN invariant 28).
        raise ProducerError("ordering_key must not contain the unit separator character (chr(31))")
    dedup_key = None
    if event.dedup_key is not None:
        if isinstance(event.dedup_key, int):  # a str only: 1 and "1" must not be two keys
            raise ProducerError(f"dedup_key must be a string, got {type(event.dedup_key).__name__}")
        dedup_key = checked_text(event.dedup_key, "dedup_key", MAX_DEDUP_KEY_LENGTH)
    limit_key = None
    if event.limit_key is not None:
        limit_key = checked_text(event.limit_key, "limit_key", MAX_LIMIT_KEY_LENGTH)
    return {
        "event_type": event_type,
        "aggregate_type": aggregate_type,
        "aggregate_id": aggregate_id,
        "payload": payload,
        "ordering_key": key,
        "delay": delay_seconds,
        "dedup_key": dedup_key,
        "trace_context": None,
        "limit_key": limit_key,
    }


def check_transaction(conn: Any, allow_autocommit: bool) -> _View:
    """The connection's view, when it may take the write: in a transaction, or allowed not to be."""
    view = conn if isinstance(conn, _View) else sync_view(conn)
    if view.status == INERROR:
        raise ProducerError("the connection's transaction has failed; roll it back first")
    if view.autocommit and view.status == IDLE and not allow_autocommit:
        raise ProducerError(
            "connection is in autocommit mode outside a transaction: the event would commit "
            "on its own, apart from your business data. Use `with conn.transaction():` "
            "(SQLAlchemy: a non-AUTOCOMMIT engine) or pass allow_autocommit=True if that is "
            "really what you want"
        )
    return view


def _owns_transaction(view: _View) -> bool:
    """Whether ``allow_autocommit`` let an autocommit write through: then we open a transaction.

    Otherwise a key lock taken in autocommit would be released before the insert commits and
    id order could differ from commit order. Inside the caller's transaction nothing is added
    (no savepoint).
    """
    return view.autocommit and view.status == IDLE


def _rows(messages: Iterable[Event | Mapping[str, Any]], max_payload_bytes: int) -> list[dict[str, Any]]:
    """Validate every message before anything is written: one bad message refuses the batch."""
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
    return rows


def _trace(rows: list[dict[str, Any]]) -> None:
    """Store the trace context current at enqueue with every row (none without OpenTelemetry)."""
    context = capture()
    if context is not None:
        for row in rows:
            row["trace_context"] = context


def _plan(
    view: _View,
    rows: list[dict[str, Any]],
    table: str | TableName,
    allow_autocommit: bool,
    notify: bool,
    group: dict[str, Any] | None = None,
) -> WritePlan | None:
    """What every write path does before any I/O: the transaction check, the trace context, the
    plan (``None`` when there is nothing to write)."""
    check_transaction(view, allow_autocommit)
    if not rows:
        return None
    _trace(rows if group is None else [*rows, group["then"]])
    return _producer(table).write_plan(rows, notify=notify, group=group)


def _sqlstate(exc: BaseException) -> str | None:
    """The PostgreSQL SQLSTATE behind ``exc``, whichever driver or wrapper raised it.

    psycopg 3 says ``sqlstate``, psycopg2 ``pgcode``; SQLAlchemy keeps the driver's error in
    ``orig``, Django in ``__cause__``.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        code = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        if isinstance(code, str):
            return code
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else current.__cause__
    return None


def _missing_table(exc: BaseException, table: str | TableName) -> ProducerError | None:
    """A :class:`ProducerError` that says what to run when ``exc`` is "the table does not exist"."""
    if _sqlstate(exc) != UNDEFINED_TABLE:
        return None
    return ProducerError(
        f"the outbox table {TableName.parse(table)} does not exist in this database ({first_line(exc)}): "
        "is the schema installed? run `outbox-celery migrate` (with the Django app: "
        "`manage.py migrate`); this transaction has failed, roll it back"
    )


@contextmanager
def _explained(table: str | TableName) -> Iterator[None]:
    """Re-raise the driver's "no such table" as a :class:`ProducerError` that says what to run."""
    try:
        yield
    except Exception as exc:
        missing = _missing_table(exc, table)
        if missing is None:
            raise
        raise missing from exc


def _write(
    conn: Any,
    rows: list[dict[str, Any]],
    table: str | TableName,
    allow_autocommit: bool,
    notify: bool,
    group: dict[str, Any] | None = None,
) -> list[int]:
    """The one synchronous write path: check, key locks, insert (every connection kind)."""
    view = sync_view(conn)
    plan = _plan(view, rows, table, allow_autocommit, notify, group)
    if plan is None:
        return []
    with _explained(table):
        if not _owns_transaction(view):
            ids = drive(view, plan)
            # In a transactional handler's transaction: its follow-ups (DESIGN invariant 18);
            # a group's plan returns the group's id first, which is no outbox row.
            note_follow_ups(view, TableName.parse(table), ids if group is None else ids[1:])
            return ids
        with view.own_transaction():
            return drive(view, plan)


async def _write_async(
    conn: Any,
    rows: list[dict[str, Any]],
    table: str | TableName,
    allow_autocommit: bool,
    notify: bool,
    group: dict[str, Any] | None = None,
) -> list[int]:
    """:func:`_write` for async connections: the same check and the same plan."""
    view = await async_view(conn)
    plan = _plan(view, rows, table, allow_autocommit, notify, group)
    if plan is None:
        return []
    with _explained(table):
        if not _owns_transaction(view):
            return await drive_async(view, plan)
        async with view.own_transaction():
            return await drive_async(view, plan)


def enqueue(
    conn: Any,
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
    dedup_key: str | None = None,
    notify: bool = True,
    limit_key: str | None = None,
) -> int:
    """Insert one event in ``conn``'s current transaction and return its id.

    :param conn: a psycopg 3 ``Connection``, a psycopg2 connection, or a SQLAlchemy 2
        ``Session`` or ``Connection`` on the psycopg 3 or psycopg2 driver (a Session or
        Connection that has not begun yet begins, as its next ``execute()`` would).
    :param event_type: routes the event to its handler and queue; 1-200 characters.
    :param payload: what a Celery task argument may be: any JSON value (no NaN/Infinity) and
        the types kombu's JSON carries (``Decimal``, ``datetime``, ``date``, ``time``, ``UUID``,
        ``bytes``, and those added with :func:`outbox_celery.codec.register_type`), at most
        ``max_payload_bytes`` once encoded. The handler receives it as given (key order and
        number types included; a ``str`` arrives as that ``str``, never parsed), up to the
        conversions Celery makes too (a tuple arrives as a list, an ``int`` key as a string:
        :mod:`outbox_celery.codec`); anything else that would not come back as itself is
        refused (DESIGN invariant 27).
    :param aggregate_type: the kind of business object (``"order"``); 1-200 characters.
    :param aggregate_id: its id; 1-200 characters.
    :param ordered: deliver in commit order with the other ordered events of the same
        ``aggregate_type:aggregate_id`` (or ``ordering_key``). Concurrent producers of one key
        are serialized until commit, so id order equals commit order.
    :param delay: not claimable before ``now() + delay`` (database clock).
    :param table: outbox table, ``"name"`` or ``"schema.name"``.
    :param ordering_key: an explicit ordering key (implies ``ordered``).
    :param allow_autocommit: permit a write that commits on its own (defeats the pattern).
    :param notify: wake the table's listeners at commit (``pg_notify`` in the insert's own
        statement, see docs/push.md); ``False`` leaves the event to the next claim run.
    :param dedup_key: 1-400 characters. When a row with this key is already in the table
        (committed, or written earlier in this transaction), nothing is inserted and that row's
        id is returned; concurrent producers of one key end with exactly one row. The key is free
        again once retention has purged its row (``done`` rows older than ``purge_older_than``).
    :param limit_key: 1-400 characters: the key the limits per key of the event type's handler
        count this message under (a tenant, a downstream host; ``key_concurrency``, DESIGN
        invariant 24), and the key a ``RateLimited`` outcome of it holds. Rows of a type with
        limits per key are claimed key by key, round robin (docs/flow-control.md).
    :raises ProducerError: bad input, an unsupported connection, or no transaction; nothing is
        written. Also when the table does not exist (the schema was never migrated): the message
        says to run ``outbox-celery migrate``, the driver's error is its ``__cause__``.
    """
    event = Event(
        event_type, payload, aggregate_type, aggregate_id, ordered, delay, ordering_key, dedup_key, limit_key
    )
    return _write(conn, [_row(event, max_payload_bytes)], table, allow_autocommit, notify)[0]


def enqueue_many(
    conn: Any,
    messages: Iterable[Event | Mapping[str, Any]],
    *,
    table: str | TableName = "outbox",
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    allow_autocommit: bool = False,
    notify: bool = True,
) -> list[int]:
    """Insert many events with one statement; return their ids in input order.

    ``conn`` is any connection :func:`enqueue` accepts. ``messages`` holds :class:`Event`
    objects or mappings with :func:`enqueue`'s keywords. Every event is validated before
    anything is written: one bad event refuses the batch. One notification wakes the listeners
    at commit unless ``notify=False`` (as in :func:`enqueue`).
    """
    return _write(conn, _rows(messages, max_payload_bytes), table, allow_autocommit, notify)


async def enqueue_async(
    conn: Any,
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
    dedup_key: str | None = None,
    notify: bool = True,
    limit_key: str | None = None,
) -> int:
    """:func:`enqueue` for asyncio: same arguments, validation, key locks and errors.

    :param conn: a psycopg 3 ``AsyncConnection``, or a SQLAlchemy ``AsyncSession`` or
        ``AsyncConnection`` on the psycopg 3 driver (``postgresql+psycopg://``).
    """
    event = Event(
        event_type, payload, aggregate_type, aggregate_id, ordered, delay, ordering_key, dedup_key, limit_key
    )
    return (await _write_async(conn, [_row(event, max_payload_bytes)], table, allow_autocommit, notify))[0]


async def enqueue_many_async(
    conn: Any,
    messages: Iterable[Event | Mapping[str, Any]],
    *,
    table: str | TableName = "outbox",
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    allow_autocommit: bool = False,
    notify: bool = True,
) -> list[int]:
    """:func:`enqueue_many` for asyncio (connections as :func:`enqueue_async`)."""
    return await _write_async(conn, _rows(messages, max_payload_bytes), table, allow_autocommit, notify)


@dataclass(frozen=True, slots=True)
class Group:
    """What :func:`enqueue_group` wrote: the group's id and its members' ids in input order (a
    member dropped as a duplicate dedup key gives the id of the row holding the key, which is
    no member of the group)."""

    id: int
    member_ids: list[int]


def _group_rows(
    messages: Iterable[Event | Mapping[str, Any]],
    then: Event | Mapping[str, Any],
    skip_on_dead: bool,
    limit: int,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The members' and the callback's rows, validated before anything is written."""
    rows = _rows(messages, limit)
    if not rows:
        raise ProducerError("a group needs at least one member event")
    if isinstance(then, Mapping):
        try:
            then = Event(**then)
        except TypeError as exc:
            raise ProducerError(f"then: {exc}") from exc
    if not isinstance(then, Event):
        raise ProducerError(f"then: expected Event or mapping, got {type(then).__name__}")
    if not isinstance(then.payload, Mapping) or GROUP_KEY in then.payload:
        raise ProducerError(
            f"then: the callback's payload must be a mapping without the key {GROUP_KEY!r}: the "
            f"members' outcomes are added under that key when the group completes"
        )
    if then.ordered or then.ordering_key is not None or then.dedup_key is not None:
        raise ProducerError(
            "then: a group's callback cannot be ordered or carry a dedup key: it is enqueued "
            "exactly once, by the finalize of the group's last member (DESIGN invariant 29)"
        )
    try:
        callback = _row(then, limit)
    except ProducerError as exc:
        raise ProducerError(f"then: {exc}") from exc
    return rows, {"then": callback, "skip_on_dead": bool(skip_on_dead)}


def enqueue_group(
    conn: Any,
    messages: Iterable[Event | Mapping[str, Any]],
    *,
    then: Event | Mapping[str, Any],
    skip_on_dead: bool = False,
    table: str | TableName = "outbox",
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    allow_autocommit: bool = False,
    notify: bool = True,
) -> Group:
    """Insert a group of events and its callback in ``conn``'s transaction (DESIGN invariant 29).

    The members are written as :func:`enqueue_many` writes them (one statement with the group's
    row). The callback ``then`` is enqueued once every member has a final outcome (``done`` or
    ``dead``), in the transaction of the last member's fenced finalize: never twice, never lost.
    Its payload (a mapping) arrives with the key ``"outbox_group"`` added: ``id``, ``state``,
    ``total``, ``done``, ``dead``, ``dead_members`` (the first 100 dead members' ``id``,
    ``event_type`` and ``last_error``) and ``truncated`` (more were dead;
    :func:`outbox_celery.ops.operations.group_outcomes` reads them all).

    :param skip_on_dead: when a member is dead at the end, the group is closed as ``skipped``
        and no callback is enqueued.
    :param then: the callback's event; neither ordered nor with a dedup key.
    :raises ProducerError: as :func:`enqueue_many`; also for no member or a callback that is
        not allowed. Nothing is written.

    A member dropped as a duplicate dedup key is no member (the group's total counts the rows
    inserted); a group whose every member was dropped is complete at once and its callback is
    enqueued in this transaction.
    """
    rows, group_spec = _group_rows(messages, then, skip_on_dead, max_payload_bytes)
    ids = _write(conn, rows, table, allow_autocommit, notify, group_spec)
    return Group(ids[0], ids[1:])


#: :func:`enqueue_group` by its short name: ``outbox.group(conn, [...], then=Event(...))``.
group = enqueue_group


async def enqueue_group_async(
    conn: Any,
    messages: Iterable[Event | Mapping[str, Any]],
    *,
    then: Event | Mapping[str, Any],
    skip_on_dead: bool = False,
    table: str | TableName = "outbox",
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    allow_autocommit: bool = False,
    notify: bool = True,
) -> Group:
    """:func:`enqueue_group` for asyncio (connections as :func:`enqueue_async`)."""
    rows, group_spec = _group_rows(messages, then, skip_on_dead, max_payload_bytes)
    ids = await _write_async(conn, rows, table, allow_autocommit, notify, group_spec)
    return Group(ids[0], ids[1:])
