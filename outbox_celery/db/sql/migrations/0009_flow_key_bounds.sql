-- Flow control's per-key state stays the size of what is held now (DESIGN invariants 24, 25).
-- When a key's key_rate bucket is full again (NULL: no bucket, or one written before this
-- migration): a row not paused, not held and whose bucket is full says nothing an absent row
-- does not, and the retention purge deletes it. A nullable column: no table rewrite.
ALTER TABLE {flow_key_table} ADD COLUMN full_at timestamptz;
-- The RateLimited holds of keys by their end: the claim reads the earliest one (when to claim
-- again) and clears the ones that ran out with one index range each, however many keys are
-- paused or held.
CREATE INDEX {flow_key_until_idx} ON {flow_key_table} (paused_until)
    WHERE paused_until IS NOT NULL;
