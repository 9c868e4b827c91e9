-- The current schema in one piece, for fresh installs. tests/integration/test_migrations.py
-- proves that applying every file in migrations/ in order yields exactly this.
CREATE TABLE {table} (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_type    text        NOT NULL CHECK (event_type <> ''),
    aggregate_type text       NOT NULL,
    aggregate_id  text        NOT NULL,
    -- kombu's JSON text as the producer wrote it (migration 0010, DESIGN invariant 27); NULL
    -- on a subscription's row that reads its owner's (payload_of, migration 0011).
    payload       json,
    ordering_key  text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    status        text        NOT NULL DEFAULT 'pending'
                  CHECK (status IN ('pending', 'processing', 'done', 'dead')),
    available_at  timestamptz NOT NULL DEFAULT now(),
    attempts      integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    lease_owner   text,
    lease_until   timestamptz,
    lease_version bigint      NOT NULL DEFAULT 0,
    last_error    text,
    done_at       timestamptz,
    -- lease_version of the latest claim a worker started; lease_version - started_version
    -- counts claims whose task never started (lost tasks, DESIGN invariants 10, 16).
    started_version bigint    NOT NULL DEFAULT 0,
    head          boolean     NOT NULL DEFAULT false,
    dedup_key     text CHECK (dedup_key <> ''),
    trace_context jsonb,
    -- The limit key given at enqueue (migration 0008): limits per key within an event type.
    limit_key     text CHECK (limit_key <> ''),
    -- The row whose payload this one reads (subscriptions, migration 0011, DESIGN invariant 28).
    payload_of    bigint,
    -- The group this row is a member of (migration 0012, DESIGN invariant 29).
    group_id      bigint,
    -- A JSON array, one object per failed attempt (attempt, at, error), the last 20 (migration
    -- 0013, DESIGN invariant 32); NULL while the row never failed.
    errors        jsonb,
    CHECK (payload IS NOT NULL OR payload_of IS NOT NULL)
) WITH (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 1
);
CREATE INDEX {pending_idx} ON {table} (available_at, id)
    WHERE status = 'pending' AND ordering_key IS NULL;
CREATE INDEX {lease_idx} ON {table} (lease_until)
    WHERE status = 'processing';
CREATE INDEX {ordered_idx} ON {table} (ordering_key, id)
    WHERE ordering_key IS NOT NULL AND status <> 'done';
CREATE INDEX {heads_idx} ON {table} (available_at, id)
    WHERE status = 'pending' AND head;
CREATE INDEX {done_idx} ON {table} (done_at)
    WHERE status = 'done';
CREATE INDEX {dead_idx} ON {table} (id)
    WHERE status = 'dead';
CREATE UNIQUE INDEX {dedup_idx} ON {table} (dedup_key)
    WHERE dedup_key IS NOT NULL;
CREATE INDEX {keyed_idx} ON {table} (event_type, limit_key, available_at, id)
    WHERE status = 'pending' AND limit_key IS NOT NULL AND (ordering_key IS NULL OR head);
CREATE INDEX {key_lease_idx} ON {table} (event_type, limit_key, lease_until)
    WHERE status = 'processing' AND limit_key IS NOT NULL;
CREATE INDEX {payload_of_idx} ON {table} (payload_of) WHERE payload_of IS NOT NULL;
-- The table's identity, the discriminator of idempotency keys (migration 0006).
CREATE TABLE {instance_table} (
    singleton  boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    instance   uuid        NOT NULL DEFAULT gen_random_uuid(),
    created_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO {instance_table} DEFAULT VALUES;
-- Flow control per event type: pause, RateLimited holds, rate buckets (migration 0007).
CREATE TABLE {flow_table} (
    event_type   text        PRIMARY KEY CHECK (event_type <> ''),
    -- Paused by an operator (outbox-celery pause): claimed by nobody until resumed.
    paused       boolean     NOT NULL DEFAULT false,
    -- A RateLimited outcome (HTTP 429): nothing of the type starts before this time.
    paused_until timestamptz,
    -- The rate limit's token bucket: starts left, and when it was last refilled (NULL: full).
    tokens       float8,
    refilled_at  timestamptz,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    -- Where the next claim of a keyed event type starts walking its keys (migration 0008).
    key_cursor   text,
    -- The last claim left the type at its concurrency limit: a worker that finishes one of its
    -- deliveries writes the finish at once and wakes the claim (migration 0008).
    at_cap       boolean     NOT NULL DEFAULT false
);
-- Pause, RateLimited holds and key_rate buckets per limit key (migration 0008).
CREATE TABLE {flow_key_table} (
    event_type   text        NOT NULL CHECK (event_type <> ''),
    limit_key    text        NOT NULL CHECK (limit_key <> ''),
    paused       boolean     NOT NULL DEFAULT false,
    paused_until timestamptz,
    tokens       float8,
    refilled_at  timestamptz,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_type, limit_key),
    -- When the key_rate bucket is full again: past it, an unpaused, unheld row is pruned
    -- (migration 0009).
    full_at      timestamptz
);
CREATE INDEX {flow_key_held_idx} ON {flow_key_table} (event_type, limit_key)
    WHERE paused OR paused_until IS NOT NULL;
-- The keys' RateLimited holds by their end (migration 0009).
CREATE INDEX {flow_key_until_idx} ON {flow_key_table} (paused_until)
    WHERE paused_until IS NOT NULL;
-- The subscriptions the producers fan out to (migration 0011, DESIGN invariant 28).
CREATE TABLE {subscription_table} (
    event_type text        NOT NULL CHECK (event_type <> '' AND strpos(event_type, '@') = 0),
    name       text        NOT NULL CHECK (name <> '' AND strpos(name, '@') = 0),
    created_at timestamptz NOT NULL DEFAULT now(),
    removed_at timestamptz,
    PRIMARY KEY (event_type, name)
);
-- Groups with a callback (migration 0012, DESIGN invariant 29).
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
CREATE INDEX {group_member_idx} ON {table} (group_id, id) WHERE group_id IS NOT NULL;
