-- Named queries of the inbox (outbox_celery.inbox). "{table}" is the quoted inbox table.

-- name: record
-- One row the first time a key is seen. A concurrent transaction recording the same key makes
-- this wait for its outcome: committed, nothing is inserted (no row returned); rolled back, this
-- one inserts. So at most one transaction per key ever applies the effect.
INSERT INTO {table} (idempotency_key, event_type) VALUES (%(key)s, %(event_type)s)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING processed_at;

-- name: purge_batch
-- One short batch of retention; SKIP LOCKED: two purges never wait on each other.
DELETE FROM {table}
WHERE idempotency_key IN (
    SELECT idempotency_key FROM {table}
    WHERE processed_at < now() - make_interval(secs => %(older_than)s)
    ORDER BY processed_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
);
