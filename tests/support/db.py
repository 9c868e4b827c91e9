"""Read what PostgreSQL holds: outbox rows, handler calls, Celery signals."""

from __future__ import annotations

from collections import Counter
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from outbox_celery import TableName


def _t(table: str) -> sql.Identifier:
    return TableName.parse(table).identifier()


def rows(conn: psycopg.Connection[Any], table: str) -> list[dict[str, Any]]:
    """Every outbox row by id, with seconds from the database's now() to its times."""
    query = sql.SQL(
        "SELECT *, extract(epoch FROM available_at - now())::float8 AS available_in,"
        " extract(epoch FROM lease_until - now())::float8 AS lease_in FROM {} ORDER BY id"
    ).format(_t(table))
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query).fetchall()


def row(conn: psycopg.Connection[Any], table: str, outbox_id: int) -> dict[str, Any]:
    """One outbox row (see :func:`rows`)."""
    query = sql.SQL(
        "SELECT *, extract(epoch FROM available_at - now())::float8 AS available_in,"
        " extract(epoch FROM lease_until - now())::float8 AS lease_in FROM {} WHERE id = %s"
    ).format(_t(table))
    with conn.cursor(row_factory=dict_row) as cur:
        found = cur.execute(query, [outbox_id]).fetchone()
    assert found is not None, f"outbox row {outbox_id} is gone"
    return found


def statuses(conn: psycopg.Connection[Any], table: str) -> Counter[str]:
    """Row count per status."""
    query = sql.SQL("SELECT status, count(*) FROM {} GROUP BY status").format(_t(table))
    return Counter({str(s): int(n) for s, n in conn.execute(query).fetchall()})


def count_status(conn: psycopg.Connection[Any], table: str, status: str) -> int:
    """Rows in ``status``."""
    query = sql.SQL("SELECT count(*) FROM {} WHERE status = %s").format(_t(table))
    found = conn.execute(query, [status]).fetchone()
    return int(found[0]) if found else 0


def calls(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    """Every handler run the workers recorded, in the order they started."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute("SELECT * FROM handler_calls ORDER BY n").fetchall()


def signals(conn: psycopg.Connection[Any], name: str | None = None) -> list[dict[str, Any]]:
    """Celery signals the workers recorded (``task_retry``, ``task_failure``)."""
    with conn.cursor(row_factory=dict_row) as cur:
        if name is None:
            return cur.execute("SELECT * FROM celery_signals ORDER BY n").fetchall()
        return cur.execute("SELECT * FROM celery_signals WHERE signal = %s ORDER BY n", [name]).fetchall()
