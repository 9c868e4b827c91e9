-- Producer dedup keys and the producer's trace context.
-- Nullable columns without a default: added without rewriting the table.
-- dedup_key: a second enqueue with a key already in the table inserts nothing (see
-- docs/integrations.md); keys are free again once retention has purged their row.
ALTER TABLE {table} ADD COLUMN dedup_key text CHECK (dedup_key <> '');
-- trace_context: the W3C trace context (traceparent/tracestate) current at enqueue.
ALTER TABLE {table} ADD COLUMN trace_context jsonb;
-- Partial: rows without a key (the common case) cost nothing here. Built in the migration's
-- transaction, so writers wait while it scans the table once.
CREATE UNIQUE INDEX {dedup_idx} ON {table} (dedup_key) WHERE dedup_key IS NOT NULL;
