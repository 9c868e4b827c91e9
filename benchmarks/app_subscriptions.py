"""The Celery app of the subscriptions end-to-end benchmark (``benchmarks/subscriptions.py --e2e``).

Three subscriptions of ``order.paid`` (``a``, ``b``, ``c``), each on its own queue; every
handler sleeps ``BENCH_HANDLER_SLEEP`` and appends ``route start enqueued outcome`` to
``BENCH_SEEN`` (one ``O_APPEND`` write); the subscription named in ``BENCH_FAIL`` raises
``RetryableError`` on every run.
"""

from __future__ import annotations

import os
import time

from celery import Celery

from outbox_celery import Message, RetryableError
from outbox_celery.app.outbox import Outbox

app = Celery("bench_subscriptions", broker=os.environ.get("BENCH_BROKER_URL", "memory://"))
app.conf.update(
    task_ignore_result=True, worker_prefetch_multiplier=1, broker_connection_retry_on_startup=True
)
outbox = Outbox(
    app,
    dsn=os.environ.get("BENCH_DSN"),
    table=os.environ.get("BENCH_TABLE", "outbox"),
    claim_queue=os.environ.get("BENCH_CLAIM_QUEUE", "bench.claim"),
    default_queue=os.environ.get("BENCH_QUEUE", "bench.deliver"),
    claim_interval=0.5,
    backoff_base=0.2,
    backoff_cap=2.0,
    max_attempts=12,
    retention=None,
)
SLEEP = float(os.environ.get("BENCH_HANDLER_SLEEP", "0.005"))
FAIL = os.environ.get("BENCH_FAIL", "")
NAMES = ("a", "b", "c")


def _record(message: Message, outcome: str, started: float) -> None:
    line = f"{message.route} {started:.6f} {float(message.payload['t']):.6f} {outcome}\n"
    fd = os.open(os.environ["BENCH_SEEN"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def handle(message: Message) -> None:
    """Sleep, record; the failing subscription raises after that on every run."""
    started = time.time()
    time.sleep(SLEEP)
    if message.subscription == FAIL:
        _record(message, "retry", started)
        raise RetryableError("benchmark: this subscription always fails")
    _record(message, "ok", started)


for _name in NAMES:
    outbox.handler("order.paid", name=_name, queue=f"{outbox.config.default_queue}.{_name}")(handle)
