"""What operators see and do of groups with a callback (DESIGN invariant 29).

Reads are bounded (the open groups' index, the members' index); :func:`finish_group` and
:func:`cancel_group` close an open group by hand. Every function takes an autocommit or open
psycopg 3 connection and the outbox table's name, as every operation of :mod:`outbox_celery.ops` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

import psycopg

from ..db import statements as _sql
from ..errors import AdminError
from ..table import TableName
from ._queries import many, one, q, regclass, value

__all__ = [
    "DeadMember",
    "GroupInfo",
    "GroupSummary",
    "cancel_group",
    "finish_group",
    "get_group",
    "group_outcomes",
    "group_summary",
    "list_groups",
    "purge_groups",
]

#: The states of a group: open until every member is final, then fired or skipped; cancelled
#: or finished by an operator.
STATES = ("open", "fired", "skipped", "cancelled", "finished")


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """One group: its progress (``done + dead`` of ``total``) and its callback."""

    id: int
    state: str
    total: int
    done: int
    dead: int
    skip_on_dead: bool
    #: The callback's event type.
    event_type: str
    created_at: datetime
    closed_at: datetime | None
    #: Seconds since the group was written (database clock).
    age: float
    #: The callback's outbox id, once enqueued.
    callback_id: int | None
    #: Why an operator finished or cancelled it.
    note: str | None

    @property
    def progress(self) -> str:
        """``n of m``: members with a final outcome."""
        return f"{self.done + self.dead} of {self.total}"


@dataclass(frozen=True, slots=True)
class GroupSummary:
    """Open groups at a glance (:func:`group_summary`, part of ``stats``).

    :ivar open: open groups (a lower bound when ``capped``).
    :ivar oldest_open_age: seconds since the oldest open group was written; ``None``: none open.
    :ivar blocked: open groups with a dead member: they close only once the member is
        requeued and done, skipped, or the group is finished or cancelled by hand (or, when
        every other member is final, on their own: fired with the dead one's error, or skipped).
    """

    open: int = 0
    oldest_open_age: float | None = None
    blocked: int = 0
    capped: bool = False


@dataclass(frozen=True, slots=True)
class DeadMember:
    """A dead member of a group and its last error."""

    id: int
    event_type: str
    last_error: str | None


class _Closed(NamedTuple):
    """A row of ``group_close``: the group closed, and its callback's outbox id (finished)."""

    id: int
    callback_id: int | None


def _ready(conn: psycopg.Connection[Any], t: TableName) -> bool:
    name = t.identifier(_sql.GROUP_SUFFIX).as_string(conn)
    return bool(value(conn, q(t, "group_exists"), {"group_table": name}))


def group_summary(
    conn: psycopg.Connection[Any], table: str | TableName = "outbox", *, cap: int | None = 10_000
) -> GroupSummary:
    """Open groups, the oldest one's age, those blocked by a dead member (empty before 0012)."""
    t = TableName.parse(table)
    if not _ready(conn, t):
        return GroupSummary()
    row = one(conn, q(t, "group_summary"), {"cap": cap}, _summary)
    assert row is not None
    return row


def _summary(*, open: int, oldest_open_age: float | None, blocked: int, capped: bool | None) -> GroupSummary:
    return GroupSummary(int(open), oldest_open_age, int(blocked), bool(capped))


def list_groups(
    conn: psycopg.Connection[Any],
    table: str | TableName = "outbox",
    *,
    state: str | None = "open",
    limit: int = 100,
) -> list[GroupInfo]:
    """Groups in ``state`` (``None``: any), the newest first, at most ``limit``."""
    if state is not None and state not in STATES:
        raise AdminError(f"unknown group state {state!r}: one of {', '.join(STATES)}")
    t = TableName.parse(table)
    return many(conn, q(t, "group_list"), {"state": state, "limit": limit}, GroupInfo)


def get_group(conn: psycopg.Connection[Any], table: str | TableName, group_id: int) -> GroupInfo:
    """One group; :class:`AdminError` when there is none of that id."""
    t = TableName.parse(table)
    row = one(conn, q(t, "group_get"), {"id": group_id}, GroupInfo)
    if row is None:
        raise AdminError(f"no group {group_id} in {t.qualified}")
    return row


def group_outcomes(
    conn: psycopg.Connection[Any],
    table: str | TableName,
    group_id: int,
    *,
    after: int = 0,
    limit: int = 1000,
) -> list[DeadMember]:
    """Every dead member of a group with its last error, in id order: the callback's payload
    carries the first 100; page through the rest with ``after`` (the last id read)."""
    t = TableName.parse(table)
    params = {"id": group_id, "after": after, "limit": limit}
    return many(conn, q(t, "group_dead_members"), params, DeadMember)


def _close(
    conn: psycopg.Connection[Any], table: str | TableName, group_id: int, state: str, reason: str
) -> int | None:
    if not isinstance(reason, str) or not reason.strip():
        raise AdminError("a reason is required")
    t = TableName.parse(table)
    params = {"id": group_id, "state": state, "reason": reason, "table": regclass(conn, t)}
    with conn.transaction():
        row = one(conn, q(t, "group_close"), params, _Closed)
    if row is None:
        raise AdminError(f"group {group_id} is not open in {t.qualified} (unknown, or closed already)")
    return None if row.callback_id is None else int(row.callback_id)


def finish_group(conn: psycopg.Connection[Any], table: str | TableName, group_id: int, *, reason: str) -> int:
    """Close an open group now and enqueue its callback with the outcomes counted so far (its
    ``outbox_group.state`` says ``finished``); the callback's outbox id. Members still running
    finish as usual and count nothing."""
    callback = _close(conn, table, group_id, "finished", reason)
    assert callback is not None
    return callback


def cancel_group(
    conn: psycopg.Connection[Any], table: str | TableName, group_id: int, *, reason: str
) -> None:
    """Close an open group for good: its callback is never enqueued. Its members are left as
    they are (requeue, skip or purge them as usual)."""
    _close(conn, table, group_id, "cancelled", reason)


def purge_groups(
    conn: psycopg.Connection[Any],
    table: str | TableName,
    *,
    cutoff: Any,
    batch_size: int,
    max_batches: int | None,
) -> int:
    """Delete groups closed before ``cutoff`` (a database time), in batches of their own short
    transactions; open groups stay. Nothing before migration 0012. The groups deleted."""
    t = TableName.parse(table)
    if not _ready(conn, t):
        return 0
    total = batches = 0
    while max_batches is None or batches < max_batches:
        with conn.transaction():
            n = conn.execute(q(t, "group_purge"), {"cutoff": cutoff, "limit": batch_size}).rowcount
        total += n
        batches += 1
        if n < batch_size:
            return total
    return total
