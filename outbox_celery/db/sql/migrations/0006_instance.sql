-- The table's identity: a UUID drawn once, here, and written into every idempotency key
-- (<instance>/<schema>.<table>:<id>), so two databases or clusters whose outboxes share a
-- table name never send one receiver the same key. One row per outbox table, in the table's
-- schema, named after it. pg_dump carries it: a restored database keeps its keys.
-- gen_random_uuid() is core since PostgreSQL 13.
CREATE TABLE {instance_table} (
    singleton  boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    instance   uuid        NOT NULL DEFAULT gen_random_uuid(),
    created_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO {instance_table} DEFAULT VALUES;
