"""Flow control: do the limits hold, and what do they cost the claim?

``python -m benchmarks.flow`` (options: ``--help``) prints, in one run on one server:

* **concurrency**: a type limited to ``--concurrency`` (5) whose handler sleeps ``--sleep``
  (50 ms), ``--messages`` (400) of them delivered by ``--workers`` (12) delivery threads: the
  most handler runs at once (from the handlers' own start and finish times, one monotonic
  clock) beside the limit, and the throughput beside ``concurrency / sleep``;
* **rate**: a type limited to ``--rate`` (50/s) for ``--rate-seconds`` (10 s; the issue's figure
  is 60): the most starts in a 1-s window (windows aligned on the first start) beside the rate
  plus one burst (the tolerance, ``max(1, rate x 0.2 s)``), and the total beside ``rate x T``;
* **claim cost**: one claim of 200 rows (``Store.claim`` with scan marks, as the claim loop
  runs it; median of ``--rounds`` interleaved rounds, each claim's rows then marked done,
  untimed) from a draining backlog of 10 event types
  arriving interleaved, with no limit, then with 1 and 10 of the types declared limited but not
  binding (a concurrency and a rate far above what is claimed);
* **key cost** (limits per key, DESIGN invariant 24): the same 200-row claim from a backlog of one
  event type spread over ``--keys`` (1,000) limit keys, with no limit, then with
  ``key_concurrency`` declared but not binding, then binding (1 per key);
* **fairness**: one key with ``--big`` (10,000) queued, then one with ``--small`` (100), claims of
  200 rows, each claim's rows then marked done: the claim run in which the small key's first
  message starts and the one by which all of them have, with ``key_concurrency`` declared (not
  binding: the round robin alone decides) beside the same backlog without it (FIFO).

* **held keys** (DESIGN invariant 25): the same 200-row claim over ``--keys`` limit keys beside
  ``--held`` (50,000) more keys paused or held (half each, a row waiting behind every one),
  alternated with the same claim on a table where none is held, with ``key_concurrency``
  declared and with no limit;
* **cap**: claim runs per second while one key sits at ``key_concurrency=1`` and nothing
  finishes, for ``--cap-seconds`` (5 s), claiming again after each run's ``flow_wait`` as the
  push listener does, beside the same loop with the former 50 ms recheck.

``--only`` runs some parts (``concurrency rate cost keys fairness held cap``; default all).

The delivery side is the plain dispatcher loop (``benchmarks/plain.py``: the library's
InProcess and Store over a psycopg pool, no broker): a claimer thread runs claim runs the way
the push listener does (at once again after a full batch, else after the run's ``flow_wait`` or
``--poll``), and each delivery thread calls ``InProcess.deliver`` for the rows handed to it, as
a Celery pool process would. What is measured is what the claim enforces, in PostgreSQL.
"""

from __future__ import annotations

import argparse
import math
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool

from outbox_celery import OutboxConfig, Store, TableName, migrate
from outbox_celery.claim import executor
from outbox_celery.claim.executor import Claimed, ScanMarks
from outbox_celery.db.completer import Finish, Step
from outbox_celery.flow import Limit, parse_rate
from outbox_celery.handlers import HandlerSpec
from outbox_celery.message import Message
from outbox_celery.testing import InProcess

from .plain import fill_pending
from .services import services

__all__ = ["main"]

LIMITED = "bench.limited"


class Runs:
    """Handler start/finish times (this process's monotonic clock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[float, float]] = []

    def handler(self, sleep: float) -> Any:
        def run(message: Message) -> None:
            started = time.monotonic()
            if sleep:
                time.sleep(sleep)
            with self.lock:
                self.spans.append((started, time.monotonic()))

        return run

    def max_overlap(self) -> int:
        events = sorted([(s, 1) for s, _ in self.spans] + [(e, -1) for _, e in self.spans])
        now = most = 0
        for _, step in events:
            now += step
            most = max(most, now)
        return most


def deliver_all(
    dsn: str, table: str, n: int, limit: Limit, *, workers: int, sleep: float, poll: float
) -> tuple[Runs, float]:
    """Fill ``n`` rows of the limited type and deliver them; return the runs and the seconds."""
    config = OutboxConfig(
        dsn=dsn, table=table, lease=60.0, batch_size=200, max_in_flight=1000, done_batch_delay=0.0
    )
    runs = Runs()
    pool: ConnectionPool[Any] = ConnectionPool(
        dsn, min_size=2, max_size=workers + 4, kwargs={"autocommit": True}, open=True
    )
    handlers = {LIMITED: HandlerSpec(LIMITED, runs.handler(sleep), "", limit=limit)}
    dispatcher = InProcess(config, pool.connection, handlers)
    with pool.connection() as conn:
        fill_pending(conn, table, n, event_type=LIMITED)
    tasks: queue.Queue[Claimed | None] = queue.Queue()
    stop = threading.Event()

    def publish(claims: Sequence[Claimed]) -> int:
        for c in claims:
            tasks.put(c)
        return len(claims)

    # A finish wakes a claimer held back by a limit, as the push listener's slot_freed
    # notification does (this harness does not LISTEN).
    freed = threading.Event()

    def claimer() -> None:
        while not stop.is_set():
            run = dispatcher.claim_and_publish(publish, owner="bench")
            if run.stopped_by == "budget":
                continue
            if run.flow_wait is None:
                stop.wait(poll)
                continue
            freed.clear()
            freed.wait(min(poll, run.flow_wait))

    def worker() -> None:
        while True:
            c = tasks.get()
            if c is None:
                return
            dispatcher.deliver(c.id, c.lease_version)
            freed.set()

    started = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(workers)]
    claim_thread = threading.Thread(target=claimer)
    for t in [*threads, claim_thread]:
        t.start()
    while True:
        with runs.lock:
            finished = len(runs.spans)
        if finished >= n:
            break
        time.sleep(0.05)
    seconds = time.monotonic() - started
    stop.set()
    claim_thread.join()
    for _ in threads:
        tasks.put(None)
    for t in threads:
        t.join()
    pool.close()
    return runs, seconds


def fill_interleaved(
    conn: psycopg.Connection[Any], table: str, n: int, types: Sequence[str], *, keys: int = 0
) -> None:
    """``n`` due pending rows, their event types interleaved, each due a millisecond after the
    previous one (as traffic of several types arrives); with ``keys``, spread over that many
    limit keys (``k0``, ``k1``...), interleaved too."""
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (event_type, aggregate_type, aggregate_id, payload, available_at, limit_key)"
            " SELECT (%s::text[])[1 + g %% cardinality(%s::text[])], 'bench', g::text,"
            " jsonb_build_object('i', g), now() - make_interval(secs => (%s - g) / 1000.0),"
            " CASE WHEN %s > 0 THEN 'k' || (g %% greatest(%s, 1)) END"
            " FROM generate_series(1, %s) AS g"
        ).format(TableName.parse(table).identifier()),
        [list(types), list(types), n, keys, keys, n],
    )


def _done_all(conn: psycopg.Connection[Any], store: Store, claimed: Sequence[Claimed]) -> None:
    """Every claim ``done`` (unordered rows) in one fenced statement."""
    done = [Finish(c.lease, Step.DONE) for c in claimed]
    store.completer.finish(conn, done, max_attempts=0, max_age=0.0)


def _median_claims(
    dsn: str,
    table: str,
    variants: dict[str, dict[str, Limit] | None],
    types: list[str],
    *,
    rounds: int,
    keys: int = 0,
) -> tuple[int, dict[str, float]]:
    """Median ms of one 200-row claim per variant, alternated over a draining backlog of
    ``types`` (spread over ``keys`` limit keys when given); the backlog size and the medians."""
    store = Store(table)
    # Each variant claims as its own process would: with its own scan marks (the claim loop's).
    marks = {k: ScanMarks() for k in variants}
    timings: dict[str, list[float]] = {k: [] for k in variants}
    backlog = (rounds + 2) * len(variants) * 200
    with psycopg.connect(dsn, autocommit=True) as conn:
        fill_interleaved(conn, table, backlog, types, keys=keys)
        conn.execute("ANALYZE")
        for r in range(rounds + 1):
            for name, limits in variants.items():
                began = time.perf_counter()
                result = executor.claim(
                    store,
                    conn,
                    limit=200,
                    lease=60.0,
                    owner="bench",
                    max_attempts=5,
                    event_types=types,
                    limits=limits,
                    marks=marks[name],
                )
                elapsed = time.perf_counter() - began
                assert len(result.claimed) == 200, (name, len(result.claimed))
                # Delivered (untimed): live leases stay what the in-flight bound allows, as in a
                # running outbox, rather than piling up across rounds.
                _done_all(conn, store, result.claimed)
                if r > 0:  # the first round warms caches and creates the flow rows
                    timings[name].append(elapsed * 1000)
    return backlog, {name: statistics.median(ms) for name, ms in timings.items()}


def key_cost(dsn: str, table: str, *, rounds: int, keys: int) -> tuple[int, dict[str, float]]:
    """Median ms of one 200-row claim of one event type whose rows spread over ``keys`` limit
    keys: no limit, ``key_concurrency`` not binding, ``key_concurrency=1`` (binding)."""
    kind = "bench.keyed"
    variants: dict[str, dict[str, Limit] | None] = {
        "no limits": None,
        f"key_concurrency, {keys:,} keys (not binding)": {kind: Limit(key_concurrency=1_000_000)},
        f"key_concurrency=1, {keys:,} keys (binding)": {kind: Limit(key_concurrency=1)},
    }
    return _median_claims(dsn, table, variants, [kind], rounds=rounds, keys=keys)


def fairness(dsn: str, table: str, *, big: int, small: int, keyed: bool) -> tuple[int | None, int | None]:
    """Claim runs of 200 rows over a big key's backlog queued before a small key's, each run's
    rows marked done: the run in which the small key's first message starts and the one by which
    all of them have (1-based; ``None``: never, within the backlog)."""
    kind = "bench.fair"
    t = TableName.parse(table).identifier()
    limits = {kind: Limit(key_concurrency=1_000_000)} if keyed else None
    store = Store(table)
    marks = ScanMarks()
    first = every = None
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {}").format(t))
        for key, n, age in (("big", big, 60.0), ("small", small, 30.0)):
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (event_type, aggregate_type, aggregate_id, payload, available_at,"
                    " limit_key) SELECT %s, 'bench', g::text, '{{}}', now() - make_interval(secs => %s),"
                    " %s FROM generate_series(1, %s) AS g"
                ).format(t),
                [kind, age, key, n],
            )
        conn.execute(sql.SQL("ANALYZE {}").format(t))
        seen = 0
        runs = 0
        while every is None:
            result = executor.claim(
                store, conn, limit=200, lease=60.0, owner="bench", max_attempts=5, limits=limits, marks=marks
            )
            if not result.claimed:
                break
            runs += 1
            ids = [c.id for c in result.claimed]
            row = conn.execute(
                sql.SQL("SELECT count(*) FROM {} WHERE id = ANY(%s) AND limit_key = 'small'").format(t), [ids]
            ).fetchone()
            seen += int(row[0]) if row else 0
            if seen and first is None:
                first = runs
            if seen >= small:
                every = runs
            _done_all(conn, store, result.claimed)
    return first, every


def claim_cost(dsn: str, table: str, *, rounds: int) -> tuple[int, dict[str, float]]:
    """Median ms of one 200-row claim, with 0, 1 and 10 limited types declared, not binding.

    The backlog drains: every variant claims its 200 rows in turn from the front, as a claim
    loop does; returns the backlog size and the medians.
    """
    types = [f"bench.t{i}" for i in range(10)]
    roomy = Limit(concurrency=1_000_000, rate=1_000_000)
    variants: dict[str, dict[str, Limit] | None] = {
        "no limits": None,
        "1 limited type (not binding)": {types[0]: roomy},
        "10 limited types (not binding)": {t: roomy for t in types},
    }
    return _median_claims(dsn, table, variants, types, rounds=rounds)


def held_cost(dsn: str, *, rounds: int, keys: int, held: int) -> dict[str, tuple[float, float]]:
    """Median ms of one 200-row claim of one event type over ``keys`` limit keys, from three
    tables with the same draining backlog, claims alternated: one with no key paused or held, one
    with ``held`` keys more (half paused, half held by a RateLimited outcome for an hour), each
    with a row waiting, and one with those keys held but no row of theirs waiting. With
    ``key_concurrency`` declared (not binding), and with no limit at all (the held keys then make
    the claim go key by key). Per variant: the median ms and rows claimed."""
    kind = "bench.held"
    tables = {
        "none held": "held_none",
        f"{held:,} held": "held_many",
        f"{held:,} held, no row waiting": "held_idle",
    }
    variants: dict[str, dict[str, Limit] | None] = {
        "key_concurrency (not binding)": {kind: Limit(key_concurrency=1_000_000)},
        "no limit": None,
    }
    store = Store("held_none")
    timings: dict[str, list[float]] = {f"{v}, {h}": [] for v in variants for h in tables}
    taken: dict[str, list[int]] = {name: [] for name in timings}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for t in tables.values():
            migrate(conn, t)
            fill_interleaved(conn, t, (rounds + 2) * len(variants) * 200, [kind], keys=keys)
        many = TableName.parse(tables[f"{held:,} held"])
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (event_type, aggregate_type, aggregate_id, payload, limit_key)"
                " SELECT %s, 'bench', g::text, '{{}}', 'h' || g FROM generate_series(1, %s) AS g"
            ).format(many.identifier()),
            [kind, held],
        )
        for name in (f"{held:,} held", f"{held:,} held, no row waiting"):
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (event_type, limit_key, paused, paused_until)"
                    " SELECT %s, 'h' || g, g %% 2 = 0,"
                    " CASE WHEN g %% 2 = 1 THEN now() + interval '1 hour' END"
                    " FROM generate_series(1, %s) AS g"
                ).format(TableName.parse(tables[name]).identifier("_flow_key")),
                [kind, held],
            )
        conn.execute("ANALYZE")
        stores = {h: Store(t) for h, t in tables.items()}
        marks = {name: ScanMarks() for name in timings}
        for r in range(rounds + 1):
            for v, limits in variants.items():
                for h in tables:
                    store = stores[h]
                    began = time.perf_counter()
                    result = executor.claim(
                        store,
                        conn,
                        limit=200,
                        lease=60.0,
                        owner="bench",
                        max_attempts=5,
                        event_types=[kind],
                        limits=limits,
                        marks=marks[f"{v}, {h}"],
                    )
                    elapsed = time.perf_counter() - began
                    _done_all(conn, store, result.claimed)
                    if r > 0:
                        timings[f"{v}, {h}"].append(elapsed * 1000)
                        taken[f"{v}, {h}"].append(len(result.claimed))
    return {name: (statistics.median(ms), statistics.median(taken[name])) for name, ms in timings.items()}


def claim_runs_at_cap(dsn: str, table: str, *, seconds: float, recheck: float | None) -> float:
    """Claim runs per second while one limit key sits at its ``key_concurrency`` and nothing
    finishes, run as the push listener runs them (again after the run's ``flow_wait``, at most
    ``listen_poll``, 1 s, apart); ``recheck`` replaces a held run's wait (the former 50 ms)."""
    kind = "bench.capped"
    limits = {kind: Limit(key_concurrency=1)}
    store = Store(table)
    marks = ScanMarks()
    runs = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {}").format(TableName.parse(table).identifier()))
        fill_interleaved(conn, table, 100, [kind], keys=1)
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            result = executor.claim(
                store, conn, limit=200, lease=600.0, owner="bench", max_attempts=5, limits=limits, marks=marks
            )
            runs += 1
            wait = 1.0 if result.flow_wait is None else min(1.0, result.flow_wait)
            if recheck is not None and result.flow_wait is not None:
                wait = recheck
            time.sleep(max(0.0, min(wait, ends - time.monotonic())))
    return runs / seconds


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.flow", description=__doc__.splitlines()[0])
    p.add_argument("--dsn", help="a PostgreSQL server's maintenance database (default: local, else embedded)")
    p.add_argument("--concurrency", type=int, default=5)
    p.add_argument("--sleep", type=float, default=0.05, help="handler seconds (concurrency part)")
    p.add_argument("--messages", type=int, default=400)
    p.add_argument("--workers", type=int, default=12, help="delivery threads")
    p.add_argument("--rate", default="50/s")
    p.add_argument("--rate-seconds", type=float, default=10.0)
    p.add_argument("--poll", type=float, default=1.0, help="longest wait between claim runs (listen_poll)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--keys", type=int, default=1000, help="limit keys (key cost part)")
    p.add_argument("--big", type=int, default=10_000, help="the big key's backlog (fairness part)")
    p.add_argument("--small", type=int, default=100, help="the small key's backlog (fairness part)")
    p.add_argument("--held", type=int, default=50_000, help="limit keys paused or held (held part)")
    p.add_argument("--cap-seconds", type=float, default=5.0, help="seconds at a key's limit (cap part)")
    parts = ("concurrency", "rate", "cost", "keys", "fairness", "held", "cap")
    p.add_argument("--only", nargs="+", choices=parts, default=list(parts), help="parts to run")
    a = p.parse_args(argv)
    with (
        tempfile.TemporaryDirectory() as tmp,
        services(Path(tmp), dsn=a.dsn, redis_url=None, amqp_url=None, want_amqp=False) as svc,
    ):
        print(f"postgresql: {svc.describe()['postgresql']}")
        with psycopg.connect(svc.dsn, autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()
            for t in ("conc", "rate", "cost", "keys", "fair", "cap"):
                migrate(conn, t)
        print(f"server version: {version[0] if version else '?'}")

        if "concurrency" in a.only:
            concurrency_part(svc.dsn, a)
        if "rate" in a.only:
            rate_part(svc.dsn, a)
        if "cost" in a.only:
            backlog, cost = claim_cost(svc.dsn, "cost", rounds=a.rounds)
            print(
                f"\nclaim cost: one claim of 200 rows from a draining backlog of {backlog:,} pending "
                f"rows of 10 interleaved event types, median of {a.rounds} rounds"
            )
            show(cost)
        if "keys" in a.only:
            backlog, cost = key_cost(svc.dsn, "keys", rounds=a.rounds, keys=a.keys)
            print(
                f"\nkey cost: one claim of 200 rows from a draining backlog of {backlog:,} pending rows "
                f"of one event type over {a.keys:,} limit keys, median of {a.rounds} rounds"
            )
            show(cost)
        if "fairness" in a.only:
            print(
                f"\nfairness: key 'big' with {a.big:,} queued, then key 'small' with {a.small:,}; "
                "claims of 200 rows, each claim's rows then done"
            )
            for keyed in (False, True):
                first, every = fairness(svc.dsn, "fair", big=a.big, small=a.small, keyed=keyed)
                label = "key_concurrency declared (round robin)" if keyed else "no key limit (FIFO)"
                print(f"  {label:<40} small key's first start in claim run {first}, all by run {every}")
        if "held" in a.only:
            print(
                f"\nheld keys: one claim of 200 rows of one event type over {a.keys:,} limit keys, "
                f"beside {a.held:,} more keys paused or held (each with a row waiting), median of "
                f"{a.rounds} rounds, alternated with the same claim where none is held"
            )
            for name, (ms, rows) in held_cost(svc.dsn, rounds=a.rounds, keys=a.keys, held=a.held).items():
                print(f"  {name:<52} {ms:7.2f} ms  {rows:5.0f} rows")
        if "cap" in a.only:
            print(
                "\nclaim runs per second while one key sits at key_concurrency=1, nothing finishing "
                f"({a.cap_seconds:g} s)"
            )
            for label, recheck in (
                ("this release (a finish wakes the claim)", None),
                ("a 50 ms recheck", 0.05),
            ):
                per_second = claim_runs_at_cap(svc.dsn, "cap", seconds=a.cap_seconds, recheck=recheck)
                print(f"  {label:<52} {per_second:7.1f} runs/s")
    return 0


def show(cost: dict[str, float]) -> None:
    base = cost["no limits"]
    for name, ms in cost.items():
        print(f"  {name:<44} {ms:7.2f} ms  ({(ms / base - 1) * 100:+.0f}%)")


def concurrency_part(dsn: str, a: argparse.Namespace) -> None:
    runs, seconds = deliver_all(
        dsn,
        "conc",
        a.messages,
        Limit(concurrency=a.concurrency),
        workers=a.workers,
        sleep=a.sleep,
        poll=a.poll,
    )
    ideal = a.concurrency / a.sleep if a.sleep else math.inf
    print(
        f"\nconcurrency: limit {a.concurrency}, {a.messages} messages, handler {a.sleep * 1000:.0f} ms, "
        f"{a.workers} delivery threads"
    )
    print(f"  max handlers running at once: {runs.max_overlap()} (limit {a.concurrency})")
    print(f"  throughput: {a.messages / seconds:.1f}/s (limit / handler time = {ideal:.1f}/s)")


def rate_part(dsn: str, a: argparse.Namespace) -> None:
    per_second = parse_rate(a.rate)
    n = int(per_second * a.rate_seconds)
    runs, _seconds = deliver_all(
        dsn, "rate", n, Limit(rate=per_second), workers=a.workers, sleep=0.0, poll=a.poll
    )
    starts = sorted(s for s, _ in runs.spans)
    first = starts[0]
    windows: dict[int, int] = {}
    for s in starts:
        windows[int(s - first)] = windows.get(int(s - first), 0) + 1
    burst = Limit(rate=per_second).burst
    span = starts[-1] - first
    print(f"\nrate: limit {a.rate} ({per_second:g}/s), {n} messages")
    print(
        f"  most starts in a 1-s window: {max(windows.values())} "
        f"(rate {per_second:g} + one burst {burst:g} = {per_second + burst:g})"
    )
    print(
        f"  {n} starts over {span:.2f} s: {n / span if span else math.inf:.1f}/s "
        f"(expected {(n - burst) / per_second:.2f} s at the rate after one burst)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
