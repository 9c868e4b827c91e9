-- The outbox table: business data's transaction writes it, the dispatcher leases and finalizes it.
CREATE TABLE {table} (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_type    text        NOT NULL CHECK (event_type <> ''),
    aggregate_type text       NOT NULL,
    aggregate_id  text        NOT NULL,
    payload       jsonb       NOT NULL,
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
    done_at       timestamptz
);
