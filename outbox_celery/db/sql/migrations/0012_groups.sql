-- Groups with a callback (DESIGN invariant 29): one row per group beside the outbox table, and
-- the group a member row belongs to. The member's fenced finalize counts its outcome in the
-- group's row and, when it is the group's last, inserts the callback's event, in the same
-- statement (queries.sql group_settle).
CREATE TABLE {group_table} (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The member rows the producer inserted (a member dropped as a duplicate dedup key is none).
    total         integer     NOT NULL CHECK (total >= 0),
    done          integer     NOT NULL DEFAULT 0 CHECK (done >= 0),
    dead          integer     NOT NULL DEFAULT 0 CHECK (dead >= 0),
    -- open until done + dead reaches total: then fired (the callback enqueued) or skipped (a
    -- member dead and skip_on_dead); cancelled or finished by an operator.
    state         text        NOT NULL DEFAULT 'open'
                  CHECK (state IN ('open', 'fired', 'skipped', 'cancelled', 'finished')),
    skip_on_dead  boolean     NOT NULL DEFAULT false,
    -- The callback's event, as the producer validated it.
    event_type    text        NOT NULL CHECK (event_type <> ''),
    aggregate_type text       NOT NULL,
    aggregate_id  text        NOT NULL,
    payload       json        NOT NULL,
    delay         float8      NOT NULL DEFAULT 0,
    limit_key     text        CHECK (limit_key <> ''),
    trace_context jsonb,
    -- The first dead members (at most 100): id, event_type and last error (cut) of each.
    dead_members  jsonb       NOT NULL DEFAULT '[]',
    -- The outbox id of the callback's event, once enqueued.
    callback_id   bigint,
    created_at    timestamptz NOT NULL DEFAULT now(),
    closed_at     timestamptz,
    -- Why an operator finished or cancelled it.
    note          text
);
CREATE INDEX {group_open_idx} ON {group_table} (created_at) WHERE state = 'open';
-- No default, no rewrite: existing rows belong to no group.
ALTER TABLE {table} ADD COLUMN group_id bigint;
CREATE INDEX {group_member_idx} ON {table} (group_id, id) WHERE group_id IS NOT NULL;
