"""Claim cost as history grows: the same claim on a table with little and with much history.

Each table holds ``pending`` due rows plus ``history`` finished rows (99% ``done``, 1% ``dead``),
written with ``INSERT ... SELECT generate_series`` and vacuumed/analyzed like autovacuum would.
Then ``batches`` claims of ``batch_size`` rows are timed one by one: the claim transaction alone
(:meth:`Store.claim`: reap, expired leases, ordered heads, pending rows, commit) and, separately,
a whole claim run with a no-op publish (:meth:`InProcess.claim_and_publish`: advisory lock,
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
from outbox_celery.claim import executor
from outbox_celery.claim.executor import Claimed
from outbox_celery.handlers import HandlerSpec
from outbox_celery.testing import InProcess

from .measure import percentile
from .pipeline import drop_table
from .plain import fill_pending
from .variants import make_store

__all__ = ["ClaimCost", "measure_claim_cost"]


class _Latencies:
    """Percentiles of the timed claims (``batch_ms``, milliseconds) a result holds."""

    batch_ms: list[float]

    @property
    def median_ms(self) -> float:
        """Median claim transaction latency."""
        return statistics.median(self.batch_ms)

    @property
    def p90_ms(self) -> float:
        """90th percentile claim transaction latency."""
        return percentile(sorted(self.batch_ms), 0.9)


@dataclass
class ClaimCost(_Latencies):
    """Claim timings on one table."""

    history: int
    pending: int
    batch_size: int
    fill_seconds: float
    table_mb: float
    batch_ms: list[float] = field(default_factory=list)
    run_ms: list[float] = field(default_factory=list)

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


def _claim(store: Any, conn: psycopg.Connection[Any], limit: int) -> list[Claimed]:
    """One claim of up to ``limit`` rows of the benchmark's event type."""
    result = executor.claim(
        store, conn, limit=limit, lease=600, owner="bench", max_attempts=12, event_types=["bench.noop"]
    )
    return result.claimed


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
            _finish(conn, table, _claim(store, conn, batch_size))
        for _ in range(batches):
            t = time.perf_counter()
            claimed = _claim(store, conn, batch_size)
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
            # One batch per run: the budget is spent after the first batch.
            claim_budget=1e-6,
        )

        class _Same:
            def __enter__(self) -> psycopg.Connection[Any]:
                return conn

            def __exit__(self, *exc: object) -> None:
                return None

        dispatcher = InProcess(
            config, _Same, {"bench.noop": HandlerSpec("bench.noop", _noop_handler, "q")}, store=store
        )

        def publish(claims: Sequence[Claimed]) -> int:
            published.extend(claims)
            return len(claims)

        published: list[Claimed] = []

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


# -- the keys dimension: ordered claims as the number of ordering keys grows ---------------


@dataclass
class KeysCost(_Latencies):
    """Ordered claim timings with ``rows`` unfinished ordered rows over ``keys`` keys."""

    label: str
    keys: int
    rows: int
    in_flight: int
    load_seconds: float
    batch_ms: list[float] = field(default_factory=list)
    claimed: list[int] = field(default_factory=list)
    before_ms: list[float] = field(default_factory=list)
    # The heads statement alone, from EXPLAIN (ANALYZE, BUFFERS) in a rolled-back transaction:
    # (server execution ms, shared buffers touched), now and with the skip-scan claim. Buffers do not depend
    # on the machine's load: flat buffers across cases is O(batch) shown directly.
    heads_plan: tuple[float, int] = (float("nan"), 0)
    before_plan: tuple[float, int] = (float("nan"), 0)

    @property
    def rows_per_claim(self) -> float:
        """Median rows a claim returned (one per key at most: 10 keys give 10 rows)."""
        return statistics.median(self.claimed)

    @property
    def before_median_ms(self) -> float:
        """Median claim latency with the skip-scan claim (a recursive probe of every key)."""
        return statistics.median(self.before_ms) if self.before_ms else float("nan")

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "label": self.label,
            "keys": self.keys,
            "rows": self.rows,
            "in_flight": self.in_flight,
            "load_seconds": round(self.load_seconds, 2),
            "batch_ms_median": round(self.median_ms, 3),
            "batch_ms_p90": round(self.p90_ms, 3),
            "rows_per_claim": self.rows_per_claim,
            "skip_scan_ms_median": round(self.before_median_ms, 3),
            "heads_statement_ms": round(self.heads_plan[0], 3),
            "heads_statement_buffers": self.heads_plan[1],
            "skip_scan_heads_statement_ms": round(self.before_plan[0], 3),
            "skip_scan_heads_statement_buffers": self.before_plan[1],
        }


def _heads_plan(conn: psycopg.Connection[Any], store: Any, limit: int) -> tuple[float, int]:
    """Server execution ms and shared buffers of one heads claim, rolled back."""
    params = {
        "lease": 600,
        "owner": "bench",
        "event_types": ["bench.noop"],
        "excluded": [],
        "limit": limit,
        "heads_since": None,
    }
    with conn.transaction(force_rollback=True):
        conn.execute("SET LOCAL jit = off")
        row = conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + store.queries["claim_heads"], params
        ).fetchone()
    assert row is not None
    [top] = row[0]
    plan = top["Plan"]
    return float(top["Execution Time"]), int(plan.get("Shared Hit Blocks", 0)) + int(
        plan.get("Shared Read Blocks", 0)
    )


def build_history(dsn: str, table: str, *, history: int) -> tuple[float, float]:
    """Create ``table`` with ``history`` finished rows only; return (seconds, MiB)."""
    return build_table(dsn, table, history=history, pending=0)


def load_ordered(conn: psycopg.Connection[Any], table: str, *, keys: int, rows: int, in_flight: int) -> float:
    """Replace the ordered rows of ``table``: ``rows`` unfinished over ``keys`` keys.

    ``in_flight`` keys hold only their head, ``processing`` under a live lease; the other keys
    share the remaining rows, inserted round robin so that their ids interleave as in real use.
    Heads are flagged as migration 0004 does. Returns the seconds spent (vacuum included).
    """
    ident = TableName.parse(table).identifier()
    started = time.perf_counter()
    conn.execute(sql.SQL("DELETE FROM {} WHERE ordering_key IS NOT NULL").format(ident))
    free = keys - in_flight
    per_key = max(1, (rows - in_flight) // free)
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (event_type, aggregate_type, aggregate_id, payload, ordering_key, available_at)"
            " SELECT 'bench.noop', 'bench', g::text, jsonb_build_object('i', g),"
            "        'k' || ((g - 1) %% %(free)s), now() - interval '1 second'"
            " FROM generate_series(1, %(n)s::int) AS g"
        ).format(ident),
        {"free": free, "n": free * per_key},
    )
    if in_flight:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (event_type, aggregate_type, aggregate_id, payload, ordering_key, status,"
                " attempts, lease_owner, lease_until, lease_version, head)"
                " SELECT 'bench.noop', 'bench', g::text, jsonb_build_object('i', g), 'f' || g, 'processing',"
                "        1, 'bench', now() + interval '1 day', 1, true"
                " FROM generate_series(1, %(n)s::int) AS g"
            ).format(ident),
            {"n": in_flight},
        )
    conn.execute(
        sql.SQL(
            "UPDATE {t} AS o SET head = true"
            " FROM (SELECT DISTINCT ON (ordering_key) id FROM {t}"
            "       WHERE ordering_key IS NOT NULL AND status <> 'done' ORDER BY ordering_key, id) AS h"
            " WHERE o.id = h.id AND NOT o.head"
        ).format(t=ident)
    )
    conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(ident))
    return time.perf_counter() - started


def _finish_ordered(conn: psycopg.Connection[Any], table: str, claimed: Sequence[Claimed]) -> None:
    """Untimed: the claimed heads go done and hand their keys on, as the ordered done does."""
    conn.execute(
        sql.SQL(
            "WITH fin AS (UPDATE {t} SET status = 'done', done_at = now(), lease_until = NULL"
            "             WHERE id = ANY(%s) RETURNING id, ordering_key),"
            " nxt AS (SELECT n.id FROM fin, LATERAL (SELECT id FROM {t} WHERE ordering_key = fin.ordering_key"
            "         AND status <> 'done' AND id > fin.id ORDER BY id LIMIT 1) AS n)"
            " UPDATE {t} AS o SET head = true FROM nxt WHERE o.id = nxt.id"
        ).format(t=TableName.parse(table).identifier()),
        [[c.id for c in claimed]],
    )


def measure_keys(
    dsn: str,
    table: str,
    *,
    label: str,
    keys: int,
    rows: int,
    in_flight: int = 0,
    batch_size: int = 200,
    batches: int = 50,
    before_batches: int = 3,
) -> KeysCost:
    """Load ``table`` (built by :func:`build_history`) with one keys case and time claims.

    The current claim (:meth:`Store.claim`) is timed ``batches`` times; the skip-scan claim
    (benchmark variant ``skip_scan``) ``before_batches`` times on the same rows, as its baseline.
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        result = KeysCost(
            label, keys, rows, in_flight, load_ordered(conn, table, keys=keys, rows=rows, in_flight=in_flight)
        )

        def one(store: Any) -> tuple[float, list[Claimed]]:
            t = time.perf_counter()
            claimed = _claim(store, conn, batch_size)
            ms = (time.perf_counter() - t) * 1000
            if not claimed:
                raise RuntimeError(f"{label}: the claim returned nothing")
            _finish_ordered(conn, table, claimed)
            return ms, claimed

        store = make_store(table, "")
        for _ in range(5):  # warm-up: plans cached, pages in shared buffers
            one(store)
        for _ in range(batches):
            ms, claimed = one(store)
            result.batch_ms.append(ms)
            result.claimed.append(len(claimed))
        _heads_plan(conn, store, batch_size // 2)  # warm
        result.heads_plan = _heads_plan(conn, store, batch_size // 2)
        before = make_store(table, "skip_scan")
        if before_batches:
            result.before_plan = _heads_plan(conn, before, batch_size // 2)
            one(before)  # its plan cached too
        for _ in range(before_batches):
            result.before_ms.append(one(before)[0])
    return result


# -- enqueue cost: ordered beside unordered ------------------------------------------------


@dataclass
class EnqueueCost:
    """Per-transaction enqueue timings, microseconds, by kind."""

    statement_us: dict[str, list[float]] = field(default_factory=dict)
    transaction_us: dict[str, list[float]] = field(default_factory=dict)

    def median(self, what: str, kind: str) -> float:
        """Median of ``statement`` (the enqueue call) or ``transaction`` (with its commit)."""
        values = self.statement_us if what == "statement" else self.transaction_us
        return statistics.median(values[kind])

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            kind: {
                "enqueue_us_median": round(self.median("statement", kind), 1),
                "transaction_us_median": round(self.median("transaction", kind), 1),
            }
            for kind in self.statement_us
        }


ENQUEUE_KINDS = (
    "unordered",
    "ordered, new key",
    "ordered, key with a backlog",
    "batch of 100 unordered",
    "batch of 100 ordered",
)


def measure_enqueue(dsn: str, table: str, *, n: int = 500) -> EnqueueCost:
    """Time ``n`` enqueue transactions of each kind, interleaved, on ``table`` as it stands."""
    from outbox_celery import Event, enqueue, enqueue_many

    result = EnqueueCost({k: [] for k in ENQUEUE_KINDS}, {k: [] for k in ENQUEUE_KINDS})
    with psycopg.connect(dsn) as conn:
        one = {
            "event_type": "bench.enqueue",
            "payload": {"order": 1, "total": "9.99"},
            "aggregate_type": "order",
        }

        def run(kind: str, i: int) -> None:
            t0 = time.perf_counter()
            with conn.transaction():
                t1 = time.perf_counter()
                if kind == "unordered":
                    enqueue(conn, aggregate_id=i, table=table, **one)  # type: ignore[arg-type]
                elif kind == "ordered, new key":
                    enqueue(conn, aggregate_id=f"new{i}", ordered=True, table=table, **one)  # type: ignore[arg-type]
                elif kind == "ordered, key with a backlog":
                    enqueue(conn, aggregate_id="busy", ordered=True, table=table, **one)  # type: ignore[arg-type]
                else:
                    ordered = kind.endswith("ordered") and not kind.endswith("unordered")
                    enqueue_many(
                        conn,
                        [
                            Event("bench.enqueue", {"j": j}, "order", f"b{i}-{j}", ordered=ordered)
                            for j in range(100)
                        ],
                        table=table,
                    )
                t2 = time.perf_counter()
            t3 = time.perf_counter()
            result.statement_us[kind].append((t2 - t1) * 1e6)
            result.transaction_us[kind].append((t3 - t0) * 1e6)

        for i in range(20):  # warm-up
            for kind in ENQUEUE_KINDS:
                run(kind, -i - 1)
        for i in range(n):
            for kind in ENQUEUE_KINDS if i % 10 == 0 else ENQUEUE_KINDS[:4]:
                run(kind, i)
    return result
