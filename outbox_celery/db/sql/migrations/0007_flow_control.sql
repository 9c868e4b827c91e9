-- Flow control per event type (DESIGN invariants 22 and 23): one small row per event type
-- that was paused, held by a RateLimited outcome or has a rate limit, beside the outbox table
-- and named after it. The claim reads (and locks) only the rows of the types it limits and those
-- paused or held: never the backlog. No change to the outbox table itself.
CREATE TABLE {flow_table} (
    event_type   text        PRIMARY KEY CHECK (event_type <> ''),
    -- Paused by an operator (outbox-celery pause): claimed by nobody until resumed.
    paused       boolean     NOT NULL DEFAULT false,
    -- A RateLimited outcome (HTTP 429): nothing of the type starts before this time.
    paused_until timestamptz,
    -- The rate limit's token bucket: starts left, and when it was last refilled (NULL: full).
    tokens       float8,
    refilled_at  timestamptz,
    updated_at   timestamptz NOT NULL DEFAULT now()
);
