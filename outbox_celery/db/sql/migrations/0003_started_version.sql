-- Liveness (DESIGN invariants 10, 16): started_version is the lease_version of the latest claim a
-- worker started (the fenced start sets it). lease_version - started_version counts the claims
-- since then whose task never started: lost in the broker, expired in a queue, or sent to a
-- queue nobody consumes. The claim gives such rows back with a growing delay instead of
-- re-claiming them at once, and stats show them per event type.
ALTER TABLE {table} ADD COLUMN started_version bigint NOT NULL DEFAULT 0;
-- Rows written by earlier releases carry no such history: count every claim as started, except
-- a processing claim with no attempt at all, which certainly never started. Done rows are
-- history and never claimed again: left alone, so the upgrade does not rewrite them.
UPDATE {table}
SET started_version = CASE WHEN status = 'processing' AND attempts = 0 THEN lease_version - 1
                           ELSE lease_version END
WHERE status <> 'done';
