"""What the operator console's pages cost, beside ``stats`` and the metrics scrape.

``python -m benchmarks.console [--dsn DSN] [--done 2000000] [--unfinished 100000] [--runs 15]
[--dead-versions 500000] [--pinned-deliveries 100000] [--interleaved] [--subscriptions 3]
[--payload-bytes 300]``

On a throw-away database of ``--dsn``'s server (default ``OUTBOX_TEST_DSN``): the median time of
each console page (served in process by Starlette's TestClient: the queries, the template and
the HTTP round trip), of :func:`outbox_celery.ops.console.overview` alone, of
:func:`outbox_celery.ops.ops.stats` (bounded, and with ``cap=None`` for exact counts) beside the
stats statement as it was before its reads were bounded (``OLD_STATS``), and of one metrics
scrape (``OutboxCollector.collect``, which runs ``ops.stats``; over a DSN as ``outbox-celery
metrics`` does, a connection per scrape, and over a kept connection) beside what the old scrape
read (the old statement, the horizon and the holds), first at 0 rows, then with ``--done`` done
rows and ``--unfinished`` unfinished ones (half ready, a fifth scheduled or retrying, a tenth
in flight, a fifth dead), each status in one block or, with ``--interleaved``, spread through
the table (with ``--subscriptions N``, every event as N subscription rows reading one payload).
The table is vacuumed and analysed after the load (as autovacuum would have), and the server's
version and autovacuum setting are printed with the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from outbox_celery import ops
from outbox_celery.db.migrations import migrate
from outbox_celery.ops import console
from outbox_celery.testing import temporary_database

#: The stats statement as it was before its reads were bounded (exact counts: every unfinished
#: row read, and all of done_idx counted), run here beside the bounded one as the baseline.
OLD_STATS = """
WITH live AS MATERIALIZED (
    SELECT status, event_type, ordering_key, id, attempts, created_at, available_at, lease_until,
           lease_version - started_version AS unstarted_claims, head
    FROM {table} WHERE status = 'pending' AND ordering_key IS NULL
    UNION ALL
    SELECT status, event_type, ordering_key, id, attempts, created_at, available_at, lease_until,
           lease_version - started_version AS unstarted_claims, head
    FROM {table} WHERE ordering_key IS NOT NULL AND status <> 'done'
    UNION ALL
    SELECT status, event_type, ordering_key, id, attempts, created_at, available_at, lease_until,
           lease_version - started_version AS unstarted_claims, head
    FROM {table} WHERE status = 'processing' AND ordering_key IS NULL
    UNION ALL
    SELECT status, event_type, ordering_key, id, attempts, created_at, available_at, lease_until,
           lease_version - started_version AS unstarted_claims, head
    FROM {table} WHERE status = 'dead' AND ordering_key IS NULL
),
marked AS (
    SELECT live.*,
           (live.status = 'pending' AND live.available_at <= now()
            AND (live.ordering_key IS NULL OR live.head)) AS ready,
           CASE WHEN live.status = 'pending' THEN live.unstarted_claims
                WHEN live.status = 'processing' AND live.lease_until > now()
                THEN live.unstarted_claims - 1
                WHEN live.status = 'processing' THEN live.unstarted_claims
                ELSE 0 END AS lost_claims
    FROM live
),
by_type AS (
    SELECT event_type,
           count(*) FILTER (WHERE status = 'pending') AS pending,
           count(*) FILTER (WHERE ready) AS ready,
           count(*) FILTER (WHERE status = 'processing') AS processing,
           count(*) FILTER (WHERE status = 'dead') AS dead,
           extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending'))::float8
               AS oldest_pending_age,
           count(*) FILTER (WHERE lost_claims > 0) AS unstarted,
           coalesce(max(lost_claims), 0) AS unstarted_claims
    FROM marked
    GROUP BY event_type
),
by_attempts AS (
    SELECT attempts,
           count(*) FILTER (WHERE status = 'pending') AS pending,
           count(*) FILTER (WHERE status = 'processing') AS processing,
           count(*) FILTER (WHERE status = 'dead') AS dead
    FROM live
    GROUP BY attempts
),
blocked AS (
    SELECT d.ordering_key,
           (SELECT count(*) FROM {table} AS w
            WHERE w.ordering_key = d.ordering_key AND w.status <> 'done' AND w.id > d.id) AS waiting
    FROM {table} AS d
    WHERE d.status = 'dead' AND d.head AND d.ordering_key IS NOT NULL
),
headless AS (
    SELECT ordering_key FROM live
    WHERE ordering_key IS NOT NULL
    GROUP BY ordering_key
    HAVING NOT bool_or(head)
)
SELECT
    now() AS now,
    (SELECT count(*) FROM live WHERE status = 'pending') AS pending,
    (SELECT count(*) FROM marked WHERE ready) AS ready,
    (SELECT count(*) FROM live WHERE status = 'pending' AND available_at > now()) AS scheduled,
    (SELECT count(*) FROM live WHERE status = 'processing') AS processing,
    (SELECT count(*) FROM live WHERE status = 'dead') AS dead,
    (SELECT count(*) FROM {table} WHERE status = 'done') AS done,
    (SELECT count(*) FROM live WHERE status = 'processing' AND lease_until <= now()) AS expired_leases,
    (SELECT extract(epoch FROM now() - min(created_at))::float8
     FROM live WHERE status = 'pending') AS oldest_pending_age,
    (SELECT extract(epoch FROM now() - min(available_at))::float8
     FROM marked WHERE ready) AS oldest_ready_wait,
    (SELECT extract(epoch FROM now() - min(created_at))::float8
     FROM live WHERE status = 'processing') AS oldest_processing_age,
    (SELECT count(*) FROM marked WHERE lost_claims > 0) AS unstarted,
    (SELECT count(*) FROM blocked) AS blocked_keys,
    (SELECT coalesce(sum(waiting), 0) FROM blocked) AS blocked_messages,
    (SELECT count(*) FROM headless) AS headless_keys,
    (SELECT coalesce(json_agg(json_build_object(
                'event_type', event_type, 'pending', pending, 'ready', ready,
                'processing', processing, 'dead', dead, 'oldest_pending_age', oldest_pending_age,
                'unstarted', unstarted, 'unstarted_claims', unstarted_claims)
            ORDER BY event_type), '[]'::json)
     FROM by_type) AS event_types,
    (SELECT coalesce(json_agg(json_build_object(
                'attempts', attempts, 'pending', pending, 'processing', processing, 'dead', dead)
            ORDER BY attempts), '[]'::json)
     FROM by_attempts) AS attempts;
"""

GOAL_PAGE_MS = 150.0
GOAL_SCRAPE_MS = 20.0

# The load, one statement: ``--done`` done rows and ``--unfinished`` unfinished ones (half ready,
# a fifth scheduled or retrying, a tenth in flight, a fifth dead), by id in one block per status
# (done, pending, processing, dead), or with %(interleaved)s spread through the table the way
# rows of a table that has lived are (a dead row among the done history rather than in one block
# at the end): a page's reads then touch a heap page per row. With %(fanout)s > 1 every event is
# written as that many subscription rows (DESIGN invariant 28): the first, the owner, keeps the
# payload, the others read it through payload_of. Ids are given (the rows are numbered 1..n), so
# payload_of can name the owner.
LOAD = """
INSERT INTO outbox (id, event_type, aggregate_type, aggregate_id, payload, payload_of, status,
                    created_at, available_at, attempts, lease_until, lease_version,
                    started_version, done_at, last_error)
OVERRIDING SYSTEM VALUE
SELECT g, 'type.' || (e %% 8) || CASE WHEN %(fanout)s > 1 THEN '@s' || r ELSE '' END, 'agg', e::text,
       CASE WHEN r = 0 THEN jsonb_build_object('n', e, 'note', repeat('x', %(payload_bytes)s))::json END,
       CASE WHEN r > 0 THEN g - r END,
       s.status,
       now() - make_interval(secs => (%(n)s - g) * 0.3),
       CASE WHEN s.status = 'pending' AND g %% 5 < 2 THEN now() + interval '1 hour' ELSE now() END,
       CASE WHEN s.status = 'dead' THEN 5 WHEN g %% 5 = 0 THEN 1 ELSE 0 END,
       CASE WHEN s.status = 'processing' THEN now() + interval '1 minute' END,
       1, 1,
       CASE WHEN s.status = 'done' THEN now() - make_interval(secs => (%(n)s - g) * 0.3) END,
       CASE WHEN s.status = 'dead' THEN 'HTTP 503 from partner ' || (g %% 17) END
FROM generate_series(1, %(n)s) AS g,
     LATERAL (SELECT (g - 1) / %(fanout)s + 1 AS e, (g - 1) %% %(fanout)s AS r,
                     -- interleaved: a permutation of 0..n-1 (7919 is prime, so coprime with n
                     -- unless it divides n); else the row's place
                     CASE WHEN %(interleaved)s THEN (g::bigint * 7919) %% %(n)s ELSE g - 1 END AS rank) AS k,
     LATERAL (SELECT CASE WHEN k.rank < %(done)s THEN 'done'
                          WHEN k.rank < %(done)s + %(pending)s THEN 'pending'
                          WHEN k.rank < %(done)s + %(pending)s + %(processing)s THEN 'processing'
                          ELSE 'dead' END AS status) AS s
"""


def _median_ms(fn: Callable[[], Any], runs: int) -> float:
    fn()  # warm: pools, plans, caches
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def _load(
    dsn: str,
    done: int,
    unfinished: int,
    *,
    interleaved: bool = False,
    fanout: int = 1,
    payload_bytes: int = 4,
) -> None:
    parts = {
        "done": done,
        "pending": unfinished // 2 + unfinished // 5,
        "processing": unfinished // 10,
        "dead": unfinished - unfinished // 2 - unfinished // 5 - unfinished // 10,
    }
    n = done + unfinished
    if interleaved and n % 7919 == 0:
        raise SystemExit("--interleaved needs a row count that 7919 does not divide")
    with psycopg.connect(dsn, autocommit=True) as conn:
        params = {
            **parts,
            "n": n,
            "interleaved": interleaved,
            "fanout": fanout,
            "payload_bytes": payload_bytes,
        }
        conn.execute(LOAD, params)  # type: ignore[arg-type]
        conn.execute("SELECT setval(pg_get_serial_sequence('outbox', 'id'), %s)", [max(n, 1)])
        conn.execute("VACUUM ANALYZE outbox")


def _churn(dsn: str, versions: int) -> None:
    """Leave ``versions`` dead row versions in the unfinished rows' indexes: rewrite every
    unfinished row (an indexed column, so no HOT update) until that many old versions exist."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        made = 0
        while made < versions:
            cur = conn.execute(
                "UPDATE outbox SET available_at = available_at + interval '1 microsecond'"
                " WHERE id IN (SELECT id FROM outbox WHERE status <> 'done' ORDER BY id LIMIT %s)",
                [versions - made],
            )
            made += cur.rowcount
            if not cur.rowcount:
                break


def _deliver(dsn: str, deliveries: int) -> None:
    """``deliveries`` messages go through the claim's pattern: new rows come in, the oldest ready
    rows are claimed (pending -> processing) and finish (-> done), 20,000 at a time; under a
    pinned snapshot their old versions stay, at the front of pending_idx and lease_idx."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        made = 0
        while made < deliveries:
            n = min(20_000, deliveries - made)
            conn.execute(
                "INSERT INTO outbox (event_type, aggregate_type, aggregate_id, payload)"
                " SELECT 'type.' || (g %% 8), 'agg', g::text, '{}' FROM generate_series(1, %s) AS g",
                [n],
            )
            conn.execute(
                "UPDATE outbox SET status = 'processing', lease_until = now() + interval '1 minute',"
                " lease_version = lease_version + 1 WHERE id IN (SELECT id FROM outbox"
                " WHERE status = 'pending' AND ordering_key IS NULL AND available_at <= now()"
                " ORDER BY available_at, id LIMIT %s)",
                [n],
            )
            conn.execute(
                "UPDATE outbox SET status = 'done', done_at = now(), lease_until = NULL"
                " WHERE id IN (SELECT id FROM outbox WHERE status = 'processing'"
                " ORDER BY lease_until LIMIT %s)",
                [n],
            )
            made += n


def _measure(dsn: str, runs: int) -> dict[str, float]:
    from starlette.testclient import TestClient

    from outbox_celery.ops.metrics import DEFAULT_METRICS_CAP, OutboxCollector
    from outbox_celery.web import Database, create_app

    out: dict[str, float] = {}
    old_stats = sql.SQL(OLD_STATS).format(table=sql.Identifier("outbox"))  # type: ignore[arg-type]

    def old_scrape(conn: psycopg.Connection[Any]) -> None:
        # What a scrape read before: the old statement, then the horizon and the holds.
        with conn.transaction():
            conn.execute(old_stats).fetchone()
            ops.horizon(conn, "outbox")
            ops.flow_states(conn, "outbox")
            ops.key_states(conn, "outbox")

    with psycopg.connect(dsn, autocommit=True) as conn:
        out["console.overview()"] = _median_ms(lambda: console.overview(conn, "outbox"), runs)
        out["console.minutes()"] = _median_ms(lambda: console.minutes(conn, "outbox"), runs)
        out["stats statement, old (exact)"] = _median_ms(lambda: conn.execute(old_stats).fetchone(), runs)
        out[f"stats (ops.stats, cap {ops.DEFAULT_STATS_CAP:,})"] = _median_ms(
            lambda: ops.stats(conn, "outbox"), runs
        )
        out["stats, cap=None (exact)"] = _median_ms(lambda: ops.stats(conn, "outbox", cap=None), runs)
        out["scrape reads, old statement, kept conn"] = _median_ms(lambda: old_scrape(conn), runs)
        first_dead = conn.execute("SELECT min(id) FROM outbox WHERE status = 'dead'").fetchone()
    collector = OutboxCollector(dsn, "outbox")
    out[f"metrics scrape, cap {DEFAULT_METRICS_CAP:,}, new conn"] = _median_ms(
        lambda: list(collector.collect()), runs
    )
    with psycopg.connect(dsn, autocommit=True) as kept:
        # The same scrape over a kept connection (a pool, as OutboxCollector.from_outbox uses):
        # what the stats statement costs without the connection set-up.
        pooled = OutboxCollector(lambda: contextlib.nullcontext(kept), "outbox")
        out[f"metrics scrape, cap {DEFAULT_METRICS_CAP:,}, kept conn"] = _median_ms(
            lambda: list(pooled.collect()), runs
        )
    dead_id = (first_dead[0] if first_dead else None) or 1
    pages = {
        "page /": "/",
        "page /?partial=1 (live refresh)": "/?partial=1",
        "page dead letters": "/db/main/dead",
        "page dead, error filter": "/db/main/dead?error=partner%2016",
        "page dead, payload filter": "/db/main/dead?payload=%22n%22%3A%2042",
        "page replay-all confirm": "/db/main/dead/confirm?action=requeue&event_type=type.3",
        "page replay-all confirm, payload": "/db/main/dead/confirm?action=requeue&payload=%22n%22%3A%2042",
        "page message": f"/db/main/message/{dead_id}",
        "page flow": "/db/main/flow",
        "page ready messages": "/db/main/messages?state=ready",
        "page in-flight messages": "/db/main/messages?state=in_flight",
    }
    with TestClient(create_app([Database("main", dsn)])) as client:
        for name, url in pages.items():

            def get(url: str = url) -> None:
                r = client.get(url)
                assert r.status_code in (200, 404), (url, r.status_code)

            out[name] = _median_ms(get, runs)
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the table of medians at 0 rows and at the loaded size."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dsn", default=os.environ.get("OUTBOX_TEST_DSN"), help="a server to create a database on"
    )
    p.add_argument("--done", type=int, default=2_000_000)
    p.add_argument("--unfinished", type=int, default=100_000)
    p.add_argument("--runs", type=int, default=15)
    p.add_argument(
        "--dead-versions",
        type=int,
        default=0,
        help="then also measure with this many dead row versions of the unfinished rows, kept by a "
        "snapshot pinned meanwhile (e.g. 500000)",
    )
    p.add_argument(
        "--pinned-deliveries",
        type=int,
        default=0,
        help="then (after a VACUUM) also measure after this many deliveries under a pinned snapshot: "
        "new rows, the oldest ready claimed and done, as workers would (e.g. 100000)",
    )
    p.add_argument(
        "--interleaved",
        action="store_true",
        help="spread each status through the table (a dead row among the done history, as in a table "
        "that has lived) instead of loading each status in one block",
    )
    p.add_argument(
        "--subscriptions",
        type=int,
        default=1,
        metavar="N",
        help="with --interleaved: write every event as N subscription rows, the payload on the first only",
    )
    p.add_argument("--payload-bytes", type=int, default=4, help="the size of each payload's filler text")
    args = p.parse_args(argv)
    if args.subscriptions < 1 or (args.subscriptions > 1 and not args.interleaved):
        p.error("--subscriptions takes N >= 1, and N > 1 needs --interleaved")
    if not args.dsn:
        p.error("give --dsn or set OUTBOX_TEST_DSN")
    with temporary_database(args.dsn, prefix="bench_console") as db:
        with psycopg.connect(db, autocommit=True) as conn:
            migrate(conn, "outbox")
            row = conn.execute(
                "SELECT current_setting('server_version'), current_setting('autovacuum')"
            ).fetchone()
        assert row is not None
        print(f"server: PostgreSQL {row[0]}, autovacuum {row[1]}; median of {args.runs} runs, ms")
        empty = _measure(db, args.runs)
        t0 = time.monotonic()
        _load(
            db,
            args.done,
            args.unfinished,
            interleaved=args.interleaved,
            fanout=args.subscriptions,
            payload_bytes=args.payload_bytes,
        )
        layout = "interleaved" if args.interleaved else "in blocks"
        print(
            f"loaded {args.done:,} done + {args.unfinished:,} unfinished ({layout}, {args.subscriptions} "
            f"row(s) per event, {args.payload_bytes}-byte filler) in {time.monotonic() - t0:.0f} s"
        )
        loaded = _measure(db, args.runs)
        pinned: dict[str, float] = {}
        if args.dead_versions:
            with psycopg.connect(db, autocommit=True) as pin:
                # A snapshot held open: VACUUM and index scans can remove none of the versions.
                pin.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                pin.execute("SELECT count(*) FROM outbox_instance")
                _churn(db, args.dead_versions)
                pinned = _measure(db, args.runs)
                pin.execute("ROLLBACK")
        delivered: dict[str, float] = {}
        if args.pinned_deliveries:
            with psycopg.connect(db, autocommit=True) as pin:
                pin.execute("VACUUM ANALYZE outbox")
                pin.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                pin.execute("SELECT count(*) FROM outbox_instance")
                _deliver(db, args.pinned_deliveries)
                delivered = _measure(db, args.runs)
                pin.execute("ROLLBACK")
    size = f"{args.done // 1000:,}k done + {args.unfinished // 1000:,}k"
    extra = f"+ {args.dead_versions // 1000:,}k dead versions" if pinned else ""
    fourth = f"{args.pinned_deliveries // 1000:,}k deliveries pinned" if delivered else ""
    print(f"{'what':40} {'0 rows':>8} {size:>20} {extra:>24} {fourth:>24}  goal")
    for name in empty:
        if name.startswith(("metrics", "scrape")):
            goal: float | None = GOAL_SCRAPE_MS
        else:
            goal = GOAL_PAGE_MS if name.startswith("page") else None
        worst = max(loaded[name], pinned.get(name, 0.0), delivered.get(name, 0.0))
        verdict = "" if goal is None else f"< {goal:.0f} " + ("ok" if worst < goal else "MISSED")
        third = f"{pinned[name]:.1f}" if pinned else ""
        last = f"{delivered[name]:.1f}" if delivered else ""
        print(f"{name:40} {empty[name]:8.1f} {loaded[name]:20.1f} {third:>24} {last:>24}  {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
