"""Configuration of the orders example, read from the environment (twelve-factor style).

Every process of the stack (API, workers, beat, Flower, receiver) reads the same variables, so
the Procfile, ``docker-compose.yml`` and the demo only have to set them once:

``OUTBOX_DSN``
    PostgreSQL DSN of the orders database (``orders`` table and the outbox). Required by every
    process that touches the database.
``CELERY_BROKER_URL``
    The broker, ``redis://`` or ``amqp://``. Default ``redis://127.0.0.1:6379/0``.
``WEBHOOK_URL``
    Where the handlers POST events. Default ``http://127.0.0.1:$RECEIVER_PORT/webhooks``.
``RECEIVER_DSN``
    The receiver's own database (its inbox lives in schema ``receiver``). Default: ``OUTBOX_DSN``.
``API_PORT`` / ``RECEIVER_PORT``
    Listening ports of the API (default 8000) and of the receiver (default 8080).
``CELERY_BEAT_SCHEDULE``
    Beat's state file. Default: a file in the system temporary directory (the schedule only
    holds interval entries, so nothing of value lives in it).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = [
    "API_PORT",
    "CLAIM_QUEUE",
    "DEFAULT_API_PORT",
    "DEFAULT_RECEIVER_PORT",
    "FULFILMENT_QUEUE",
    "LEDGER_QUEUE",
    "OUTBOX_TABLE",
    "RECEIVER_PORT",
    "WEBHOOKS_QUEUE",
    "beat_schedule_file",
    "broker_url",
    "outbox_dsn",
    "receiver_dsn",
    "webhook_url",
]

OUTBOX_TABLE = "outbox"
"""The outbox table of the example (the library's default)."""

CLAIM_QUEUE = "outbox.claim"
"""The claim task's queue: its own worker, so claims never wait behind deliveries."""
WEBHOOKS_QUEUE = "orders.webhooks"
"""``order.created``, ``order.paid@webhook`` and the ordered ``order.status_changed``."""
FULFILMENT_QUEUE = "orders.fulfilment"
"""``order.shipped``: waits (``Defer``) until its order is paid."""
LEDGER_QUEUE = "orders.ledger"
"""``order.paid@receipt``: the receipt written in the orders database (a transactional handler)."""

DEFAULT_API_PORT = 8000
DEFAULT_RECEIVER_PORT = 8080
API_PORT = int(os.environ.get("API_PORT") or DEFAULT_API_PORT)
RECEIVER_PORT = int(os.environ.get("RECEIVER_PORT") or DEFAULT_RECEIVER_PORT)


def outbox_dsn(required: bool = True) -> str | None:
    """``OUTBOX_DSN``; raise a readable error when it is missing and ``required``."""
    dsn = os.environ.get("OUTBOX_DSN") or None
    if dsn is None and required:
        raise SystemExit("OUTBOX_DSN is not set: point it at the orders database (postgresql://...)")
    return dsn


def receiver_dsn() -> str:
    """``RECEIVER_DSN``, defaulting to ``OUTBOX_DSN``."""
    dsn = os.environ.get("RECEIVER_DSN") or outbox_dsn()
    assert dsn is not None
    return dsn


def broker_url() -> str:
    """``CELERY_BROKER_URL`` (default: Redis on localhost)."""
    return os.environ.get("CELERY_BROKER_URL") or "redis://127.0.0.1:6379/0"


def webhook_url() -> str:
    """``WEBHOOK_URL`` (default: the local receiver)."""
    return os.environ.get("WEBHOOK_URL") or f"http://127.0.0.1:{RECEIVER_PORT}/webhooks"


def beat_schedule_file() -> str:
    """``CELERY_BEAT_SCHEDULE`` (default: a file in the temporary directory)."""
    default = Path(tempfile.gettempdir()) / "outbox-orders-celerybeat-schedule"
    return os.environ.get("CELERY_BEAT_SCHEDULE") or str(default)
