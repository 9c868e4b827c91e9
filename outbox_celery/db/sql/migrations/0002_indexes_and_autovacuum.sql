-- Partial indexes keep the hot paths proportional to live work, not to history.
-- Unordered claim: pending rows by due time.
CREATE INDEX {pending_idx} ON {table} (available_at, id)
    WHERE status = 'pending' AND ordering_key IS NULL;
-- Lease reaping and re-claim of expired leases; also the in-flight count.
CREATE INDEX {lease_idx} ON {table} (lease_until)
    WHERE status = 'processing';
-- Ordered claim: the head (lowest unfinished id) of every key, walked as a skip scan.
CREATE INDEX {ordered_idx} ON {table} (ordering_key, id)
    WHERE ordering_key IS NOT NULL AND status <> 'done';
-- Retention purge and throughput estimate.
CREATE INDEX {done_idx} ON {table} (done_at)
    WHERE status = 'done';
-- Dead-letter listing.
CREATE INDEX {dead_idx} ON {table} (id)
    WHERE status = 'dead';
-- A queue table churns: vacuum early so dead tuples do not pile up in the partial indexes.
ALTER TABLE {table} SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 1
);
