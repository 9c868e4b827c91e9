-- Subscriptions (DESIGN invariant 28): one event, several named handlers, each with its own
-- delivery rows. The fact is written once: the first subscription's row (the owner) keeps the
-- payload, every other subscription's row stores none and points at the owner (payload_of).
-- Existing rows keep their payload and get no reference: nothing is rewritten. The CHECK and
-- the partial index read the table once (no rewrite); producers and workers wait meanwhile.
--
-- From this release on a row's event_type holding '@' is a subscription's route
-- ('<type>@<name>'), delivered to that subscription's handler. An unfinished row (pending,
-- processing, or dead and so requeueable) of an event type that already held '@' would be read
-- as one: the migration refuses, naming how many and one of them, until they are finished or
-- renamed. Done rows are never delivered again. The scan reads the table once.
DO $migration$
DECLARE
    held bigint;
    example text;
BEGIN
    SELECT count(*), min(o.event_type) INTO held, example
    FROM {table} AS o
    WHERE o.status <> 'done' AND strpos(o.event_type, '@') > 0;
    IF held > 0 THEN
        RAISE EXCEPTION 'outbox-celery migration 0011: % unfinished row(s) have an event type containing @ (for example %), which this release reads as a subscription''s route <event_type>@<name>; deliver, skip or delete them with the previous release (or rename their event type without @), then migrate', held, quote_literal(example);
    END IF;
END
$migration$;
ALTER TABLE {table} ALTER COLUMN payload DROP NOT NULL;
ALTER TABLE {table} ADD COLUMN payload_of bigint;
ALTER TABLE {table} ADD CHECK (payload IS NOT NULL OR payload_of IS NOT NULL);
-- The rows reading an owner's payload: the purge keeps an owner while one of them is unfinished.
CREATE INDEX {payload_of_idx} ON {table} (payload_of) WHERE payload_of IS NOT NULL;
-- The subscriptions the producers fan out to, known to the database so that a producer that
-- never imported the handlers writes the same rows as one that did. Workers add theirs at
-- start-up; operators add, remove and list them (outbox-celery subscriptions).
CREATE TABLE {subscription_table} (
    event_type text        NOT NULL CHECK (event_type <> '' AND strpos(event_type, '@') = 0),
    name       text        NOT NULL CHECK (name <> '' AND strpos(name, '@') = 0),
    created_at timestamptz NOT NULL DEFAULT now(),
    -- Removed by an operator: producers no longer fan out to it; its rows stay as they are.
    removed_at timestamptz,
    PRIMARY KEY (event_type, name)
);
