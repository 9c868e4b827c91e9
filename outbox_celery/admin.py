"""Operator-side queries: stats, dead letters, retention. (Being written; see issue 4.)"""

from __future__ import annotations

from typing import Any

import psycopg

from .config import TableName


def purge_done(
    conn: psycopg.Connection[Any], table: str | TableName, *, older_than: float, batch_size: int
) -> int:
    """Delete ``done`` rows older than ``older_than`` seconds in batches; return rows deleted."""
    raise NotImplementedError
