"""What the operator modules share: their named statements, typed reads of the rows those
return, and the checks an operator's write makes before it runs.

Rows are read by column name: :func:`one` and :func:`many` build each row with a callable that
takes the statement's columns as keywords (a dataclass, a NamedTuple, or a function that
shapes the value), so a column that moves in the SQL cannot land in the wrong field.
:func:`value` and :func:`values` read statements of one column, and refuse any other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import pq, sql
from psycopg.rows import RowMaker, kwargs_row

from ..db import statements as _sql
from ..errors import AdminError
from ..message import split_route
from ..table import TableName

__all__ = [
    "many",
    "one",
    "outside_transaction",
    "q",
    "ready",
    "regclass",
    "routes",
    "subscription_statement",
    "value",
    "values",
]

T = TypeVar("T")
Params = Mapping[str, Any] | None


@functools.cache
def _queries(table: TableName) -> dict[str, sql.Composed]:
    # The operator's queries, plus the worker's where an operator action must do exactly what
    # a worker does (settle_heads after a skip).
    return {**_sql.queries("queries.sql", table), **_sql.queries("admin.sql", table)}


def q(table: str | TableName, name: str) -> sql.Composed:
    """The named statement ``name`` of ``admin.sql`` (or ``queries.sql``), bound to ``table``."""
    return _queries(TableName.parse(table))[name]


def regclass(conn: psycopg.Connection[Any], table: str | TableName) -> str:
    """The table's quoted name, resolved to its oid in SQL (the notify channel, its sequence)."""
    return TableName.parse(table).identifier().as_string(conn)


def outside_transaction(conn: psycopg.Connection[Any], what: str) -> None:
    """Refuse a connection inside a transaction: ``what`` runs batches of their own."""
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        raise AdminError(
            f"{what} runs each batch in its own short transaction; "
            "pass a connection that is not inside a transaction"
        )


def one(
    conn: psycopg.Connection[Any], query: sql.Composed, params: Params, make: Callable[..., T]
) -> T | None:
    """The first row of ``query`` as ``make(**columns)``, or ``None`` when it returns none."""
    with conn.cursor(row_factory=kwargs_row(make)) as cur:
        return cur.execute(query, params).fetchone()


def many(
    conn: psycopg.Connection[Any], query: sql.Composed, params: Params, make: Callable[..., T]
) -> list[T]:
    """Every row of ``query``, each as ``make(**columns)``."""
    with conn.cursor(row_factory=kwargs_row(make)) as cur:
        return cur.execute(query, params).fetchall()


def _single_column(cursor: Any) -> RowMaker[Any]:
    """A row factory for statements of exactly one column: each row is that column's value."""
    columns = cursor.description
    if columns is not None and len(columns) != 1:
        names = ", ".join(c.name for c in columns)
        raise TypeError(f"expected a statement of one column, it returns {len(columns)} ({names})")

    def make(row: Sequence[Any]) -> Any:
        (only,) = row
        return only

    return make


def value(conn: psycopg.Connection[Any], query: sql.Composed, params: Params = None) -> Any:
    """The one column of the first row of ``query`` (``None`` when it returns no row)."""
    with conn.cursor(row_factory=_single_column) as cur:
        return cur.execute(query, params).fetchone()


def values(conn: psycopg.Connection[Any], query: sql.Composed, params: Params = None) -> list[Any]:
    """The one column of every row of ``query``."""
    with conn.cursor(row_factory=_single_column) as cur:
        return cur.execute(query, params).fetchall()


# -- the routes of a type's subscriptions (DESIGN invariant 28) --------------------------------


@functools.cache
def _subscription_queries(table: TableName) -> dict[str, sql.Composed]:
    return {**_sql.queries("queries.sql", table), **_sql.queries("subscriptions.sql", table)}


def subscription_statement(table: str | TableName, name: str) -> sql.Composed:
    """The named statement ``name`` of the subscriptions' files, bound to ``table``."""
    return _subscription_queries(TableName.parse(table))[name]


def ready(conn: psycopg.Connection[Any], table: str | TableName) -> bool:
    """Whether ``table`` has its subscription table (migration 0011)."""
    t = TableName.parse(table)
    name = t.identifier(_sql.SUBSCRIPTION_SUFFIX).as_string(conn)
    return bool(value(conn, subscription_statement(t, "exists"), {"subscription_table": name}))


def routes(conn: psycopg.Connection[Any], table: str | TableName, event_type: str) -> list[str]:
    """The routes of ``event_type``'s subscriptions, removed ones too, by name: what pausing or
    resuming the type reaches (:func:`outbox_celery.ops.flow.pause`). Empty for a route, for
    a type without subscriptions and for a table not migrated to 0011."""
    if split_route(event_type)[1] is not None or not ready(conn, table):
        return []
    return [str(r) for r in values(conn, subscription_statement(table, "routes"), {"event_type": event_type})]
