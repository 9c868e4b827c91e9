"""``python -m examples.orders.migrate``: the one-shot schema step of the stack.

Migrates the outbox table (``outbox_celery.migrate``), creates ``orders``, ``receipts`` and the
receiver's tables, and adds the handlers' subscriptions (``order.paid@webhook`` and
``order.paid@receipt``) before any producer starts, so the first order's ``order.paid`` already
goes to both. Idempotent: run it before every start (docker compose runs it as a one-shot
service).
"""

from __future__ import annotations

import sys

import psycopg

from outbox_celery.ops import subscriptions

from . import settings
from .app import outbox
from .schema import ensure_orders_schema, ensure_receiver_schema


def main() -> int:
    """Apply the schema to ``OUTBOX_DSN`` (and ``RECEIVER_DSN``); print what was done."""
    dsn = settings.outbox_dsn()
    assert dsn is not None
    with psycopg.connect(dsn, autocommit=True) as conn:
        applied = ensure_orders_schema(conn)
        # The deploy step adds the subscriptions (workers add them too, but only once started).
        added = subscriptions.register(conn, settings.OUTBOX_TABLE, outbox.handlers)
    with psycopg.connect(settings.receiver_dsn(), autocommit=True) as conn:
        ensure_receiver_schema(conn)
    versions = ", ".join(map(str, applied)) or "none (up to date)"
    routes = ", ".join(added) or "none (present)"
    print(
        f"orders schema ready; outbox migrations applied: {versions}; subscriptions added: {routes}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
