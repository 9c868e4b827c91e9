"""The app ``celery -A support.databases_app worker|beat`` loads: one Outbox over several databases.

Configured by the environment: ``OUTBOX_TEST_DATABASES`` (JSON, name -> DSN), ``OUTBOX_TEST_BROKER``,
``OUTBOX_TEST_RECORD`` (the DSN of the database where each handler run is recorded, in table
``runs``), ``OUTBOX_TEST_TOKEN`` (the queues' suffix) and ``OUTBOX_TEST_SETTINGS`` (JSON, more
Outbox settings).
"""

from __future__ import annotations

import json
import os
import time

import psycopg
from celery import Celery

from outbox_celery import Message, Outbox

TOKEN = os.environ["OUTBOX_TEST_TOKEN"]
RECORD = os.environ["OUTBOX_TEST_RECORD"]
EVENT = "thing.happened"

app = Celery("outbox_databases", broker=os.environ["OUTBOX_TEST_BROKER"], set_as_current=False)
app.conf.update(
    broker_connection_retry_on_startup=True,
    worker_enable_remote_control=False,
    task_default_queue=f"celery.{TOKEN}",
)
outbox = Outbox(
    app,
    databases=json.loads(os.environ["OUTBOX_TEST_DATABASES"]),
    claim_queue=f"outbox.claim.{TOKEN}",
    default_queue=f"outbox.{TOKEN}",
    **{
        "lease": 6.0,
        "claim_interval": 0.3,
        "retention": None,
        **json.loads(os.environ.get("OUTBOX_TEST_SETTINGS", "{}")),
    },
)


@outbox.handler(EVENT)
def handle(message: Message) -> None:
    """Record the run (database, id, attempt, lease version, when) on the record database."""
    with psycopg.connect(RECORD, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO runs (database, outbox_id, attempts, lease_version, aggregate_id, at)"
            " VALUES (%s, %s, %s, %s, %s, clock_timestamp())",
            (message.database, message.id, message.attempts, message.lease_version, message.aggregate_id),
        )
    sleep = message.payload.get("sleep") if isinstance(message.payload, dict) else None
    if sleep:
        time.sleep(float(sleep))
