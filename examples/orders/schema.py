"""Tables of the example: the service's ``orders`` and ``receipts``, and the receiver's inbox.

The receiver is "another team's service": its tables live in their own schema, ``receiver``,
and it creates them itself at start-up. Both functions are idempotent and serialize concurrent
callers on an advisory lock, so several processes may start at once.
"""

from __future__ import annotations

from typing import Any

import psycopg

from outbox_celery import migrate
from outbox_celery.inbox import migrate_inbox

from . import settings

__all__ = ["INBOX_TABLE", "ensure_orders_schema", "ensure_receiver_schema"]

ORDERS_DDL = """
CREATE TABLE IF NOT EXISTS orders (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer    text        NOT NULL CHECK (customer <> ''),
    total_cents bigint      NOT NULL CHECK (total_cents >= 0),
    currency    text        NOT NULL DEFAULT 'EUR',
    -- the last state change; every change bumps status_seq and emits order.status_changed
    status      text        NOT NULL DEFAULT 'created',
    status_seq  integer     NOT NULL DEFAULT 1,
    -- who wrote the order ('api', or 'demo-<run>' so the demo can count its own orders)
    source      text        NOT NULL DEFAULT 'api',
    created_at  timestamptz NOT NULL DEFAULT now(),
    paid_at     timestamptz,
    shipped_at  timestamptz
);
CREATE INDEX IF NOT EXISTS orders_source_idx ON orders (source);
-- The receipt of a paid order, written by the order.paid@receipt subscription's transactional
-- handler in the transaction of its done: one per order (the primary key makes a replay a no-op).
CREATE TABLE IF NOT EXISTS receipts (
    order_id    bigint      PRIMARY KEY REFERENCES orders (id),
    total_cents bigint      NOT NULL,
    currency    text        NOT NULL,
    outbox_id   bigint      NOT NULL,
    issued_at   timestamptz NOT NULL DEFAULT now()
);
"""

# The transactional inbox: outbox_celery.inbox, one row per idempotency key written in the same
# transaction as the effect, so a redelivered webhook finds its key and has no second effect.
INBOX_TABLE = "receiver.webhook_inbox"

RECEIVER_DDL = """
CREATE SCHEMA IF NOT EXISTS receiver;
-- The effect: the receiver's view of each order.
CREATE TABLE IF NOT EXISTS receiver.orders (
    order_id     bigint PRIMARY KEY,
    status       text,
    status_seq   integer NOT NULL DEFAULT 0,
    -- status changes that arrived out of sequence (the ordered delivery keeps this at 0)
    out_of_order integer NOT NULL DEFAULT 0,
    events       integer NOT NULL DEFAULT 0,
    paid         boolean NOT NULL DEFAULT false,
    shipped      boolean NOT NULL DEFAULT false,
    updated_at   timestamptz NOT NULL DEFAULT now()
);
-- Every request and what became of it (applied, duplicate, throttled, applied_dropped,
-- rejected): how the demo proves that redeliveries happened and had no second effect.
CREATE TABLE IF NOT EXISTS receiver.requests (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    idempotency_key text        NOT NULL,
    event_type      text        NOT NULL,
    order_id        bigint,
    outcome         text        NOT NULL,
    at              timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS requests_order_idx ON receiver.requests (order_id);
"""


def _locked_ddl(conn: psycopg.Connection[Any], lock: str, ddl: str) -> None:
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [lock])
        conn.execute(ddl)


def ensure_orders_schema(conn: psycopg.Connection[Any]) -> list[int]:
    """Create ``orders`` and migrate the outbox table; return the outbox versions applied now."""
    applied = migrate(conn, settings.OUTBOX_TABLE)
    _locked_ddl(conn, "examples.orders:schema", ORDERS_DDL)
    return applied


def ensure_receiver_schema(conn: psycopg.Connection[Any]) -> None:
    """Create the receiver's effect and request-log tables and migrate its inbox."""
    _locked_ddl(conn, "examples.orders:receiver-schema", RECEIVER_DDL)
    migrate_inbox(conn, INBOX_TABLE)
