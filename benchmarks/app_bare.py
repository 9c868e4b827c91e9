"""The baseline: a bare Celery app with one no-op task, configured like the outbox's deliveries.

Same broker, pool, concurrency and prefetch as the outbox run (set by the runner through
``BENCH_*`` environment variables); ``acks_late`` like the outbox's delivery task; no result.
"""

from __future__ import annotations

import os

from celery import Celery

from . import hooks

app = Celery("bench_bare", broker=os.environ.get("BENCH_BROKER_URL", "memory://"))
app.conf.update(
    task_default_queue=os.environ.get("BENCH_QUEUE", "bench"),
    worker_prefetch_multiplier=int(os.environ.get("BENCH_PREFETCH", "1")),
    task_ignore_result=True,
    worker_send_task_events=False,
    broker_connection_retry_on_startup=True,
)


@app.task(name="bench.noop", ignore_result=True, acks_late=True)
def noop(i: int) -> None:
    """Do nothing (the baseline's handler)."""


hooks.install()
