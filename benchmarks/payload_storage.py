"""How the payload is stored (DESIGN invariant 27): ``json`` (the text as written) beside ``jsonb``
(parsed, normalized), measured on one server in one run.

``python -m benchmarks.payload_storage [--dsn postgresql://...] [--rows 20000]`` creates a
scratch database on the server of ``--dsn`` (default ``OUTBOX_TEST_DSN``), fills two outbox tables
(one per column type, migrated by the library, the other's column altered) with the same
``--rows`` order-like payloads written by the library's producer, and prints:

* **exactness**: of a set of payloads (the report's cases and kombu's typed values), how many the
  handler gets back as sent (types and key order included) through each column;
* **size on disk**: the table's heap + TOAST bytes per row and the payload column's mean stored
  bytes (``pg_column_size``);
* **producer cost**: microseconds to encode one order-like payload with the library's codec
  (kombu's JSON and the check that it comes back as itself) beside ``json.dumps`` of the same
  payload with its ``Decimal`` and ``datetime`` as strings (what a producer had to do before);
* **admin search**: the median time of a key lookup (``payload->>'customer' = ...``) and of a
  containment search (``@>``, on ``json`` through ``payload::jsonb``) over every row, without an
  index and with a GIN index (``jsonb_path_ops``; on ``json`` an expression index on
  ``(payload::jsonb)``), and each index's size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import sql

from outbox_celery import Event, Store, codec, enqueue_many, migrate
from outbox_celery.claim import executor
from outbox_celery.db.completer import Lease
from outbox_celery.db.store import starter_token
from outbox_celery.testing import temporary_database

EXACT_CASES: list[Any] = [
    {"b": 1, "a": 2},
    1e20,
    {"x": 1.0, "y": -0.0},
    Decimal("1.10"),
    datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
    uuid.UUID(int=9),
    {"total": Decimal("19.990"), "lines": [{"sku": "a", "qty": 2}]},
    "1",
]


def _payload(n: int) -> dict[str, Any]:
    created = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=n)
    return {
        "order_id": n,
        "customer": f"c{n % 1000}",
        "total": Decimal(f"{n % 997}.{n % 100:02d}"),
        "created": created,
        "lines": [{"sku": f"sku-{(n + i) % 50}", "qty": i + 1, "price": Decimal("9.90")} for i in range(3)],
        "note": "ünïcode and a few words of text",
    }


def _same(sent: Any, back: Any) -> bool:
    if type(sent) is not type(back):
        return False
    if isinstance(sent, dict):
        return list(sent) == list(back) and all(_same(sent[k], back[k]) for k in sent)
    if isinstance(sent, list):
        return len(sent) == len(back) and all(_same(a, b) for a, b in zip(sent, back, strict=True))
    return bool(sent == back)


def _median_ms(conn: psycopg.Connection[Any], query: sql.Composed, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        conn.execute(query).fetchall()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _one(conn: psycopg.Connection[Any], query: sql.Composed) -> Any:
    row = conn.execute(query).fetchone()
    assert row is not None
    return row[0]


def measure(dsn: str, rows: int) -> dict[str, dict[str, Any]]:
    """The figures per column type (``json``, ``jsonb``)."""
    results: dict[str, dict[str, Any]] = {}
    with (
        temporary_database(dsn, prefix="outbox_bench_payload") as db,
        psycopg.connect(db, autocommit=True) as conn,
    ):
        for kind in ("json", "jsonb"):
            table = f"outbox_{kind}"
            migrate(conn, table)
            t, to = sql.Identifier(table), sql.SQL(kind)  # kind: one of the two literals above
            conn.execute(
                sql.SQL("ALTER TABLE {} ALTER COLUMN payload TYPE {} USING payload::{}").format(t, to, to)
            )
            with conn.transaction():
                for start in range(0, rows, 1000):
                    batch = [
                        Event("order.created", _payload(n), "order", n) for n in range(start, start + 1000)
                    ]
                    enqueue_many(conn, batch[: rows - start], table=table, notify=False)
                ids = enqueue_many(
                    conn, [Event("x", p, "x", 1) for p in EXACT_CASES], table=table, notify=False
                )
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(t))
            store = Store(table)
            claimed = {
                c.id: c.lease_version
                for c in executor.claim(
                    store, conn, limit=rows + 100, lease=60, owner="b", max_attempts=5
                ).claimed
            }
            exact = 0
            for outbox_id, sent in zip(ids, EXACT_CASES, strict=True):
                lease = [Lease(outbox_id, claimed[outbox_id])]
                started = store.completer.start(
                    conn, lease, lease=60, max_attempts=5, starter=starter_token()
                )
                exact += bool(started) and _same(sent, started[0].payload)
            size = _one(conn, sql.SQL("SELECT pg_table_size({})").format(sql.Literal(table)))
            column = _one(conn, sql.SQL("SELECT avg(pg_column_size(payload))::float8 FROM {}").format(t))
            cast = sql.SQL("payload::jsonb" if kind == "json" else "payload")
            key = sql.SQL("SELECT id FROM {} WHERE payload->>'customer' = 'c42'").format(t)
            contains = sql.SQL("""SELECT id FROM {} WHERE {} @> '{{"customer": "c42"}}'""").format(t, cast)
            key_ms, contains_ms = _median_ms(conn, key), _median_ms(conn, contains)
            gin = sql.Identifier(f"{table}_gin")
            conn.execute(
                sql.SQL("CREATE INDEX {} ON {} USING gin (({}) jsonb_path_ops)").format(gin, t, cast)
            )
            conn.execute(sql.SQL("ANALYZE {}").format(t))
            results[kind] = {
                "exact": f"{exact}/{len(EXACT_CASES)}",
                "table_bytes_per_row": size / (rows + len(EXACT_CASES)),
                "payload_bytes_mean": column,
                "key_lookup_ms": key_ms,
                "contains_ms": contains_ms,
                "contains_gin_ms": _median_ms(conn, contains),
                "gin_bytes": _one(
                    conn, sql.SQL("SELECT pg_relation_size({})").format(sql.Literal(f"{table}_gin"))
                ),
            }
    return results


def encode_cost(n: int = 2000) -> tuple[float, float]:
    """Microseconds per payload: the codec's ``encode``, and ``json.dumps`` of a plain twin."""
    payloads = [_payload(i) for i in range(n)]
    plain = [json.loads(json.dumps(p, default=str)) for p in payloads]
    start = time.perf_counter()
    for p in payloads:
        codec.encode(p)
    ours = (time.perf_counter() - start) / n * 1e6
    start = time.perf_counter()
    for p in plain:
        json.dumps(p, ensure_ascii=False, separators=(",", ":"))
    return ours, (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dsn", default=os.environ.get("OUTBOX_TEST_DSN", "postgresql://postgres@127.0.0.1/postgres")
    )
    parser.add_argument("--rows", type=int, default=20_000)
    args = parser.parse_args()
    with psycopg.connect(args.dsn) as c:
        server = c.info.parameter_status("server_version")
    results = measure(args.dsn, args.rows)
    print(f"payload storage, {args.rows} order-like payloads, PostgreSQL {server}")
    print(f"{'':32} {'json (chosen)':>14} {'jsonb':>14}")
    labels = {
        "exact": "come back as sent",
        "table_bytes_per_row": "table bytes per row",
        "payload_bytes_mean": "payload bytes (mean)",
        "key_lookup_ms": "->> lookup, no index (ms)",
        "contains_ms": "@> search, no index (ms)",
        "contains_gin_ms": "@> search, GIN index (ms)",
        "gin_bytes": "GIN index bytes",
    }
    for key, label in labels.items():
        cells = [results[k][key] for k in ("json", "jsonb")]
        shown = [f"{c:>14.1f}" if isinstance(c, float) else f"{c!s:>14}" for c in cells]
        print(f"{label:32} {shown[0]} {shown[1]}")
    ours, baseline = encode_cost()
    print(f"encode one payload: codec.encode {ours:.1f} us, json.dumps of its plain twin {baseline:.1f} us")


if __name__ == "__main__":
    main()
