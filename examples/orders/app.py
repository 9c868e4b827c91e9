"""The Celery app of the orders service and its outbox.

Run the pieces with Celery's own CLI (see the Procfile at the repository root)::

    celery -A examples.orders.app worker -Q outbox.claim --pool solo   # claims
    celery -A examples.orders.app worker -Q orders.webhooks            # deliveries
    celery -A examples.orders.app worker -Q orders.fulfilment,orders.ledger  # deliveries
    celery -A examples.orders.app beat                                 # the safety net
    celery -A examples.orders.app flower --port 5555                   # watch it
"""

from __future__ import annotations

from celery import Celery

from outbox_celery.app.outbox import Outbox

from . import settings

__all__ = ["app", "outbox"]

app = Celery("orders", broker=settings.broker_url())
app.conf.update(
    task_ignore_result=True,
    # Flower's task views need task events from the workers.
    worker_send_task_events=True,
    task_send_sent_event=True,
    beat_schedule_filename=settings.beat_schedule_file(),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
)

outbox = Outbox(
    app,
    dsn=settings.outbox_dsn(required=False),
    table=settings.OUTBOX_TABLE,
    lease=30.0,
    # No claim_interval: push claims at each commit, and beat's claim every 5 s (the default) is
    # only the safety net for what a notification cannot see.
    claim_queue=settings.CLAIM_QUEUE,
    default_queue=settings.WEBHOOKS_QUEUE,
    max_attempts=10,
    backoff_base=0.5,
    backoff_cap=30.0,
)

# The handlers register themselves on ``outbox``: every process that loads the app (workers,
# beat, Flower, the demo) knows every event type and its queue.
from . import handlers  # noqa: E402, F401
