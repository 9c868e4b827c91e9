"""What subscriptions cost the producer (DESIGN invariant 28): ``python -m benchmarks.subscriptions``.

One event per transaction (its row built as enqueue builds it, the store's insert, commit; a
300-byte payload) with the insert of the release before subscriptions (the baseline: one
event, one handler), then the current insert where the type has no subscription, 1, 3 and 10
subscriptions. The variants
are interleaved round by round on one connection, so the machine's load touches them alike; per
variant the median and p90 transaction time, and the table's bytes and WAL written per event.
The payload is stored once whatever the number of subscriptions: the table's growth per event
shows it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

from outbox_celery import Event, Store, migrate
from outbox_celery.ops import subscriptions
from outbox_celery.produce.enqueue import DEFAULT_MAX_PAYLOAD_BYTES, _row
from outbox_celery.produce.writes import ProducerWrites

from .pipeline import drop_table
from .procs import Processes, celery_command
from .report import Report

__all__ = ["VARIANTS", "producer_cost"]

#: Subscriptions of the event type per variant (-1: the insert before subscriptions, the
#: baseline; 0: the current insert, a type without subscriptions).
VARIANTS = (-1, 0, 1, 3, 10)
LINES = [{"sku": f"SKU-{i:04d}", "qty": i, "price": "19.90"} for i in range(6)]
PAYLOAD = {"order_id": 1234567, "lines": LINES}
# The insert of the release before subscriptions, with the two columns the producer now reads
# (NULL: every row is an event's own row).
BEFORE = """
INSERT INTO {table} (event_type, aggregate_type, aggregate_id, payload, ordering_key, available_at,
                     head, dedup_key, trace_context, limit_key)
VALUES (%(event_type)s, %(aggregate_type)s, %(aggregate_id)s, %(payload)s::json, %(ordering_key)s,
        now() + make_interval(secs => %(delay)s),
        %(ordering_key)s::text IS NOT NULL AND NOT EXISTS (
            SELECT 1 FROM {table}
            WHERE ordering_key = %(ordering_key)s::text AND status <> 'done'),
        %(dedup_key)s, %(trace_context)s::jsonb, %(limit_key)s)
ON CONFLICT (dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING
RETURNING id, dedup_key, {wake_listeners} AS woke, NULL::text AS ordering_key, NULL::bigint AS payload_of
"""


def _table(n: int) -> str:
    return f"bench_subs_{n}" if n >= 0 else "bench_subs_before"


def _stores() -> dict[int, ProducerWrites]:
    return {
        n: ProducerWrites(Store(_table(n), queries={"insert": BEFORE} if n < 0 else None)) for n in VARIANTS
    }


def _setup(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for n in VARIANTS:
            drop_table(dsn, _table(n))
            migrate(conn, _table(n))
            for i in range(n):
                subscriptions.add(conn, _table(n), "order.paid", f"sub{i:02d}")


def _one(conn: psycopg.Connection[Any], store: ProducerWrites, i: int) -> float:
    start = time.perf_counter()
    with conn.transaction():
        # What enqueue does (validation, kombu's JSON, the insert), on the variant's statement.
        store.insert(conn, _row(Event("order.paid", PAYLOAD, "order", i), DEFAULT_MAX_PAYLOAD_BYTES))
    return time.perf_counter() - start


def _size(conn: psycopg.Connection[Any], table: str) -> int:
    row = conn.execute("SELECT pg_total_relation_size(%s)", [table]).fetchone()
    return int(row[0]) if row else 0


def _wal(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
    return int(row[0]) if row else 0


def producer_cost(dsn: str, *, events: int = 3000, rounds: int = 10) -> dict[int, dict[str, float]]:
    """Per variant (number of subscriptions): median and p90 ms per transaction, table bytes and
    WAL bytes per event."""
    _setup(dsn)
    stores = _stores()
    times: dict[int, list[float]] = {n: [] for n in VARIANTS}
    wal: dict[int, int] = dict.fromkeys(VARIANTS, 0)
    per_round = max(1, events // rounds)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for n in VARIANTS:  # warm up: plans cached, first pages allocated
            for i in range(50):
                _one(conn, stores[n], i)
        base = {n: _size(conn, _table(n)) for n in VARIANTS}
        for r in range(rounds):
            # Each round in another order: no variant always runs first (or after a checkpoint).
            for n in VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]:
                before = _wal(conn)
                times[n] += [_one(conn, stores[n], r * per_round + i) for i in range(per_round)]
                wal[n] += _wal(conn) - before
        grown = {n: _size(conn, _table(n)) - base[n] for n in VARIANTS}
    out = {}
    for n in VARIANTS:
        ms = sorted(t * 1000 for t in times[n])
        out[n] = {
            "median_ms": statistics.median(ms),
            "p90_ms": ms[int(len(ms) * 0.9)],
            "table_bytes_per_event": grown[n] / len(ms),
            "wal_bytes_per_event": wal[n] / len(ms),
        }
    for n in VARIANTS:
        drop_table(dsn, _table(n))
    return out


def report(result: dict[int, dict[str, float]], rep: Report, *, server: str) -> None:
    """The figures as a table, each beside the baseline (one handler without a name)."""
    base = result[-1]
    t = rep.table(
        f"Producer transaction (enqueue + commit of one event) by subscriptions of its type, {server}",
        ["insert", "median ms", "vs before", "p90 ms", "table B/event", "WAL B/event"],
    )
    for n, r in result.items():
        t.row(
            {-1: "before subscriptions (one handler)", 0: "no subscription"}.get(n, f"{n} subscriptions"),
            f"{r['median_ms']:.3f}",
            f"{r['median_ms'] / base['median_ms']:.2f}x",
            f"{r['p90_ms']:.3f}",
            f"{r['table_bytes_per_event']:.0f}",
            f"{r['wal_bytes_per_event']:.0f}",
        )
    t.note("goal: 10 subscriptions cost at most 2x one event with one handler before; the payload is")
    t.note(f"written once (table B/event). Interleaved rounds, {len(VARIANTS)} variants, one connection.")
    rep.flush()


def e2e_rounds(
    dsn: str, broker_url: str, workdir: Path, *, rate: float, seconds: float, rounds: int
) -> dict[str, dict[str, dict[str, float]]]:
    """:func:`end_to_end` with none failing and with c failing, alternated ``rounds`` times;
    the medians per subscription, keyed by the failing subscription ("" for none)."""
    runs: dict[str, list[dict[str, dict[str, float]]]] = {"": [], "c": []}
    for _ in range(rounds):  # alternated: the machine's load touches both alike
        for fail, done in runs.items():
            done.append(end_to_end(dsn, broker_url, workdir, fail=fail, rate=rate, seconds=seconds))
    return {fail: _medians(r) for fail, r in runs.items()}


def _medians(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {name: {k: statistics.median(r[name][k] for r in runs) for k in runs[0][name]} for name in runs[0]}


def report_e2e(
    runs: dict[str, dict[str, dict[str, float]]], rep: Report, *, rate: float, seconds: float, server: str
) -> None:
    """Subscriptions a and b with c failing every delivery, beside the run where none fails."""
    base, failing = runs[""], runs["c"]
    t = rep.table(
        f"End to end, 3 subscriptions, {rate:g} events/s for {seconds:g} s, {server}",
        ["subscription", "delivered/s", "baseline", "p50 ms", "baseline", "p99 ms", "baseline"],
    )
    for name in ("a", "b"):
        r, b = failing[name], base[name]
        t.row(
            name,
            f"{r['per_second']:.1f}",
            f"{b['per_second']:.1f}",
            f"{r['p50_ms']:.0f}",
            f"{b['p50_ms']:.0f}",
            f"{r['p99_ms']:.0f}",
            f"{b['p99_ms']:.0f}",
        )
    t.note("c fails every delivery (RetryableError, backoff 0.2-2 s, 12 attempts); baseline: none fails.")
    t.note("one worker, prefork 4, consuming the claim queue and the three subscriptions' queues; push on")
    rep.flush()


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.subscriptions --dsn DSN``."""
    import sys

    p = argparse.ArgumentParser(prog="python -m benchmarks.subscriptions", description=__doc__)
    p.add_argument("--dsn", required=True, help="a database to create the benchmark tables in")
    p.add_argument("--events", type=int, default=3000, help="events per variant (3000)")
    p.add_argument("--server", default="the given server", help="how to name the server in the title")
    p.add_argument(
        "--e2e", metavar="BROKER_URL", help="also end to end on this broker: 3 subscriptions, one failing"
    )
    p.add_argument("--rate", type=float, default=15.0, help="end to end: events per second (15)")
    p.add_argument("--seconds", type=float, default=15.0, help="end to end: seconds of production (15)")
    p.add_argument("--rounds", type=int, default=2, help="end to end: alternated rounds (2)")
    a = p.parse_args(argv)
    rep = Report(sys.stdout)
    if a.events:
        report(producer_cost(a.dsn, events=a.events), rep, server=a.server)
    if a.e2e:
        with tempfile.TemporaryDirectory(prefix="bench-subs-") as tmp:
            runs = e2e_rounds(a.dsn, a.e2e, Path(tmp), rate=a.rate, seconds=a.seconds, rounds=a.rounds)
        report_e2e(
            runs, rep, rate=a.rate, seconds=a.seconds, server=f"{a.server}, medians of {a.rounds} rounds"
        )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


NAMES = ("a", "b", "c")


def end_to_end(
    dsn: str, broker_url: str, workdir: Path, *, fail: str, rate: float = 30.0, seconds: float = 20.0
) -> dict[str, dict[str, float]]:
    """One run: a worker (prefork 4, every queue; push on) and beat, events committed at
    ``rate`` per second for ``seconds``; per subscription its deliveries per second over the
    run and its commit -> handler start latency (p50, p99, ms) of successful runs."""
    table = f"bench_subs_e2e_{fail or 'none'}"
    drop_table(dsn, table)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn, table)
        subscriptions.register(conn, table, [f"order.paid@{n}" for n in NAMES])
    seen = workdir / f"{table}.seen"
    seen.unlink(missing_ok=True)
    n = int(rate * seconds)
    with Processes(workdir) as procs:
        _start(
            procs,
            workdir,
            table,
            {"BENCH_BROKER_URL": broker_url, "BENCH_DSN": dsn, "BENCH_SEEN": str(seen), "BENCH_FAIL": fail},
        )
        time.sleep(8.0)  # workers up, pools forked
        start = _produce(dsn, table, n, rate)
        deadline = time.time() + 30.0
        while time.time() < deadline:
            ok = [line for line in _lines(seen) if line[3] == "ok"]
            if sum(1 for line in ok if line[0] != f"order.paid@{fail}") >= n * (2 if fail else 3):
                break
            time.sleep(0.5)
    drop_table(dsn, table)
    return {name: _figures(seen, name, start) for name in NAMES}


def _start(procs: Processes, workdir: Path, table: str, env: dict[str, str]) -> None:
    """The worker (the claim queue and the three subscriptions' queues) and beat."""
    token = uuid.uuid4().hex[:6]
    env = {
        **env,
        "BENCH_TABLE": table,
        "BENCH_QUEUE": f"bench.subs.{token}",
        "BENCH_CLAIM_QUEUE": f"bench.subs.claim.{token}",
    }
    queues = ",".join([env["BENCH_CLAIM_QUEUE"]] + [f"{env['BENCH_QUEUE']}.{n}" for n in NAMES])
    app = "benchmarks.app_subscriptions"
    worker = ("worker", "-Q", queues, "-P", "prefork", "-c", "4", "-l", "WARNING", "-n", f"subs{token}@%h")
    procs.start(f"worker-{table}", celery_command(app, *worker), env)
    procs.start(
        f"beat-{table}",
        celery_command(app, "beat", "-l", "WARNING", "-s", str(workdir / f"beat-{token}")),
        env,
    )


def _produce(dsn: str, table: str, n: int, rate: float) -> float:
    """Commit ``n`` events at ``rate`` per second, one per transaction; return the start time."""
    start = time.time()
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(n):
            if (wait := start + i / rate - time.time()) > 0:
                time.sleep(wait)
            with conn.transaction():
                store_insert(conn, table, {"t": time.time(), "i": i}, i)
    return start


def _figures(seen: Path, name: str, start: float) -> dict[str, float]:
    """Successful runs of subscription ``name``: their rate since ``start`` and latencies."""
    runs = [line for line in _lines(seen) if line[0] == f"order.paid@{name}" and line[3] == "ok"]
    lat = [(float(r[1]) - float(r[2])) * 1000 for r in runs]
    span = (max(float(r[1]) for r in runs) - start) if runs else float("nan")
    return {
        "delivered": len(runs),
        "per_second": len(runs) / span if runs else 0.0,
        "p50_ms": _percentile(lat, 0.5),
        "p99_ms": _percentile(lat, 0.99),
    }


def _lines(path: Path) -> list[list[str]]:
    try:
        return [line.split() for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def store_insert(conn: psycopg.Connection[Any], table: str, payload: dict[str, Any], i: int) -> None:
    """One ``order.paid`` event in ``conn``'s open transaction, as enqueue writes it."""
    ProducerWrites(Store(table)).insert(
        conn, _row(Event("order.paid", payload, "order", i), DEFAULT_MAX_PAYLOAD_BYTES)
    )


if __name__ == "__main__":
    main()
