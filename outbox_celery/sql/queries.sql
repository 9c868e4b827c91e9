-- Named queries of the dispatcher. Loaded once by outbox_celery.store; "{table}" is replaced by
-- the quoted table identifier (psycopg.sql), every value is a bound parameter.
-- All time comparisons use the database clock (now()); worker clocks are never trusted.

-- name: insert
INSERT INTO {table} (event_type, aggregate_type, aggregate_id, payload, ordering_key, available_at)
VALUES (%(event_type)s, %(aggregate_type)s, %(aggregate_id)s, %(payload)s::jsonb, %(ordering_key)s,
        now() + make_interval(secs => %(delay)s))
RETURNING id;

-- name: insert_many
INSERT INTO {table} (event_type, aggregate_type, aggregate_id, payload, ordering_key, available_at)
SELECT u.event_type, u.aggregate_type, u.aggregate_id, u.payload::jsonb, u.ordering_key,
       now() + make_interval(secs => u.delay)
FROM unnest(%(event_types)s::text[], %(aggregate_types)s::text[], %(aggregate_ids)s::text[],
            %(payloads)s::text[], %(ordering_keys)s::text[], %(delays)s::float8[])
     WITH ORDINALITY AS u(event_type, aggregate_type, aggregate_id, payload, ordering_key, delay, n)
ORDER BY u.n
RETURNING id;

-- name: lock_keys
-- Serializes producers of an ordering key until commit, so id order equals commit order. One
-- round trip for every key of a batch, taken in sorted order so two producers never deadlock.
-- The locks are named after the table's oid, so "outbox" and "public.outbox" share them.
SELECT count(pg_advisory_xact_lock(hashtextextended(
    'outbox_celery:key:' || %(table)s::regclass::oid::text || ':' || k, 0)))
FROM (SELECT DISTINCT k FROM unnest(%(keys)s::text[]) AS u(k) ORDER BY k) AS sorted_keys;

-- name: try_claim_lock
-- One claim run per table at a time: keeps the in-flight bound exact. Transaction-scoped: the
-- caller holds the transaction open for the run and its end releases the lock, so no session
-- state is involved (PgBouncer's transaction pooling may move sessions between transactions).
SELECT pg_try_advisory_xact_lock(hashtextextended(
    'outbox_celery:claim:' || %(table)s::regclass::oid::text, 0));

-- name: count_in_flight
-- Live leases only (DESIGN invariant 16): a row whose lease ran out holds no worker, so a lost
-- task (no consumer, flushed broker, a deploy with every delivery worker down) never fills the
-- bound; the claim takes such rows back whatever the bound says.
SELECT count(*) FROM {table} WHERE status = 'processing' AND lease_until > now();

-- name: count_recent_done
-- Rows finished in the last window, counted up to a cap so the cost stays bounded.
SELECT count(*) FROM (
    SELECT 1 FROM {table}
    WHERE status = 'done' AND done_at > now() - make_interval(secs => %(window)s)
    LIMIT %(cap)s
) AS recent;

-- name: claim_settings
-- First statement of every claim transaction. Once a churned table's statistics price the
-- ordered heads' skip scan above jit_above_cost, every claim pays for JIT compilation (measured
-- by benchmarks/: 15-250 ms per 200-row claim instead of 3-6 ms); these queries never profit.
SET LOCAL jit = off;

-- name: release_expired
-- Expired leases that must not be re-claimed at once (DESIGN invariants 10, 16), back to
-- pending with no attempt spent:
-- * a claim whose task never started (lease_version > started_version: lost in the broker,
--   expired in a queue, or sent to a queue with no consumer) waits one lease, then two, four...
--   up to 16 leases as such claims repeat, so a queue nobody consumes takes a shrinking share of
--   the in-flight bound, while a one-off loss (a flushed broker, a deploy) costs one lease;
-- * an event type the claimer has no handler for (removed by a deploy) waits unroutable_delay,
--   marked unroutable, instead of staying processing for good.
-- A started claim of a known event type is left to claim_expired (its worker died mid-handler).
WITH decided AS (
    SELECT id, (%(event_types)s::text[] IS NULL OR event_type = ANY(%(event_types)s::text[]))
               AS routable
    FROM {table}
    WHERE status = 'processing' AND lease_until <= now()
      AND (started_version < lease_version
           OR NOT (%(event_types)s::text[] IS NULL OR event_type = ANY(%(event_types)s::text[])))
    ORDER BY lease_until
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS o
SET status = 'pending',
    lease_until = NULL,
    available_at = now() + make_interval(secs => CASE
        WHEN decided.routable
        THEN %(lease)s * power(2, least(greatest(o.lease_version - o.started_version - 1, 0), 4))
        ELSE %(unroutable_delay)s END),
    last_error = CASE
        WHEN decided.routable OR o.last_error LIKE 'unroutable:%%' THEN o.last_error
        ELSE left('unroutable: no handler for event type ' || quote_literal(o.event_type)
                  || ' in the claiming app; lease expired'
                  || coalesce('; last error: ' || o.last_error, ''), 8000) END
FROM decided
WHERE o.id = decided.id
RETURNING o.id, o.lease_version, o.event_type, decided.routable,
          o.lease_version - o.started_version AS unstarted_claims;

-- name: reap
-- Expired leases whose attempts are exhausted go dead (DESIGN invariant 5).
WITH doomed AS (
    SELECT id FROM {table}
    WHERE status = 'processing' AND lease_until <= now() AND attempts >= %(max_attempts)s
    ORDER BY lease_until
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS o
SET status = 'dead',
    lease_until = NULL,
    last_error = 'attempts exhausted: lease expired after attempt ' || o.attempts
                 || ' of ' || %(max_attempts)s::int || ' without a result (worker lost or timed out)'
                 || coalesce('; last error: ' || o.last_error, '')
FROM doomed
WHERE o.id = doomed.id
RETURNING o.id, o.lease_version, o.event_type;

-- name: claim_expired
-- Rows whose lease ran out with attempts left after their worker started them (it died or hung
-- mid-handler): re-claimed with a new fencing token. Claims that never started go through
-- release_expired instead.
WITH picked AS (
    SELECT id FROM {table}
    WHERE status = 'processing' AND lease_until <= now() AND attempts < %(max_attempts)s
      AND started_version = lease_version
      AND (%(event_types)s::text[] IS NULL OR event_type = ANY(%(event_types)s::text[]))
    ORDER BY lease_until
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS o
SET lease_owner = %(owner)s,
    lease_until = now() + make_interval(secs => %(lease)s),
    lease_version = o.lease_version + 1
FROM picked
WHERE o.id = picked.id
RETURNING o.id, o.lease_version, o.event_type, o.lease_until;

-- name: claim_pending
WITH picked AS (
    SELECT id FROM {table}
    WHERE status = 'pending' AND ordering_key IS NULL AND available_at <= now()
      AND (%(event_types)s::text[] IS NULL OR event_type = ANY(%(event_types)s::text[]))
    ORDER BY available_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS o
SET status = 'processing',
    lease_owner = %(owner)s,
    lease_until = now() + make_interval(secs => %(lease)s),
    lease_version = o.lease_version + 1
FROM picked
WHERE o.id = picked.id
RETURNING o.id, o.lease_version, o.event_type, o.lease_until;

-- name: claim_heads
-- Ordered rows: only the lowest unfinished id of each key is claimable (DESIGN invariant 9).
-- The recursive CTE is a skip scan over the ordered partial index: one probe per key that has
-- unfinished messages, whatever their number. A dead head blocks its key and nothing else.
WITH RECURSIVE heads AS (
    (SELECT ordering_key, id FROM {table}
     WHERE ordering_key IS NOT NULL AND status <> 'done'
     ORDER BY ordering_key, id
     LIMIT 1)
    UNION ALL
    SELECT nxt.ordering_key, nxt.id
    FROM heads,
    LATERAL (
        SELECT ordering_key, id FROM {table}
        WHERE ordering_key > heads.ordering_key AND ordering_key IS NOT NULL AND status <> 'done'
        ORDER BY ordering_key, id
        LIMIT 1
    ) AS nxt
),
picked AS (
    SELECT o.id FROM {table} AS o
    JOIN heads ON heads.id = o.id
    WHERE o.status = 'pending' AND o.available_at <= now()
      AND (%(event_types)s::text[] IS NULL OR o.event_type = ANY(%(event_types)s::text[]))
    ORDER BY o.available_at, o.id
    LIMIT %(limit)s
    FOR UPDATE OF o SKIP LOCKED
)
UPDATE {table} AS o
SET status = 'processing',
    lease_owner = %(owner)s,
    lease_until = now() + make_interval(secs => %(lease)s),
    lease_version = o.lease_version + 1
FROM picked
WHERE o.id = picked.id
RETURNING o.id, o.lease_version, o.event_type, o.lease_until;

-- name: start
-- The fenced start: the worker is about to run the handler. Counts the attempt here, not at
-- claim, because a broker hop sits between the two (DESIGN invariant 3).
-- commit_mode 'off' relaxes synchronous_commit for this statement's own transaction (NULL keeps
-- the current setting): see Store's relaxed_commit for why losing it costs at most a redelivery.
UPDATE {table}
SET attempts = attempts + 1,
    started_version = lease_version,
    lease_until = greatest(lease_until, now() + make_interval(secs => %(lease)s))
FROM (SELECT set_config('synchronous_commit',
                        coalesce(%(commit_mode)s::text, current_setting('synchronous_commit')),
                        true)) AS commit_mode
WHERE id = %(id)s AND lease_version = %(version)s AND status = 'processing'
  AND attempts < %(max_attempts)s
RETURNING id, event_type, aggregate_type, aggregate_id, payload, attempts, created_at,
          lease_version, ordering_key;

-- name: start_exhausted
-- A redelivered task whose row already spent every attempt (e.g. it kills its worker).
UPDATE {table}
SET status = 'dead',
    lease_until = NULL,
    started_version = lease_version,
    last_error = 'attempts exhausted: ' || attempts || ' handler run(s) of ' || %(max_attempts)s::int
                 || ' started without a result' || coalesce('; last error: ' || last_error, '')
WHERE id = %(id)s AND lease_version = %(version)s AND status = 'processing'
  AND attempts >= %(max_attempts)s
RETURNING id;

-- name: finish_done
-- commit_mode as in start: a lost done means a redelivery after the lease, nothing worse.
UPDATE {table}
SET status = 'done', done_at = now(), lease_until = NULL
FROM (SELECT set_config('synchronous_commit',
                        coalesce(%(commit_mode)s::text, current_setting('synchronous_commit')),
                        true)) AS commit_mode
WHERE id = %(id)s AND lease_version = %(version)s AND status = 'processing'
RETURNING id;

-- name: finish_retry
-- Retryable failure: back to pending after the delay, the attempt kept; dead at the limit.
UPDATE {table}
SET status = CASE WHEN attempts >= %(max_attempts)s THEN 'dead' ELSE 'pending' END,
    available_at = CASE WHEN attempts >= %(max_attempts)s THEN available_at
                        ELSE now() + make_interval(secs => %(delay)s) END,
    lease_until = NULL,
    last_error = CASE WHEN attempts >= %(max_attempts)s
                      THEN 'attempts exhausted (' || attempts || ' of ' || %(max_attempts)s::int
                           || '): ' || %(error)s
                      ELSE %(error)s END
WHERE id = %(id)s AND lease_version = %(version)s AND status = 'processing'
RETURNING id, status;

-- name: finish_defer
-- Business "not yet": the attempt is refunded; dead once it would wait past max_defer_age.
UPDATE {table}
SET status = CASE WHEN now() + make_interval(secs => %(delay)s)
                       > created_at + make_interval(secs => %(max_age)s)
                  THEN 'dead' ELSE 'pending' END,
    attempts = greatest(attempts - 1, 0),
    available_at = now() + make_interval(secs => %(delay)s),
    lease_until = NULL,
    last_error = CASE WHEN now() + make_interval(secs => %(delay)s)
                           > created_at + make_interval(secs => %(max_age)s)
                      THEN 'deferred past max_defer_age: ' || %(reason)s
                      ELSE 'deferred: ' || %(reason)s END
WHERE id = %(id)s AND lease_version = %(version)s AND status = 'processing'
RETURNING id, status;

-- name: finish_dead
UPDATE {table}
SET status = 'dead', lease_until = NULL, last_error = %(error)s
WHERE id = %(id)s AND lease_version = %(version)s AND status = 'processing'
RETURNING id;

-- name: record_error
-- Unexpected exception: keep the error, leave the row to come back through its lease.
UPDATE {table}
SET last_error = %(error)s
WHERE id = %(id)s AND lease_version = %(version)s AND status = 'processing'
RETURNING id;

-- name: release
-- Claimed rows that never reached a worker (publish failed): pending now, no attempt spent.
-- Fenced on the start too: a publish can raise although the broker got the message, and a
-- worker that already started this claim must keep its row (DESIGN invariants 4, 12).
UPDATE {table} AS o
SET status = 'pending', available_at = now(), lease_until = NULL
FROM unnest(%(ids)s::bigint[], %(versions)s::bigint[]) AS r(id, version)
WHERE o.id = r.id AND o.lease_version = r.version AND o.status = 'processing'
  AND o.started_version < r.version
RETURNING o.id;

-- name: postpone
-- A worker has no handler for this event type: wait, attempt refunded, never dead by surprise.
UPDATE {table}
SET status = 'pending',
    attempts = greatest(attempts - 1, 0),
    available_at = now() + make_interval(secs => %(delay)s),
    lease_until = NULL,
    last_error = %(error)s
WHERE id = %(id)s AND lease_version = %(version)s AND status = 'processing'
RETURNING id;

-- name: extend_lease
UPDATE {table}
SET lease_until = greatest(lease_until, now() + make_interval(secs => %(seconds)s))
WHERE id = %(id)s AND lease_version = %(version)s AND status = 'processing'
RETURNING lease_until;

-- name: canonical_name
-- The table as PostgreSQL resolves it, schema included: the base of idempotency keys, so that
-- "outbox" and "public.outbox" (one table) give every message one key (DESIGN invariant 11).
SELECT n.nspname, c.relname
FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE c.oid = %(table)s::regclass;
