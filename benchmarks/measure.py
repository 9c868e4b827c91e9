"""Small measuring helpers: CPU of process trees, PostgreSQL counters, percentiles."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import psutil
import psycopg

__all__ = [
    "backend_pids",
    "cpu_seconds",
    "last_json_line",
    "listening_pid",
    "percentile",
    "pg_counters",
    "rss_bytes",
]


def cpu_seconds(procs: Iterable[psutil.Process]) -> float:
    """User + system CPU seconds of ``procs`` (gone processes count as 0)."""
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def rss_bytes(procs: Iterable[psutil.Process]) -> int:
    """Resident set size of ``procs``, summed."""
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def listening_pid(port: int) -> psutil.Process | None:
    """The local process listening on TCP ``port`` (the broker), if it can be seen."""
    with contextlib.suppress(psutil.Error):
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return psutil.Process(c.pid)
    return None


def backend_pids(conn: psycopg.Connection[Any]) -> list[psutil.Process]:
    """PostgreSQL backends of this connection's database, other than this connection's own."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    ).fetchall()
    procs = []
    for (pid,) in rows:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    return procs


def pg_counters(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """This database's cumulative transaction and tuple counters (fresh snapshot), and the WAL position."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted, blks_hit, blks_read"
        " FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()
    assert row is not None
    # The WAL position is the cluster's, not this database's: other databases' writes meanwhile
    # count too (say so beside the figure when the server is shared).
    wal = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
    assert wal is not None
    # Updates PostgreSQL kept on the row's page with no new index entry (HOT), every table's.
    hot = conn.execute("SELECT coalesce(sum(n_tup_hot_upd), 0) FROM pg_stat_user_tables").fetchone()
    assert hot is not None
    keys = (
        "xact_commit",
        "xact_rollback",
        "tup_inserted",
        "tup_updated",
        "tup_deleted",
        "blks_hit",
        "blks_read",
    )
    return {k: int(v) for k, v in zip(keys, row, strict=True)} | {
        "wal_bytes": int(wal[0]),
        "tup_hot_updated": int(hot[0]),
    }


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of already sorted values, nearest rank."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def last_json_line(path: Path) -> dict[str, Any]:
    """The last line of ``path`` that parses as a JSON object."""
    for line in reversed(path.read_text(errors="replace").splitlines()):
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                value = json.loads(line)
                if isinstance(value, dict):
                    return value
    raise ValueError(f"no JSON summary in {path}")


def db_per_message(before: dict[str, int], after: dict[str, int], messages: int) -> dict[str, float]:
    """Per message between two :func:`pg_counters`: commits, row versions written, WAL bytes."""
    per = {k: (after[k] - before[k]) / messages for k in before}
    per["row_versions"] = per["tup_inserted"] + per["tup_updated"] + per["tup_deleted"]
    return per
