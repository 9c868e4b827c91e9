"""Load generators run as their own processes: ``python -m benchmarks.roles publish|produce``.

* ``publish``: the baseline's publisher, ``BENCH_N`` bare no-op tasks over one producer
  connection, as fast as it can.
* ``produce``: the outbox's producer, ``BENCH_N`` events committed with
  :func:`~outbox_celery.enqueue_many` in transactions of ``BENCH_PRODUCER_BATCH``, as fast as it
  can; or, with ``BENCH_RATE`` set, one event per transaction at that steady rate for
  ``BENCH_DURATION`` seconds, noting each commit time in ``BENCH_LATENCY_DIR``.

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


def main(argv: list[str]) -> int:
    """Run the role named in ``argv[0]`` and print its JSON summary."""
    roles = {"publish": _publish, "produce": _produce}
    if len(argv) != 1 or argv[0] not in roles:
        print(f"usage: python -m benchmarks.roles {{{'|'.join(roles)}}}", file=sys.stderr)
        return 2
    print(json.dumps(roles[argv[0]]()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
