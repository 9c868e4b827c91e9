"""The outbox pipeline under test: an :class:`~outbox_celery.app.outbox.Outbox` with a no-op handler.

Configured by the runner through ``BENCH_*`` environment variables (broker, DSN, table, queues,
prefetch, claim interval, batch size; ``BENCH_HANDLER_BATCH`` makes the handler a batch handler
of that size; ``BENCH_LIMIT_CONCURRENCY`` and ``BENCH_LIMIT_RATE`` declare the handler's
flow limits, ``BENCH_HANDLER_SLEEP`` makes it sleep that many seconds).
``BENCH_VARIANT`` selects labelled, benchmark-only variants used to measure a change against
what it replaced in the same run (see :mod:`benchmarks.variants`).
"""

from __future__ import annotations

import os
import time

from outbox_celery import Message
from outbox_celery.app.outbox import Outbox

from . import hooks, variants

app = hooks.celery_app("bench_outbox")

TABLE = os.environ.get("BENCH_TABLE", "outbox")
outbox = Outbox(
    app,
    name="bench",
    dsn=os.environ.get("BENCH_DSN"),
    table=TABLE,
    claim_queue=os.environ.get("BENCH_CLAIM_QUEUE", "bench.claim"),
    default_queue=os.environ.get("BENCH_QUEUE", "bench.deliver"),
    claim_interval=float(os.environ.get("BENCH_CLAIM_INTERVAL", "1.0")),
    batch_size=int(os.environ.get("BENCH_BATCH_SIZE", "200")),
    retention=None,
    listen=os.environ.get("BENCH_LISTEN", "1") == "1",
    store=variants.outbox_store(TABLE, os.environ.get("BENCH_VARIANT", "")),
)


BATCH = int(os.environ.get("BENCH_HANDLER_BATCH", "0"))
if BATCH:

    @outbox.handler("bench.noop", batch=BATCH)
    def noop_batch(messages: list[Message]) -> None:
        """Do nothing with a batch (records each start time in latency runs)."""
        for message in messages:
            hooks.record_start(message.id)

else:
    SLEEP = float(os.environ.get("BENCH_HANDLER_SLEEP", "0"))
    CONCURRENCY = os.environ.get("BENCH_LIMIT_CONCURRENCY")

    @outbox.handler(
        "bench.noop",
        concurrency=int(CONCURRENCY) if CONCURRENCY else None,
        rate=os.environ.get("BENCH_LIMIT_RATE") or None,
        # BENCH_HANDLER_PACK: rows one delivery task may carry (DESIGN invariant 30).
        pack=int(os.environ.get("BENCH_HANDLER_PACK", "1")),
    )
    def noop(message: Message) -> None:
        """Do nothing (records its start time in latency runs), or sleep (flow runs)."""
        started = time.time()
        hooks.record_start(message.id)
        if SLEEP:
            time.sleep(SLEEP)
        hooks.record_span(message.id, started, time.time())


variants.apply(outbox, os.environ.get("BENCH_VARIANT", ""))
hooks.time_publish(outbox)
hooks.install()
