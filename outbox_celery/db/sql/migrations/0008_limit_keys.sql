-- Limits per key within an event type (DESIGN invariant 24): the limit key a producer gives
-- at enqueue (a tenant, a downstream host), counted and claimed per key.
-- A nullable column without a default: added without rewriting the table.
ALTER TABLE {table} ADD COLUMN limit_key text CHECK (limit_key <> '');
-- The claimable rows of each key, in due order: the claim walks the distinct keys of a type on
-- it (one probe per key) and reads each key's next rows from it. Only heads of ordered keys
-- (DESIGN invariant 9). Partial: rows without a limit key (the common case) cost nothing here.
-- Built in the migration's transaction, so writers wait while it scans the table once.
CREATE INDEX {keyed_idx} ON {table} (event_type, limit_key, available_at, id)
    WHERE status = 'pending' AND limit_key IS NOT NULL AND (ordering_key IS NULL OR head);
-- The live deliveries of each key (key_concurrency): one index range per key, from now().
CREATE INDEX {key_lease_idx} ON {table} (event_type, limit_key, lease_until)
    WHERE status = 'processing' AND limit_key IS NOT NULL;
-- Where the next claim of a keyed event type starts walking its keys (round robin).
ALTER TABLE {flow_table} ADD COLUMN key_cursor text;
-- Whether the last claim left the type at its concurrency limit (a freed slot then wakes the
-- claim). A constant default: added without rewriting the (small) table.
ALTER TABLE {flow_table} ADD COLUMN at_cap boolean NOT NULL DEFAULT false;
-- Pause, RateLimited holds and key_rate buckets per limit key: one small row per key that was
-- paused, held or rate limited.
CREATE TABLE {flow_key_table} (
    event_type   text        NOT NULL CHECK (event_type <> ''),
    limit_key    text        NOT NULL CHECK (limit_key <> ''),
    -- Paused by an operator (outbox-celery pause --key): claimed by nobody until resumed.
    paused       boolean     NOT NULL DEFAULT false,
    -- A RateLimited outcome of a message with this key: nothing of the key starts before then.
    paused_until timestamptz,
    -- The key_rate token bucket: starts left, and when it was last refilled (NULL: full).
    tokens       float8,
    refilled_at  timestamptz,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_type, limit_key)
);
-- The keys paused or held, which every claim reads: an index of those rows only, so that the
-- read does not grow with the keys that have a key_rate bucket (a claim that serves a key
-- clears its expired hold).
CREATE INDEX {flow_key_held_idx} ON {flow_key_table} (event_type, limit_key)
    WHERE paused OR paused_until IS NOT NULL;
