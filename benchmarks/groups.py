"""Groups with a callback (DESIGN invariant 29): what a member costs beside the same message
without a group.

``python -m benchmarks.groups [--dsn DSN] [--messages N] [--size S] [--rounds R]``

One process, one autocommit connection (a worker's), no Celery: ``--messages`` events written in
transactions of ``--size`` (``enqueue_many``, or ``enqueue_group`` with a callback: one group per
transaction), then claimed, started and finalized one row at a time as a worker's one-message
handler does (:meth:`Store.start`, :meth:`Store.done`), the groups' callbacks delivered the same
way. Per member: wall time, this process's CPU and, when the server runs on this host, its
backend's CPU (``/proc``), the two variants alternated for ``--rounds`` rounds, medians printed
side by side. Then the finalize of a group's last member beside any other member's (the one that
enqueues the callback).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from .finalize import _backend_cpu

LEASE, MAX_ATTEMPTS = 300.0, 5


def _write(conn: Any, n: int, size: int, grouped: bool) -> None:
    from outbox_celery import Event, enqueue_group, enqueue_many

    for k in range(0, n, size):
        events = [Event("bench.part", {"i": i}, "bench", i) for i in range(k, min(n, k + size))]
        with conn.transaction():
            if grouped:
                enqueue_group(
                    conn, events, then=Event("bench.done", {"k": k}, "bench", k), table="bench_groups"
                )
            else:
                enqueue_many(conn, events, table="bench_groups")


def _claim(conn: Any, store: Any, limit: int) -> list[Any]:
    """One claim of up to ``limit`` due rows."""
    from outbox_celery.claim import executor

    return executor.claim(store, conn, limit=limit, lease=LEASE, owner="bench", max_attempts=50).claimed


def _done(conn: Any, store: Any, c: Any, grouped: bool | None = None) -> bool:
    """The fenced done of claim ``c`` (an unordered row's), as the worker writes it."""
    from outbox_celery.db.completer import Finish, Step

    done = Finish(c.lease, Step.DONE, ordered=False, grouped=grouped)
    return store.completer.finish(conn, [done], max_attempts=0, max_age=0.0).of(c.id).applied


def _deliver_all(conn: Any, store: Any, last: list[float] | None = None) -> int:
    """Claim, start and finish every due row one at a time; the rows delivered."""
    from outbox_celery.db.store import starter_token

    n = 0
    while True:
        got = _claim(conn, store, 1000)
        if not got:
            return n
        for c in got:
            [msg] = store.completer.start(
                conn, [c.lease], lease=LEASE, max_attempts=MAX_ATTEMPTS, starter=starter_token()
            )
            t0 = time.perf_counter()
            # As the worker does: it knows a member from its start, and a row of no group takes
            # the plain finish.
            assert _done(conn, store, c, grouped=msg.group_id is not None)
            if last is not None:
                last.append(time.perf_counter() - t0)
        n += len(got)


def _started_group(conn: Any, store: Any, g: int, size: int) -> list[Any]:
    """Write group ``g`` of ``size`` members in its own transaction, claim and start them all;
    the members' claims (the callback is not due until they are final)."""
    from outbox_celery import Event, enqueue_group

    with conn.transaction():
        events = [Event("bench.part", {"i": i}, "bench", i) for i in range(size)]
        enqueue_group(conn, events, then=Event("bench.done", {"g": g}, "bench", g), table="bench_groups")
    got = _claim(conn, store, size)
    store.completer.start(conn, [c.lease for c in got], lease=LEASE, max_attempts=5, starter="s")
    return list(got)


def run(dsn: str, messages: int, size: int, grouped: bool) -> dict[str, float]:
    """One variant in a fresh database: microseconds per member (the callbacks' delivery
    included in the grouped variant's figures: they are what a group costs)."""
    import psycopg

    from outbox_celery import migrate
    from outbox_celery.db.store import Store
    from outbox_celery.testing import temporary_database

    with temporary_database(dsn, prefix="outbox_bench") as db, psycopg.connect(db, autocommit=True) as conn:
        migrate(conn, "bench_groups")
        store = Store("bench_groups")
        _write(conn, 60, size, grouped)  # warm up: psycopg prepares statements after five runs
        _deliver_all(conn, store)
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        backend = int(row[0]) if row else 0
        started, cpu, server = time.perf_counter(), time.process_time(), _backend_cpu(backend)
        _write(conn, messages, size, grouped)
        _deliver_all(conn, store)
        out = {
            "us per member": (time.perf_counter() - started) / messages * 1e6,
            "client cpu us": (time.process_time() - cpu) / messages * 1e6,
        }
        after = _backend_cpu(backend)
        if server is not None and after is not None:
            out["server cpu us"] = (after - server) / messages * 1e6
    return out


def last_member(dsn: str, groups: int, size: int) -> tuple[float, float]:
    """Median ms of a member's done and of a last member's done (which enqueues the callback)."""
    import psycopg

    from outbox_celery import migrate
    from outbox_celery.db.store import Store
    from outbox_celery.testing import temporary_database

    with temporary_database(dsn, prefix="outbox_bench") as db, psycopg.connect(db, autocommit=True) as conn:
        migrate(conn, "bench_groups")
        store = Store("bench_groups")
        others: list[float] = []
        lasts: list[float] = []
        for g in range(groups):
            got = _started_group(conn, store, g, size)
            for k, c in enumerate(got):
                t0 = time.perf_counter()
                assert _done(conn, store, c)
                (lasts if k == len(got) - 1 else others).append(time.perf_counter() - t0)
            _deliver_all(conn, store)  # the callback
    return statistics.median(others) * 1e3, statistics.median(lasts) * 1e3


def wake_to_claim(dsn: str, groups: int, size: int) -> list[float]:
    """Milliseconds from the start of each group's last member's done (autocommit: its commit)
    to a listening session's claim returning the callback: the notification the callback's
    insert sends at commit, then one claim. Not the handler's start (no broker, no Celery)."""
    import psycopg

    from outbox_celery import migrate
    from outbox_celery.db.store import Store
    from outbox_celery.testing import temporary_database

    out: list[float] = []
    with (
        temporary_database(dsn, prefix="outbox_bench") as db,
        psycopg.connect(db, autocommit=True) as conn,
        psycopg.connect(db, autocommit=True) as listener,
    ):
        migrate(conn, "bench_groups")
        store, claimer = Store("bench_groups"), Store("bench_groups")
        claimer.listen(listener)
        for g in range(groups):
            got = _started_group(conn, store, g, size)
            for c in got[:-1]:
                assert _done(conn, store, c)
            for _ in listener.notifies(timeout=0.0):
                pass  # the members' wakes
            last = got[-1]
            t0 = time.perf_counter()
            assert _done(conn, store, last)
            for _ in listener.notifies(timeout=5.0, stop_after=1):
                pass
            claimed = _claim(listener, claimer, 10)
            out.append((time.perf_counter() - t0) * 1e3)
            assert [c.event_type for c in claimed] == ["bench.done"]
            _done(conn, store, claimed[0])
    return out


def measure(dsn: str, messages: int, size: int, rounds: int) -> dict[str, Any]:
    """Both variants alternated ``rounds`` times; medians per figure, and the last member's
    finalize beside the others'."""
    samples: dict[str, dict[str, list[float]]] = {"without group": {}, "grouped": {}}
    for r in range(rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        for grouped in order:
            name = "grouped" if grouped else "without group"
            for figure, value in run(dsn, messages, size, grouped).items():
                samples[name].setdefault(figure, []).append(value)
    medians = {name: {f: statistics.median(v) for f, v in figs.items()} for name, figs in samples.items()}
    other_ms, last_ms = last_member(dsn, 50, size)
    waits = sorted(wake_to_claim(dsn, 200, 10))
    return {
        "medians": medians,
        "member_done_ms": other_ms,
        "last_member_done_ms": last_ms,
        "wake_to_claim_ms": {"p50": waits[len(waits) // 2], "p99": waits[int(len(waits) * 0.99) - 1]},
    }


def print_result(result: dict[str, Any], messages: int, size: int, rounds: int, server: str) -> None:
    m = result["medians"]
    print(
        f"{messages} messages in transactions of {size} (a group each, with its callback, or plain), "
        f"written, claimed, started and done one row at a time; median of {rounds} alternated rounds; "
        f"PostgreSQL {server}"
    )
    print(f"{'figure':<16} {'without group':>14} {'grouped':>10} {'ratio':>6}")
    for figure in m["grouped"]:
        base, new = m["without group"][figure], m["grouped"][figure]
        print(f"{figure:<16} {base:>14.1f} {new:>10.1f} {new / base:>6.2f}")
    print(
        f"finalize of a member (median ms): {result['member_done_ms']:.3f}; of a group's last member, "
        f"which enqueues the callback: {result['last_member_done_ms']:.3f}"
    )
    w = result["wake_to_claim_ms"]
    print(
        "last member's done -> a listening claim returns the callback (200 groups of 10, no Celery):"
        f" p50 {w['p50']:.2f} ms, p99 {w['p99']:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--dsn", default=os.environ.get("OUTBOX_BENCH_DSN", "postgresql://postgres@127.0.0.1/postgres")
    )
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--size", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import psycopg

    with psycopg.connect(args.dsn) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    result = measure(args.dsn, args.messages, args.size, args.rounds)
    print_result(result, args.messages, args.size, args.rounds, str(row[0]) if row else "?")


if __name__ == "__main__":
    main()
