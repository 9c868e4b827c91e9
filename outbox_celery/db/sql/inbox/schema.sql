-- The inbox's current schema in one piece, for fresh installs (outbox_celery.inbox).
-- tests/integration/test_inbox.py proves that replaying inbox/migrations/ yields exactly this.
CREATE TABLE {table} (
    idempotency_key text        PRIMARY KEY CHECK (idempotency_key <> ''),
    event_type      text,
    processed_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX {processed_idx} ON {table} (processed_at);
