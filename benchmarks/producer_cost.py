"""What NOTIFY costs producers: enqueue+commit throughput of concurrent producers.

``producers`` processes each commit one event per transaction for ``seconds`` on one table,
with ``notify`` on or off; a listening session drains the notifications meanwhile (as a worker's
listener would). PostgreSQL takes one database-wide lock from a notifying transaction's
pre-commit until its commit record is written, so notifying commits are serialized: this
measures what that costs against the same producers without NOTIFY.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import psycopg

from outbox_celery import Store, enqueue, migrate

from .pipeline import drop_table

__all__ = ["producer_rate"]


def _produce(dsn: str, table: str, notify: bool, seconds: float, barrier: Any, results: Any) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        barrier.wait(120)  # every process connected and imported before the clock starts
        end = time.time() + seconds
        n = 0
        while time.time() < end:
            with conn.transaction():
                enqueue(
                    conn,
                    event_type="bench.noop",
                    payload={"n": n},
                    aggregate_type="bench",
                    aggregate_id=n,
                    table=table,
                    notify=notify,
                )
            n += 1
        results.put(n)


def _drain(dsn: str, table: str, stop: threading.Event, ready: threading.Event) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        Store(table).listen(conn)
        ready.set()
        while not stop.is_set():
            for _ in conn.notifies(timeout=0.2):
                pass


def producer_rate(dsn: str, *, notify: bool, producers: int = 8, seconds: float = 5.0) -> dict[str, Any]:
    """Commits per second of ``producers`` concurrent processes, one event per transaction."""
    table = f"bench_producers_{'notify' if notify else 'silent'}"
    drop_table(dsn, table)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn, table)
    stop, ready = threading.Event(), threading.Event()
    drain = threading.Thread(target=_drain, args=(dsn, table, stop, ready), daemon=True)
    drain.start()
    ready.wait(10)
    try:
        ctx = multiprocessing.get_context("spawn")
        barrier, results = ctx.Barrier(producers), ctx.Queue()
        procs = [
            ctx.Process(target=_produce, args=(dsn, table, notify, seconds, barrier, results))
            for _ in range(producers)
        ]
        for p in procs:
            p.start()
        counts = [results.get(timeout=180) for _ in procs]
        for p in procs:
            p.join(30)
    finally:
        stop.set()
        drain.join(5)
        drop_table(dsn, table)
    return {"notify": notify, "producers": producers, "seconds": seconds, "rate": sum(counts) / seconds}
