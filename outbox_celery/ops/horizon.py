"""What keeps VACUUM from cleaning the outbox's dead row versions: the xmin horizon's holder
(a long transaction, a prepared transaction, a replication slot) and how long it has held it
(DESIGN invariant 18)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ..table import TableName
from ._queries import q, regclass
from .durations import format_duration

__all__ = ["Horizon", "horizon"]


@dataclass(frozen=True, slots=True)
class Horizon:
    """What holds back the database's xmin horizon, and the outbox table's dead row versions.

    While a transaction, prepared transaction, replication slot or standby holds the horizon,
    VACUUM removes no dead row version anywhere in the database; the claim keeps its cost
    bounded regardless (DESIGN invariant 18), but the table grows until it is released.

    :ivar kind: ``transaction``, ``prepared transaction``, ``replication slot`` or
        ``standby feedback``; ``None`` when nothing visible holds a snapshot.
    :ivar name: its pid, gid or slot name.
    :ivar application: the session's ``application_name`` (a slot's plugin, a prepared
        transaction's owner).
    :ivar state: the session's state (``idle in transaction``, ``active``...).
    :ivar seconds: how long its transaction has been open (``None`` for slots and standbys).
    :ivar xid_age: how many transaction ids old the snapshot it holds is.
    :ivar dead_row_versions: the outbox table's dead row versions (PostgreSQL's statistics).
    :ivar live_row_versions: its live row versions.
    :ivar last_vacuum_age: seconds since its last vacuum or autovacuum (``None``: never).
    """

    kind: str | None
    name: str | None
    application: str | None
    state: str | None
    seconds: float | None
    xid_age: int | None
    dead_row_versions: int
    live_row_versions: int
    last_vacuum_age: float | None

    def holder(self) -> str:
        """The oldest holder in a phrase (``"none"`` when nothing holds it)."""
        if self.kind is None:
            return "none"
        what = f"{self.kind} {self.name}"
        if self.application:
            what += f" ({self.application})"
        if self.state:
            what += f", {self.state}"
        if self.seconds is not None:
            what += f", open {format_duration(self.seconds)}"
        return what

    def held_for_long(self, threshold: float) -> bool:
        """Whether something has held the horizon long enough for a human to look: a snapshot
        open ``threshold`` seconds or more, or a replication slot nobody consumes (it holds the
        horizon until it is dropped)."""
        if self.kind is None:
            return False
        if self.seconds is not None:
            return self.seconds >= threshold
        return self.state == "inactive"


def horizon(conn: psycopg.Connection[Any], table: str | TableName = "outbox") -> Horizon:
    """What holds the xmin horizon back, and ``table``'s dead row versions (see :class:`Horizon`)."""
    t = TableName.parse(table)
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(q(t, "horizon"), {"table": regclass(conn, t)}).fetchone()
    assert row is not None
    return Horizon(
        kind=row["kind"],
        name=row["name"],
        application=row["application"],
        state=row["state"],
        seconds=row["seconds"],
        xid_age=None if row["xid_age"] is None else int(row["xid_age"]),
        dead_row_versions=int(row["dead_row_versions"] or 0),
        live_row_versions=int(row["live_row_versions"] or 0),
        last_vacuum_age=row["last_vacuum_age"],
    )
