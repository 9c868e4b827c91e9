-- Ordered claims whose cost does not grow with the number of keys (DESIGN invariant 17).
-- "head" marks the claimable head of an ordering key: its lowest id that is not done. It is set
-- at enqueue under the producer's key lock and moved to the next message of the key, under the
-- same lock, when the head goes done (worker's done, operator's skip). The claim then reads the
-- pending heads in due order from one small partial index instead of probing every key.
-- Adding a column with a constant default rewrites nothing; only the current heads are updated.
-- The whole file runs in the migrator's transaction, under ALTER TABLE's exclusive lock, so no
-- producer or finalizer can move a head while the flags are computed.
ALTER TABLE {table} ADD COLUMN head boolean NOT NULL DEFAULT false;
UPDATE {table} AS o
SET head = true
FROM (
    SELECT DISTINCT ON (ordering_key) id
    FROM {table}
    WHERE ordering_key IS NOT NULL AND status <> 'done'
    ORDER BY ordering_key, id
) AS heads
WHERE o.id = heads.id;
CREATE INDEX {heads_idx} ON {table} (available_at, id)
    WHERE status = 'pending' AND head;
