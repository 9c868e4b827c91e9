-- The receiving side's inbox: one row per idempotency key whose effect was applied, written in
-- the same transaction as the effect (outbox_celery.inbox).
CREATE TABLE {table} (
    idempotency_key text        PRIMARY KEY CHECK (idempotency_key <> ''),
    event_type      text,
    processed_at    timestamptz NOT NULL DEFAULT now()
);
-- Retention: purge by age.
CREATE INDEX {processed_idx} ON {table} (processed_at);
