"""Load generators run as their own processes: ``python -m benchmarks.roles publish|produce``.

* ``publish``: the baseline's publisher, ``BENCH_N`` bare no-op tasks over one producer
  connection, as fast as it can.
* ``produce``: the outbox's producer, ``BENCH_N`` events committed with
  :func:`~outbox_celery.enqueue_many` in transactions of ``BENCH_PRODUCER_BATCH``, as fast as it
  can; or, with ``BENCH_RATE`` set, one event per transaction at that steady rate for
  ``BENCH_DURATION`` seconds, noting each commit time in ``BENCH_LATENCY_DIR``.
* ``databases``: the producers of ``python -m benchmarks.databases``: for each database of
  ``BENCH_PRODUCE`` (JSON, name -> ``{"dsn", "rate"}``) one event per transaction at its steady
  rate (a thread per 100 events/s, each with its connection), from ``BENCH_T0`` (``time.time()``)
  until the file ``BENCH_STOP`` appears, noting ``"<id> <time>"`` per commit in
  ``BENCH_LATENCY_DIR/commits-<name>.txt``. A commit that fails (its database refuses
  connections) is counted and the connection opened again at the next due time.

Each prints one JSON line: when it started and finished sending (``time.time()``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _publish() -> dict[str, Any]:
    from .app_bare import app, noop

    n = int(os.environ["BENCH_N"])
    options: dict[str, Any] = {}
    if os.environ.get("BENCH_TASK_OPTIONS"):
        options = json.loads(os.environ["BENCH_TASK_OPTIONS"])
    with app.producer_or_acquire() as producer:
        producer.connection.ensure_connection()
        started, cpu = time.time(), time.process_time()
        for i in range(n):
            if options.get("expires") == "lease":
                # The outbox's exact options: per-task id, expires at a lease end, limits, name.
                opts = {**options, "task_id": f"bench:{i}:v1", "expires": time.time() + 60}
                noop.apply_async((i,), producer=producer, **opts)
            else:
                noop.apply_async((i,), producer=producer, **options)
        finished = time.time()
    return {"started": started, "finished": finished, "sent": n, "cpu": time.process_time() - cpu}


def _produce() -> dict[str, Any]:
    import psycopg

    from outbox_celery import Event, enqueue_many

    table = os.environ["BENCH_TABLE"]
    rate = float(os.environ.get("BENCH_RATE", "0"))
    with psycopg.connect(os.environ["BENCH_DSN"], autocommit=True) as conn:
        if rate > 0:
            return _produce_paced(conn, table, rate, float(os.environ["BENCH_DURATION"]))
        n = int(os.environ["BENCH_N"])
        batch = int(os.environ.get("BENCH_PRODUCER_BATCH", "100"))
        keys = int(os.environ.get("BENCH_ORDERED_KEYS", "0"))  # 0: unordered events
        started, cpu = time.time(), time.process_time()
        sent = 0
        while sent < n:
            size = min(batch, n - sent)
            events = [
                Event(
                    "bench.noop",
                    {"i": sent + j},
                    aggregate_type="bench",
                    aggregate_id=sent + j,
                    ordering_key=f"k{(sent + j) % keys}" if keys else None,
                )
                for j in range(size)
            ]
            with conn.transaction():
                enqueue_many(conn, events, table=table)
            sent += size
        finished = time.time()
        return {"started": started, "finished": finished, "sent": sent, "cpu": time.process_time() - cpu}


def _produce_paced(conn: Any, table: str, rate: float, duration: float) -> dict[str, Any]:
    from outbox_celery import enqueue

    out = Path(os.environ["BENCH_LATENCY_DIR"]) / "commits.txt"
    lines: list[str] = []
    started, cpu = time.time(), time.process_time()
    t0 = time.monotonic()
    n = int(rate * duration)
    late = 0
    notify = os.environ.get("BENCH_NOTIFY", "1") == "1"
    delay = float(os.environ.get("BENCH_DELAY", "0")) or None
    for k in range(n):
        due = t0 + k / rate
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        elif wait < -0.01:
            late += 1
        with conn.transaction():
            outbox_id = enqueue(
                conn,
                event_type="bench.noop",
                payload={"k": k},
                aggregate_type="bench",
                aggregate_id=k,
                table=table,
                notify=notify,
                delay=delay,
            )
        lines.append(f"{outbox_id} {time.time():.6f}\n")
    finished = time.time()
    out.write_text("".join(lines))
    return {
        "started": started,
        "finished": finished,
        "sent": n,
        "late": late,
        "cpu": time.process_time() - cpu,
    }


#: Events per second one producer thread (one connection) is asked for at most.
PER_THREAD = 100.0


def _produce_databases() -> dict[str, Any]:
    import math
    import threading

    plan: dict[str, dict[str, Any]] = json.loads(os.environ["BENCH_PRODUCE"])
    t0 = float(os.environ["BENCH_T0"])
    stop_file = Path(os.environ["BENCH_STOP"])
    out = Path(os.environ["BENCH_LATENCY_DIR"])
    stop = threading.Event()
    results: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()

    def watch() -> None:
        while not stop.wait(0.05):
            if stop_file.exists():
                stop.set()

    def produce(name: str, dsn: str, rate: float, offset: float) -> None:
        import psycopg

        from outbox_celery import enqueue

        lines: list[str] = []
        sent = failed = late = 0
        conn: Any = None
        k = 0
        while not stop.is_set():
            wait = t0 + offset + k / rate - time.time()
            if wait > 0:
                stop.wait(wait)
                if stop.is_set():
                    break
            elif wait < -0.01:
                late += 1
            k += 1
            try:
                if conn is None:
                    conn = psycopg.connect(dsn, autocommit=True, connect_timeout=2)
                with conn.transaction():
                    outbox_id = enqueue(
                        conn,
                        event_type="bench.noop",
                        payload={"k": k},
                        aggregate_type="bench",
                        aggregate_id=k,
                    )
                lines.append(f"{outbox_id} {time.time():.6f}\n")
                sent += 1
            except psycopg.Error:
                failed += 1
                if conn is not None:
                    conn.close()
                conn = None
        if conn is not None:
            conn.close()
        with lock:
            r = results.setdefault(name, {"sent": 0, "failed": 0, "late": 0, "lines": []})
            r["sent"] += sent
            r["failed"] += failed
            r["late"] += late
            r["lines"] += lines

    threads = [threading.Thread(target=watch, daemon=True)]
    for name, spec in plan.items():
        rate = float(spec["rate"])
        n = max(1, math.ceil(rate / PER_THREAD))
        for j in range(n):
            threads.append(
                threading.Thread(target=produce, args=(name, spec["dsn"], rate / n, j / rate), daemon=True)
            )
    started, cpu = time.time(), time.process_time()
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    finished = time.time()
    for name, r in results.items():
        (out / f"commits-{name}.txt").write_text("".join(r.pop("lines")))
    return {"started": started, "finished": finished, "databases": results, "cpu": time.process_time() - cpu}


def main(argv: list[str]) -> int:
    """Run the role named in ``argv[0]`` and print its JSON summary."""
    roles = {"publish": _publish, "produce": _produce, "databases": _produce_databases}
    if len(argv) != 1 or argv[0] not in roles:
        print(f"usage: python -m benchmarks.roles {{{'|'.join(roles)}}}", file=sys.stderr)
        return 2
    print(json.dumps(roles[argv[0]]()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
