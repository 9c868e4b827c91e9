"""Claim cost as history grows: the same claim on a table with little and with much history.

Each table holds ``pending`` due rows plus ``history`` finished rows (99% ``done``, 1% ``dead``),
written with ``INSERT ... SELECT generate_series`` and vacuumed/analyzed like autovacuum would.
Then ``batches`` claims of ``batch_size`` rows are timed one by one: the claim transaction alone
(:meth:`Store.claim`: reap, expired leases, ordered heads, pending rows, commit) and, separately,
a whole claim run with a no-op publish (:meth:`Dispatcher.claim_and_publish`: advisory lock,
in-flight bound, the claim, unlock). The partial indexes should keep both flat.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from outbox_celery import OutboxConfig, TableName, migrate
from outbox_celery.dispatch import Dispatcher, HandlerSpec
from outbox_celery.store import Claimed

from .measure import percentile
from .pipeline import drop_table
from .plain import fill_pending
from .variants import make_store

__all__ = ["ClaimCost", "measure_claim_cost"]


@dataclass
class ClaimCost:
    """Claim timings on one table."""

    history: int
    pending: int
    batch_size: int
    fill_seconds: float
    table_mb: float
    batch_ms: list[float] = field(default_factory=list)
    run_ms: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        """Median claim transaction latency."""
        return statistics.median(self.batch_ms)

    @property
    def p90_ms(self) -> float:
        """90th percentile claim transaction latency."""
        return percentile(sorted(self.batch_ms), 0.9)

    @property
    def rows_per_s(self) -> float:
        """Rows claimed per second of claim transactions."""
        return self.batch_size * len(self.batch_ms) / (sum(self.batch_ms) / 1000)

    @property
    def run_median_ms(self) -> float:
        """Median whole claim run latency (lock, bound, claim, unlock; no publish)."""
        return statistics.median(self.run_ms)

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "history": self.history,
            "pending": self.pending,
            "batch_size": self.batch_size,
            "fill_seconds": round(self.fill_seconds, 2),
            "table_mb": round(self.table_mb, 1),
            "batch_ms_median": round(self.median_ms, 3),
            "batch_ms_p90": round(self.p90_ms, 3),
            "rows_per_s": round(self.rows_per_s),
            "run_ms_median": round(self.run_median_ms, 3),
        }


def _fill_history(conn: psycopg.Connection[Any], table: str, n: int) -> None:
    ident = TableName.parse(table).identifier()
    # Done rows finished over the last week, 1% dead with an error; in chunks to bound the WAL
    # of one statement.
    chunk = 250_000
    for start in range(1, n + 1, chunk):
        stop = min(n, start + chunk - 1)
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (event_type, aggregate_type, aggregate_id, payload, created_at, status,"
                " available_at, attempts, lease_version, last_error, done_at)"
                " SELECT 'bench.noop', 'bench', g::text, jsonb_build_object('i', g),"
                "        now() - make_interval(secs => 604800.0 * (%(n)s - g) / %(n)s),"
                "        CASE WHEN g %% 100 = 0 THEN 'dead' ELSE 'done' END,"
                "        now() - make_interval(secs => 604800.0 * (%(n)s - g) / %(n)s), 1, 1,"
                "        CASE WHEN g %% 100 = 0 THEN 'PermanentError: bench' END,"
                "        CASE WHEN g %% 100 = 0 THEN NULL"
                "             ELSE now() - make_interval(secs => 604800.0 * (%(n)s - g) / %(n)s) END"
                " FROM generate_series(%(start)s::int, %(stop)s::int) AS g"
            ).format(ident),
            {"n": n, "start": start, "stop": stop},
        )


def _noop_handler(message: Any) -> None:
    """Never called: the claim-cost run does not deliver."""


def _finish(conn: psycopg.Connection[Any], table: str, claimed: Sequence[Claimed]) -> None:
    """Mark a claimed batch done in one statement (untimed): in-flight stays small, as in use."""
    conn.execute(
        sql.SQL(
            "UPDATE {} SET status = 'done', done_at = now(), lease_until = NULL WHERE id = ANY(%s)"
        ).format(TableName.parse(table).identifier()),
        [[c.id for c in claimed]],
    )


def build_table(dsn: str, table: str, *, history: int, pending: int) -> tuple[float, float]:
    """Create and fill ``table``; return (seconds spent, total size in MiB)."""
    drop_table(dsn, table)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn, table)
        ident = TableName.parse(table).identifier()
        started = time.perf_counter()
        _fill_history(conn, table, history)
        fill_pending(conn, table, pending)
        conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(ident))
        seconds = time.perf_counter() - started
        size = conn.execute("SELECT pg_total_relation_size(%s::regclass)", [ident.as_string(conn)]).fetchone()
        assert size is not None
    return seconds, size[0] / 2**20


def measure_claim_cost(
    dsn: str,
    *,
    history: int,
    pending: int = 100_000,
    batch_size: int = 200,
    batches: int = 50,
    variant: str = "",
    table: str | None = None,
    built: tuple[float, float] | None = None,
) -> ClaimCost:
    """Time claims on a table with ``history`` finished rows and ``pending`` due rows.

    The table is built unless ``built`` (seconds, MiB) says it exists already; it is dropped
    afterwards only when it was built here. ``variant`` selects a benchmark store variant.
    """
    table = table or f"bench_claim_{history}"
    own = built is None
    fill_seconds, table_mb = built or build_table(dsn, table, history=history, pending=pending)
    with psycopg.connect(dsn, autocommit=True) as conn:
        result = ClaimCost(history, pending, batch_size, fill_seconds, table_mb)
        store = make_store(table, variant)
        # Warm-up: plans cached, prepared statements in place, pages in shared buffers.
        for _ in range(10):
            _finish(
                conn,
                table,
                store.claim(
                    conn,
                    limit=batch_size,
                    lease=600,
                    owner="bench",
                    max_attempts=12,
                    event_types=["bench.noop"],
                ).claimed,
            )
        for _ in range(batches):
            t = time.perf_counter()
            claimed = store.claim(
                conn, limit=batch_size, lease=600, owner="bench", max_attempts=12, event_types=["bench.noop"]
            ).claimed
            result.batch_ms.append((time.perf_counter() - t) * 1000)
            if len(claimed) != batch_size:
                raise RuntimeError(f"claim returned {len(claimed)} rows, expected {batch_size}")
            _finish(conn, table, claimed)
        config = OutboxConfig(
            dsn=dsn,
            table=TableName.parse(table),
            batch_size=batch_size,
            lease=600.0,
            adaptive_in_flight=False,
            max_in_flight=10**7,
        )

        class _Same:
            def __enter__(self) -> psycopg.Connection[Any]:
                return conn

            def __exit__(self, *exc: object) -> None:
                return None

        dispatcher = Dispatcher(
            config, _Same, {"bench.noop": HandlerSpec("bench.noop", _noop_handler, "q")}, store=store
        )

        def publish(claims: Sequence[Claimed]) -> int:
            published.extend(claims)
            return len(claims)

        published: list[Claimed] = []

        # One batch per run: the budget is spent after the first batch.
        dispatcher.config = config.replace(claim_budget=1e-6)
        for _ in range(batches):
            t = time.perf_counter()
            run = dispatcher.claim_and_publish(publish, owner="bench")
            result.run_ms.append((time.perf_counter() - t) * 1000)
            if run.claimed != batch_size:
                raise RuntimeError(f"claim run returned {run.claimed} rows, expected {batch_size}")
            _finish(conn, table, published)
            published.clear()
    if own:
        drop_table(dsn, table)
    return result
