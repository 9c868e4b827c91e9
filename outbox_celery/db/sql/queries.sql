-- Named queries of the dispatcher. Loaded once by the query registry (outbox_celery/_sql.py):
-- "{table}" is replaced by the quoted table identifier (psycopg.sql), every value is a bound
-- parameter. The other "{...}" are fragments written once in _sql.FRAGMENTS (the key lock, the
-- notify channel, the synchronous_commit switch) or in this file ("-- fragment: x").
-- All time comparisons use the database clock (now()); worker clocks are never trusted.

-- name: insert
-- An ordered row is its key's head when no other message of the key is unfinished (DESIGN
-- invariant 9). Read under the producer's key lock, taken by an earlier statement, so this
-- statement's snapshot already holds every commit of that key (read committed; see lock_keys).
-- For an unordered row the AND stops at false and the probe never runs. A dedup key already in
-- the table inserts nothing and returns no row (see dedup_ids).
-- Fan-out (DESIGN invariant 28): an event type with subscriptions (the subscription table, read
-- by this statement) gets one row per subscription, its event_type the route
-- "<event_type>@<name>", its ordering key the subscription's own ("<key>", chr(31), route). The
-- first subscription's row (the owner) keeps the payload and the dedup key; the others store no
-- payload and point at the owner (payload_of). A type with no subscription gets one row, as
-- always. One statement, one round trip, whatever the number of subscriptions.
WITH fan_subs AS (
    SELECT name, row_number() OVER (ORDER BY name) AS n
    FROM {subscription_table}
    WHERE event_type = %(event_type)s::text AND removed_at IS NULL
),
fan_routes AS (
    SELECT coalesce(%(event_type)s::text || '@' || r.name, %(event_type)s::text) AS route,
           %(ordering_key)s::text || coalesce(chr(31) || %(event_type)s::text || '@' || r.name, '') AS k,
           r.n
    FROM (SELECT name, n FROM fan_subs
          UNION ALL
          SELECT NULL, 1 WHERE NOT EXISTS (SELECT 1 FROM fan_subs)) AS r
),
fan_owner AS (
    INSERT INTO {table} (event_type, aggregate_type, aggregate_id, payload, ordering_key,
                         available_at, head, dedup_key, trace_context, limit_key)
    SELECT r.route, %(aggregate_type)s::text, %(aggregate_id)s::text, %(payload)s::json, r.k,
           now() + make_interval(secs => %(delay)s),
           r.k IS NOT NULL AND NOT EXISTS (
               SELECT 1 FROM {table} WHERE ordering_key = r.k AND status <> 'done'),
           %(dedup_key)s, %(trace_context)s::jsonb, %(limit_key)s
    FROM fan_routes AS r WHERE r.n = 1
    ON CONFLICT (dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING
    RETURNING id, dedup_key, ordering_key, payload_of
),
fan_others AS (
    INSERT INTO {table} (event_type, aggregate_type, aggregate_id, payload, payload_of,
                         ordering_key, available_at, head, trace_context, limit_key)
    SELECT r.route, %(aggregate_type)s::text, %(aggregate_id)s::text, NULL, w.id, r.k,
           now() + make_interval(secs => %(delay)s),
           r.k IS NOT NULL AND NOT EXISTS (
               SELECT 1 FROM {table} WHERE ordering_key = r.k AND status <> 'done'),
           %(trace_context)s::jsonb, %(limit_key)s
    FROM fan_owner AS w, fan_routes AS r WHERE r.n > 1
    ORDER BY r.n
    RETURNING id, dedup_key, ordering_key, payload_of
)
-- Push: wake this table's listeners at commit, only when a row was inserted.
SELECT id, dedup_key, {wake_listeners} AS woke, ordering_key, payload_of FROM fan_owner
UNION ALL
SELECT id, dedup_key, NULL, ordering_key, payload_of FROM fan_others;

-- name: insert_many
-- As insert, for many events of any types; within the batch only the first row of a key (lowest
-- n, hence lowest id) can be its head, and only if the key has no unfinished message already.
-- Should that first row be dropped as a duplicate dedup key, the producer settles the key's
-- head afterwards (settle_heads). The owners (each event's first subscription, or its only row)
-- are drawn first, in input order; the other subscriptions' rows after them, in the owners'
-- order. A route is either every event's owner or none's, so each route's rows keep input order.
WITH gid AS (SELECT NULL::bigint AS group_id),
{insert_fan}
-- Push: wake this table's listeners at commit, only when a row was inserted.
SELECT id, dedup_key, {wake_listeners} AS woke, ordering_key, payload_of FROM fan_owner
UNION ALL
SELECT id, dedup_key, NULL, ordering_key, payload_of FROM fan_others;

-- name: group_insert
-- A group and its members in one statement (DESIGN invariant 29): the group's id drawn first,
-- the members inserted as insert_many does (fanned out to their subscriptions, invariant 28)
-- with that group_id, then the group's row with total = the member rows actually inserted (a
-- duplicate dedup key drops its member: it is none; each subscription's row is one). Its first
-- row is the group's (id NULL, group_id its id); the members' rows follow.
WITH gid AS (
    SELECT nextval(pg_get_serial_sequence(%(group_table)s::text, 'id')) AS group_id
),
{insert_fan},
grp AS (
    INSERT INTO {group_table} (id, total, skip_on_dead, event_type, aggregate_type, aggregate_id,
                               payload, delay, limit_key, trace_context)
    OVERRIDING SYSTEM VALUE
    SELECT gid.group_id, (SELECT count(*) FROM fan_owner) + (SELECT count(*) FROM fan_others),
           %(skip_on_dead)s, %(then_event_type)s,
           %(then_aggregate_type)s, %(then_aggregate_id)s, %(then_payload)s::json, %(then_delay)s,
           %(then_limit_key)s, %(then_trace_context)s::jsonb
    FROM gid
    RETURNING id, total
)
SELECT NULL::bigint AS id, NULL::text AS dedup_key, NULL::bool AS woke, NULL::text AS ordering_key,
       NULL::bigint AS payload_of, grp.id AS group_id, grp.total
FROM grp
UNION ALL
SELECT id, dedup_key, {wake_listeners}, ordering_key, payload_of, NULL, NULL FROM fan_owner
UNION ALL
SELECT id, dedup_key, NULL, ordering_key, payload_of, NULL, NULL FROM fan_others;

-- name: group_fire_empty
-- A group none of whose members was inserted (each one a duplicate dedup key) is complete at
-- once: its callback is enqueued in the producer's transaction, by the rule every member's
-- finalize runs (group_settle with no outcome to count).
WITH group_moves AS (
    SELECT %(group_id)s::bigint AS group_id, NULL::bigint AS id, NULL::text AS event_type,
           NULL::text AS last_error, 0 AS d_done, 0 AS d_dead
),
{group_settle}
SELECT (SELECT count(*) FROM gs_fired) AS fired;

-- fragment: insert_fan
-- The rows of insert_many and of a group's members (group_insert), as the CTEs of their
-- statement: each event's owner row (its first subscription's, or its only one) and its other
-- subscriptions' rows (invariant 28); the statement's "gid" names their group (NULL: none).
fan_u AS (
    SELECT * FROM unnest(%(event_types)s::text[], %(aggregate_types)s::text[],
                         %(aggregate_ids)s::text[], %(payloads)s::text[], %(ordering_keys)s::text[],
                         %(delays)s::float8[], %(dedup_keys)s::text[], %(trace_contexts)s::text[],
                         %(limit_keys)s::text[])
        WITH ORDINALITY AS u(event_type, aggregate_type, aggregate_id, payload, ordering_key, delay,
                             dedup_key, trace_context, limit_key, n)
),
fan_subs AS (
    SELECT event_type, name, row_number() OVER (PARTITION BY event_type ORDER BY name) AS rank
    FROM {subscription_table}
    WHERE event_type = ANY(%(event_types)s::text[]) AND removed_at IS NULL
),
fan_first AS (
    SELECT u.*, coalesce(u.event_type || '@' || s.name, u.event_type) AS route,
           u.ordering_key || coalesce(chr(31) || u.event_type || '@' || s.name, '') AS k
    FROM fan_u AS u LEFT JOIN fan_subs AS s ON s.event_type = u.event_type AND s.rank = 1
),
fan_owner AS (
    INSERT INTO {table} (event_type, aggregate_type, aggregate_id, payload, ordering_key,
                         available_at, head, dedup_key, trace_context, limit_key, group_id)
    SELECT v.route, v.aggregate_type, v.aggregate_id, v.payload::json, v.k,
           now() + make_interval(secs => v.delay),
           v.k IS NOT NULL
           AND row_number() OVER (PARTITION BY v.k ORDER BY v.n) = 1
           AND NOT EXISTS (SELECT 1 FROM {table} AS o
                           WHERE o.ordering_key = v.k AND o.status <> 'done'),
           v.dedup_key, v.trace_context::jsonb, v.limit_key, (SELECT group_id FROM gid)
    FROM fan_first AS v
    ORDER BY v.n
    ON CONFLICT (dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING
    RETURNING id, dedup_key, ordering_key, payload_of, event_type, aggregate_type, aggregate_id,
              available_at, trace_context, limit_key
),
fan_rest AS (
    SELECT w.id, s.event_type || '@' || s.name AS route, w.aggregate_type, w.aggregate_id,
           split_part(w.ordering_key, chr(31), 1) || chr(31) || s.event_type || '@' || s.name AS k,
           w.available_at, w.trace_context, w.limit_key, s.rank
    FROM fan_owner AS w
    JOIN fan_subs AS s ON s.event_type = split_part(w.event_type, '@', 1) AND s.rank > 1
),
fan_others AS (
    INSERT INTO {table} (event_type, aggregate_type, aggregate_id, payload, payload_of,
                         ordering_key, available_at, head, trace_context, limit_key, group_id)
    SELECT r.route, r.aggregate_type, r.aggregate_id, NULL, r.id, r.k, r.available_at,
           r.k IS NOT NULL
           AND row_number() OVER (PARTITION BY r.k ORDER BY r.id) = 1
           AND NOT EXISTS (SELECT 1 FROM {table} AS o
                           WHERE o.ordering_key = r.k AND o.status <> 'done'),
           r.trace_context, r.limit_key, (SELECT group_id FROM gid)
    FROM fan_rest AS r
    ORDER BY r.id, r.rank
    RETURNING id, dedup_key, ordering_key, payload_of
)

-- name: dedup_ids
-- The rows holding these dedup keys: inserted by an earlier (committed) transaction, by this
-- one, or by a concurrent one that committed while the insert waited for it.
SELECT id, dedup_key FROM {table} WHERE dedup_key = ANY(%(keys)s::text[]);

-- name: lock_keys
-- Serializes producers of an ordering key until commit, so id order equals commit order. One
-- round trip for every key of a batch, taken in sorted order so two producers never deadlock.
-- The locks are named after the table's oid, so "outbox" and "public.outbox" share them.
-- The head finalizers (finish_done_head, admin skip) take the same locks. The isolation level
-- comes back with it: insert decides the head from its statement's snapshot, which is taken
-- after the lock only under read committed.
SELECT count({key_lock}) AS locked, current_setting('transaction_isolation') AS isolation
FROM (SELECT DISTINCT k FROM unnest(%(keys)s::text[]) AS u(k) ORDER BY k) AS sorted_keys;

-- name: try_claim_lock
-- The table's claim lock, alone: one claim transaction per table at a time. A claim run takes it
-- in its claim transaction's first statement (claim_settings: claim_lock); this one is for
-- whoever holds it on a connection of its own. Transaction-scoped: its end releases the lock, so
-- no session state is involved (PgBouncer's transaction pooling may move sessions between
-- transactions).
SELECT {claim_lock_taken} AS locked;

-- fragment: claim_lock_taken
-- The table's claim lock, named by the table's oid: "outbox" and "public.outbox" share it.
pg_try_advisory_xact_lock(hashtextextended('outbox_celery:claim:' || %(table)s::regclass::oid::text, 0))

-- name: count_in_flight
-- Live leases only (DESIGN invariant 16): a row whose lease ran out holds no worker, so a lost
-- task (no consumer, flushed broker, a deploy with every delivery worker down) never fills the
-- bound; the claim takes such rows back whatever the bound says.
SELECT count(*) AS n FROM {table} WHERE status = 'processing' AND lease_until > now();

-- name: in_flight_by_route
-- Live leases per route (DESIGN invariant 16): how many, how many whose task has not started, and
-- how many of those were claimed longer than stall seconds ago (a claim gives a lease from its
-- now(): the claim's time is lease_until - lease). A route whose oldest task waits that long has
-- no worker starting its tasks (its queue has no consumer, or is far behind).
SELECT event_type, count(*) AS live,
       count(*) FILTER (WHERE started_version < lease_version) AS unstarted,
       count(*) FILTER (WHERE started_version < lease_version
                          AND lease_until < now() + make_interval(secs => %(lease)s - %(stall)s)) AS stalled
FROM {table}
WHERE status = 'processing' AND lease_until > now()
GROUP BY event_type;

-- name: count_recent_done
-- Rows finished in the last window, counted up to a cap so the cost stays bounded.
SELECT count(*) AS n FROM (
    SELECT 1 FROM {table}
    WHERE status = 'done' AND done_at > now() - make_interval(secs => %(window)s)
    LIMIT %(cap)s
) AS recent;

-- name: claim_settings
-- First statement of every claim transaction: JIT off for the claim. Once a churned table's
-- statistics price the claim's queries above jit_above_cost, JIT compilation costs every claim
-- many times its few milliseconds of work, and these short queries never profit from it.
-- Also returns the transaction's now(): where the claim's scan marks move to (ScanMarks), for a
-- claim run the table's claim lock (claim_lock), and the two probes (claim_probes) that spare a
-- claim the statements with nothing to do.
SELECT set_config('jit', 'off', true) AS jit, now() AS now, {claim_lock} AS locked, {claim_probes};

-- fragment: claim_lock
-- A claim run's claim transactions take the table's claim lock here, in their first statement
-- (DESIGN invariant 16): one at a time per table, so the in-flight count that follows, in a
-- statement of its own and so with a snapshot taken after the lock, sees every claim committed
-- before it. A claim whose transaction does not get it claims nothing. NULL: no lock asked
-- (a claim called on its own). pg_try_advisory_xact_lock is volatile, never folded in a plan.
CASE WHEN %(claim_lock)s::bool THEN {claim_lock_taken} END

-- fragment: claim_probes
-- The claim's two probes, read in its first statement with the marks the claim expects to use
-- (DESIGN invariant 18); the claim runs the statement again (first_expired) or the heads claim
-- when its marks moved in between (a full pass):
--   first_expired: first_expired's answer, NULL when no lease ran out since expired_since. Its
--          snapshot is taken before the claim lock, which changes nothing: it holds every lease
--          that ran out before this transaction's now() but one written longer than a lease ago
--          (first_expired), and a lease another claim took back since is skipped by the scans;
--   heads_due: a pending head of this claimer's types is due from heads_since (any of them, held
--          or limited ones included). False: claim_heads is not run and its mark moves to now(),
--          as if it took none; a head due later is the next claim's, as one committed after the
--          heads statement would be.
({first_expired_scan}) AS first_expired,
EXISTS (SELECT 1 FROM {table}
        WHERE status = 'pending' AND head AND available_at <= now()
          AND available_at >= coalesce(%(heads_since)s::timestamptz, '-infinity')
          AND (%(event_types)s::text[] IS NULL OR event_type = ANY(%(event_types)s::text[]))) AS heads_due

-- name: claim_settings_flow
-- claim_settings of a table with its flow-control tables (migrations 0007 to 0009): the
-- same, and in the same statement, without a lock, what the claim must leave out or claim key
-- by key (DESIGN invariants 23, 24, 25). A claim with no limit declared and nothing paused or
-- held runs no other flow statement: no lock, no count, no write.
--   known: every event type with a flow row (a limited type without one gets it first, before
--          any flow lock, so that the locks are always taken in one order);
--   held: the types paused or held by a RateLimited outcome (claimed by nobody);
--   held_for: seconds until the earliest hold of a type ends;
--   key_types: the types (of those this claimer delivers) with a limit key paused or held, or
--          a key hold that ran out and is not yet cleared: one probe per type of the held keys'
--          index (a loose index scan), however many keys are held;
--   key_held_for: seconds until the earliest hold of a key ends (the holds' index, one probe).
WITH RECURSIVE kt AS (
    (SELECT event_type FROM {flow_key_table}
     WHERE (paused OR paused_until IS NOT NULL)
       AND (%(event_types)s::text[] IS NULL OR event_type = ANY(%(event_types)s::text[]))
     ORDER BY event_type, limit_key LIMIT 1)
    UNION ALL
    SELECT (SELECT f.event_type FROM {flow_key_table} AS f
            WHERE (f.paused OR f.paused_until IS NOT NULL) AND f.event_type > kt.event_type
              AND (%(event_types)s::text[] IS NULL OR f.event_type = ANY(%(event_types)s::text[]))
            ORDER BY f.event_type, f.limit_key LIMIT 1)
    FROM kt WHERE kt.event_type IS NOT NULL
)
SELECT set_config('jit', 'off', true) AS jit, now() AS now, {claim_lock} AS locked,
       (SELECT coalesce(array_agg(event_type ORDER BY event_type), ARRAY[]::text[]) FROM {flow_table}) AS known,
       (SELECT coalesce(array_agg(event_type ORDER BY event_type), ARRAY[]::text[]) FROM {flow_table}
        WHERE paused OR paused_until > now()) AS held,
       (SELECT min(extract(epoch FROM paused_until - now()))::float8 FROM {flow_table}
        WHERE NOT paused AND paused_until > now()) AS held_for,
       (SELECT coalesce(array_agg(event_type ORDER BY event_type), ARRAY[]::text[]) FROM kt
        WHERE event_type IS NOT NULL) AS key_types,
       (SELECT extract(epoch FROM f.paused_until - now())::float8 FROM {flow_key_table} AS f
        WHERE f.paused_until > now()
          AND (%(event_types)s::text[] IS NULL OR f.event_type = ANY(%(event_types)s::text[]))
        ORDER BY f.paused_until LIMIT 1) AS key_held_for,
       {claim_probes};

-- name: first_expired
-- The earliest lease that ran out, from expired_since (ScanMarks, DESIGN invariant 18): where
-- release_expired, reap, release_keyed_expired and claim_expired start, or NULL when none ran
-- out, and then none of them runs. Each of them would walk the lease index from expired_since
-- to now(); under a pinned xmin horizon that range holds a dead entry for every claim and start
-- of the range (a full pass: of the whole pin), which this one walk steps over for all four.
-- The four read the same range with one more condition each, and no transaction makes a lease
-- that ran out before this claim's now() appear after this read (a lease end is written in the
-- future) but one that ran longer than a lease: the next full pass takes it, as a row skipped
-- locked. A claim reads it in its first statement (claim_probes) and runs it only when its
-- expired mark moved after that.
{first_expired_scan};

-- fragment: first_expired_scan
SELECT lease_until FROM {table}
WHERE status = 'processing' AND lease_until <= now()
  AND lease_until >= coalesce(%(expired_since)s::timestamptz, '-infinity')
ORDER BY lease_until
LIMIT 1

-- name: release_expired
-- Expired leases that are not re-claimed as started ones are (claim_expired, DESIGN invariants
-- 10, 16): back to pending with no attempt spent:
-- * a claim whose task never started (lease_version > started_version: lost in the broker,
--   expired in a queue, or sent to a queue with no consumer) is claimable again at once the
--   first time: its lease was the wait, so a one-off loss (a flushed broker, a deploy, a task
--   that found its database down) costs one lease. As such claims repeat it waits one lease,
--   then two, four... up to 16, so a queue nobody consumes takes a shrinking share of the
--   in-flight bound;
-- * an event type the claimer has no handler for (removed by a deploy) waits unroutable_delay,
--   marked unroutable, instead of staying processing for good.
-- A started claim of a known event type is left to claim_expired (its worker died mid-handler).
-- This and the two statements after it scan the expired leases from expired_since (ScanMarks,
-- DESIGN invariant 18): a lease end is always written in the future, so a lease that ran out
-- since the previous claim lies after that claim's now().
WITH decided AS (
    SELECT id, (%(event_types)s::text[] IS NULL OR event_type = ANY(%(event_types)s::text[]))
               AS routable
    FROM {table}
    WHERE status = 'processing' AND lease_until <= now()
      AND lease_until >= coalesce(%(expired_since)s::timestamptz, '-infinity')
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
        THEN CASE WHEN o.lease_version - o.started_version <= 1 THEN 0
                  ELSE %(lease)s * power(2, least(o.lease_version - o.started_version - 2, 4)) END
        ELSE %(unroutable_delay)s END),
    last_error = CASE
        WHEN decided.routable OR o.last_error LIKE 'unroutable:%%' THEN o.last_error
        ELSE left('unroutable: no handler for event type ' || quote_literal(o.event_type)
                  || ' in the claiming app; lease expired'
                  || coalesce('; last error: ' || o.last_error, ''), 8000) END,
    -- A started claim (of a type the claimer has no handler for) ended its attempt without a
    -- result: recorded (DESIGN invariant 32); a claim that never started spent no attempt.
    errors = CASE WHEN o.started_version = o.lease_version THEN {errors_appended}
                  ELSE o.errors END
FROM decided, {lease_lost}
WHERE o.id = decided.id
RETURNING o.id, o.lease_version, o.event_type, decided.routable,
          o.lease_version - o.started_version AS unstarted_claims;

-- name: reap
-- Expired leases whose attempts are exhausted go dead (DESIGN invariant 5); a group's member
-- counts in its group (group_settle, invariant 29).
WITH doomed AS (
    SELECT id FROM {table}
    WHERE status = 'processing' AND lease_until <= now()
      AND lease_until >= coalesce(%(expired_since)s::timestamptz, '-infinity')
      AND attempts >= %(max_attempts)s
    ORDER BY lease_until
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
, reaped AS (
UPDATE {table} AS o
SET status = 'dead',
    lease_until = NULL,
    last_error = 'attempts exhausted: lease expired after attempt ' || o.attempts
                 || ' of ' || %(max_attempts)s::int || ' without a result (worker lost or timed out)'
                 || coalesce('; last error: ' || o.last_error, ''),
    -- The last attempt, if this claim started it, ended without a result (DESIGN invariant
    -- 32); a claim that never started spent no attempt and records nothing.
    errors = CASE WHEN o.started_version = o.lease_version THEN {errors_appended}
                  ELSE o.errors END
FROM doomed, {lease_lost}
WHERE o.id = doomed.id
RETURNING o.id, o.lease_version, o.event_type, o.group_id, o.last_error
),
-- A member of a group counts its dead in the group's row (invariant 29).
group_moves AS (
    SELECT group_id, id, event_type, last_error, 0 AS d_done, 1 AS d_dead
    FROM reaped WHERE group_id IS NOT NULL
),
{group_settle}
SELECT id, lease_version, event_type FROM reaped;

-- fragment: claim_picked
-- The tail of every claim statement (claim_expired, claim_pending, claim_heads and their
-- _limited forms), written once: the rows the statement's "picked" chose are processing under a
-- new lease and a new fencing token, and come back as the claim reads them (Claimed, ScanMarks).
-- An expired lease's row is processing already; setting it again changes nothing. Its claim
-- was started (claim_expired takes no other): that attempt ended without a result and is
-- recorded (DESIGN invariant 32); a pending row's claim records nothing.
UPDATE {table} AS o
SET status = 'processing',
    lease_owner = %(owner)s,
    lease_until = now() + make_interval(secs => %(lease)s),
    lease_version = o.lease_version + 1,
    errors = CASE WHEN o.status = 'processing' AND o.started_version = o.lease_version
                  THEN {errors_appended} ELSE o.errors END
FROM picked, {lease_lost}
WHERE o.id = picked.id
RETURNING o.id, o.lease_version, o.event_type, o.lease_until, o.available_at, o.attempts;

-- name: claim_expired
-- excluded (here, in claim_pending and in claim_heads): event types this statement must not
-- take (DESIGN invariants 22, 23): paused or held by a RateLimited outcome, and the
-- limited ones, which the claim takes by separate statements of their own (event_types = that
-- one type, LIMIT its allowance). Empty: nothing excluded.
-- Rows whose lease ran out with attempts left after their worker started them (it died or hung
-- mid-handler): re-claimed with a new fencing token. Claims that never started go through
-- release_expired instead.
WITH picked AS (
    SELECT id FROM {table}
    WHERE status = 'processing' AND lease_until <= now()
      AND lease_until >= coalesce(%(expired_since)s::timestamptz, '-infinity')
      AND attempts < %(max_attempts)s
      AND started_version = lease_version
      AND (%(event_types)s::text[] IS NULL OR event_type = ANY(%(event_types)s::text[]))
      AND event_type <> ALL(%(excluded)s::text[])
    ORDER BY lease_until
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
{claim_picked};

-- name: claim_pending
-- Due unordered rows, oldest first. The scan starts at pending_since, a little behind where this
-- process's previous claim stopped (ScanMarks, DESIGN invariant 18): the index entries in front
-- of it belong to rows claimed long ago, whose dead versions a pinned xmin horizon keeps; every
-- so often (and on a process's first claim) pending_since is NULL and the scan starts at the
-- beginning, for rows whose transaction committed later than the look-back behind the mark.
WITH picked AS (
    SELECT id FROM {table}
    WHERE status = 'pending' AND ordering_key IS NULL AND available_at <= now()
      AND available_at >= coalesce(%(pending_since)s::timestamptz, '-infinity')
      AND (%(event_types)s::text[] IS NULL OR event_type = ANY(%(event_types)s::text[]))
      AND event_type <> ALL(%(excluded)s::text[])
    ORDER BY available_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
{claim_picked};

-- name: claim_heads
-- Ordered rows: only the head of each key (its lowest id not done, flagged "head") is claimable
-- (DESIGN invariant 9). The pending heads are read in due order from their own partial index,
-- so a claim costs O(batch) whatever the number of keys, the backlog behind the heads or the
-- heads in flight (invariant 17); from heads_since as claim_pending does from pending_since
-- (invariant 18). A dead, processing or retried head keeps its flag and so keeps
-- its key blocked; only its done (finish_done_head) or an operator's skip moves the flag on.
WITH picked AS (
    SELECT id FROM {table}
    WHERE status = 'pending' AND head AND available_at <= now()
      AND available_at >= coalesce(%(heads_since)s::timestamptz, '-infinity')
      AND (%(event_types)s::text[] IS NULL OR event_type = ANY(%(event_types)s::text[]))
      AND event_type <> ALL(%(excluded)s::text[])
    ORDER BY available_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
{claim_picked};

-- name: start
-- The fenced start of one claim or many (a batch task's, DESIGN invariants 3, 21): the worker is
-- about to run the handler. Counts the attempt here, not at claim, because a broker hop sits
-- between the two (DESIGN invariant 3). Each (id, lease_version) pair is fenced on its own
-- version; a pair that does not match (a newer claim, a finished row, a claim already started,
-- no attempt left) is left out of the result.
-- Once per claim: a claim that already started (started_version = lease_version) is never
-- started again, so a task the broker redelivers while the first run still holds the lease (a
-- Redis visibility_timeout or RabbitMQ consumer_timeout shorter than the run) calls nothing;
-- only the start's own retry after a lost reply gets its row back (resume). The starter's token
-- goes into lease_owner: who runs the claim now, and what resume matches.
-- commit_mode 'off' relaxes synchronous_commit for this statement's own transaction (NULL keeps
-- the current setting): see Store's relaxed_commit for why losing it costs at most a redelivery.
-- inline_payload: one result carries a bounded number of stored payload bytes.
-- The lease (DESIGN invariant 33): the claim's lease_until stays when at least keep (the
-- completer's START_KEEP) of a lease is left (a task started soon after its claim, the common
-- case), else it becomes a whole lease from now. No indexed column changes then, so where the
-- row's page has room PostgreSQL writes the new version there as a heap-only tuple (HOT): no
-- entry in the primary key or the live leases' index, and under a pinned horizon no second
-- dead lease_idx entry for the claim.
UPDATE {table}
SET attempts = attempts + 1,
    started_version = lease_version,
    lease_owner = %(starter)s,
    lease_until = CASE WHEN lease_until
                            >= now() + make_interval(secs => %(lease)s::float8 * %(keep)s::float8)
                       THEN lease_until
                       ELSE now() + make_interval(secs => %(lease)s) END
FROM {commit_mode}, {leases} AS s(claim_id, claim_version)
WHERE id = s.claim_id AND lease_version = s.claim_version AND {fenced_processing}
  AND started_version < lease_version AND attempts < %(max_attempts)s
RETURNING id, event_type, aggregate_type, aggregate_id, {inline_payload}, attempts, created_at,
          lease_version, ordering_key, trace_context, group_id;

-- name: resume
-- The retry of a start whose reply was lost with its connection: the start committed, so the
-- claim is started under this starter's token. The row comes back as the start returned it,
-- with no attempt counted again and never made dead here (DESIGN invariant 3).
UPDATE {table}
SET lease_until = greatest(lease_until, now() + make_interval(secs => %(lease)s))
FROM {leases} AS s(claim_id, claim_version)
WHERE id = s.claim_id AND lease_version = s.claim_version AND {fenced_processing}
  AND started_version = lease_version AND lease_owner = %(starter)s
RETURNING id, event_type, aggregate_type, aggregate_id, {inline_payload}, attempts, created_at,
          lease_version, ordering_key, trace_context, group_id;

-- fragment: inline_payload
-- The payload, when it is read with the start, its stored size, and whether it was: each of the
-- n rows may take %(inline_share)s = 1/n of the completer's inline_bytes, so one result never
-- carries a whole batch of large payloads; the others are read in bounded chunks (payloads).
-- A subscription's row reads its owner's (payload_of, DESIGN invariant 28).
CASE WHEN pg_column_size({stored_payload}) <= %(inline_share)s THEN {stored_payload} END AS payload,
pg_column_size({stored_payload}) AS payload_bytes,
pg_column_size({stored_payload}) <= %(inline_share)s AS payload_inline

-- fragment: stored_payload
-- The row's payload, or its owner's when it stores none (a subscription's row, invariant 28).
coalesce(payload, (SELECT w.payload FROM {table} AS w WHERE w.id = {table}.payload_of))

-- fragment: fenced_processing
-- The fence's status test of the statements that find their rows by id (start, resume,
-- start_exhausted, finish, extend_lease). For a status, never NULL, IS NOT DISTINCT FROM is the
-- same comparison, but it does not imply the predicate of the live leases' partial index
-- (lease_idx), so PostgreSQL cannot read that index in place of the primary key: its
-- statistics often price it as empty (analyzed while few leases were live, or never), and a
-- start or finish read from it steps over every live lease's entry and row to find its own.
-- Under a pinned xmin horizon that index also keeps a dead entry for every claim and start since
-- the pin began: read from it, each start and finish would scan all of them, a cost that grows
-- with the pin and outlives it until VACUUM (DESIGN invariant 18).
-- Unqualified: the statements' other row sources have no status column.
status IS NOT DISTINCT FROM 'processing'

-- fragment: leases
-- The (id, lease_version) pairs a fenced statement applies to, one or many. A statement of one
-- row is run with one_lease in its place (_sql.one_row): its plan is made once and reused,
-- where an array's unknown length would have it planned again for every call.
unnest(%(ids)s::bigint[], %(lease_versions)s::bigint[])

-- fragment: one_lease
(VALUES (%(id)s::bigint, %(lease_version)s::bigint))

-- fragment: finishes
-- The finishes of the finish statement, one or many (one_finish for one, as leases).
unnest(%(ids)s::bigint[], %(lease_versions)s::bigint[], %(outcomes)s::text[], %(delays)s::float8[],
       %(errors)s::text[])

-- fragment: one_finish
(VALUES (%(id)s::bigint, %(lease_version)s::bigint, %(outcome)s::text, %(delay)s::float8,
         %(error)s::text))

-- name: payloads
-- The payloads start left out of its result (beyond its byte budget), one bounded chunk of ids
-- at a time. A payload never changes after the insert: read without a fence.
-- A subscription's row reads its owner's payload (payload_of, DESIGN invariant 28).
SELECT o.id, coalesce(o.payload, w.payload) AS payload
FROM {table} AS o LEFT JOIN {table} AS w ON w.id = o.payload_of
WHERE o.id = ANY(%(ids)s::bigint[]) ORDER BY o.id;

-- name: start_exhausted
-- A claim that never started and whose row has no attempt left (max_attempts lowered since,
-- for one). A claim that did start is not judged here: its run may still be going (a
-- redelivered task) or its start's reply was lost (resume); the reap decides once its lease
-- has run out (DESIGN invariant 5). No attempt ends here (this claim never started one), so
-- errors gains no entry: each attempt before it recorded its own (DESIGN invariant 32).
WITH exhausted AS (
UPDATE {table}
SET status = 'dead',
    lease_until = NULL,
    started_version = lease_version,
    last_error = 'attempts exhausted: ' || attempts || ' handler run(s) of ' || %(max_attempts)s::int
                 || ' started without a result' || coalesce('; last error: ' || last_error, '')
FROM {leases} AS s(claim_id, claim_version)
WHERE id = s.claim_id AND lease_version = s.claim_version AND {fenced_processing}
  AND started_version < lease_version
  AND attempts >= %(max_attempts)s
RETURNING id, event_type, group_id, last_error
),
-- A member of a group counts its dead in the group's row (invariant 29).
group_moves AS (
    SELECT group_id, id, event_type, last_error, 0 AS d_done, 1 AS d_dead
    FROM exhausted WHERE group_id IS NOT NULL
),
{group_settle}
SELECT id FROM exhausted;

-- name: lock_key_of
-- First statement of a finalize that holds an ordered done: the producers' locks (lock_keys) of
-- those rows' keys, sorted, so that the finish statement's snapshot holds every message of the
-- keys committed so far and none can commit until the heads have moved (DESIGN invariant 9).
{lock_keys_of_rows};

-- fragment: lock_keys_of_rows
-- The producers' key locks (lock_keys) of the rows %(ids)s, each key once, in sorted order;
-- nothing for an unordered row. Written once for an ordered done (lock_key_of) and an
-- operator's skip (admin.sql lock_keys_of_ids).
-- A subscription's stored key ("<key>", chr(31), route: DESIGN invariant 28) takes the lock of
-- its producer's key, the part before chr(31).
SELECT count({key_lock})
FROM (SELECT DISTINCT split_part(ordering_key, chr(31), 1) AS k FROM {table}
      WHERE id = ANY(%(ids)s::bigint[]) AND ordering_key IS NOT NULL
      ORDER BY 1) AS sorted_keys

-- name: finish
-- The one fenced finalize (the completer, DESIGN invariants 4, 9, 21): every outcome of one row
-- or many in one statement, each row fenced on its own lease_version and status 'processing'.
-- Each outcome's rule is written here and nowhere else:
--   done          'done', done_at now(); an ordered row only under its key lock (keys_locked:
--                 lock_key_of ran first in this transaction; settle_heads then gives the key
--                 its next head, invariant 9);
--   retry         'pending' after the delay, the attempt kept; 'dead' once attempts are spent;
--   defer,
--   rate_limited  'pending' after the delay, the attempt refunded; 'dead' once it would wait
--                 past max_defer_age (a rate_limited row's hold: flow_hold, same transaction);
--   dead          'dead' with the error;
--   error         a failed attempt (invariant 31): as retry, after the backoff's delay;
--   postpone      'pending' after the delay, the attempt refunded (no handler here, unroutable);
--   release       'pending' now, nothing spent, only while the claim never started (a publish
--                 that failed; a worker that started the claim keeps its row, invariant 12);
--   hand_back     'pending' now, the attempt refunded, last_error kept: a pack's row whose
--                 handler its task did not run (invariant 30).
-- A group's member's final steps are finished by finish_grouped instead (DESIGN invariant 29).
-- commit_mode as in start (the completer relaxes only an all-done finalize). With notify the
-- table's listeners hear at commit that leases ended (a claim that the in-flight bound stopped
-- runs again then), on the channel the producers' insert signals.
{finish_update}
  -- A group's member goes through finish_grouped, which counts it (the completer knows from
  -- the fenced start; a row sent here by mistake is left alone, as a lost lease), but for the
  -- steps that never make a row done or dead: they never change a group's count (invariant 29),
  -- so the completer sends them here whatever the row (the steps not final in outcomes.STEPS).
  AND (o.group_id IS NULL OR f.outcome IN ({steps_not_final}))
RETURNING o.id, o.status, f.outcome, o.event_type, o.limit_key, o.ordering_key, f.delay;

-- name: finish_grouped
-- finish for rows of which some may be a group's member (DESIGN invariant 29): the same update,
-- and in the same statement a member that reached done or dead counts in its group's row
-- (group_settle); the last one enqueues the group's callback. The fence makes it once per row.
-- Its own statement, so that finish, the one-message handler's, opens neither the groups'
-- table nor the outbox's indexes for an insert.
WITH fin AS (
{finish_update}
RETURNING o.id, o.status, f.outcome, o.event_type, o.limit_key, o.ordering_key, f.delay,
          o.group_id, o.last_error
),
group_moves AS (
    SELECT group_id, id, event_type, last_error,
           (status = 'done')::int AS d_done, (status = 'dead')::int AS d_dead
    FROM fin WHERE group_id IS NOT NULL AND status IN ('done', 'dead')
),
{group_settle}
SELECT id, status, outcome, event_type, limit_key, ordering_key, delay FROM fin;

-- fragment: finish_update
-- The update of finish and finish_grouped, written once (every outcome's rule).
UPDATE {table} AS o
SET status = CASE
        WHEN f.outcome IN ('done', 'dead') THEN f.outcome
        WHEN f.outcome IN ('retry', 'error') AND {attempts_spent} THEN 'dead'
        WHEN f.outcome IN ('defer', 'rate_limited') AND {past_max_defer_age} THEN 'dead'
        ELSE 'pending' END,
    attempts = CASE WHEN f.outcome IN ('defer', 'rate_limited', 'postpone', 'hand_back')
                    THEN greatest(o.attempts - 1, 0) ELSE o.attempts END,
    available_at = CASE
        WHEN f.outcome IN ('release', 'hand_back') THEN now()
        WHEN f.outcome IN ('defer', 'rate_limited', 'postpone')
             OR f.outcome IN ('retry', 'error') AND NOT {attempts_spent}
        THEN now() + make_interval(secs => f.delay)
        ELSE o.available_at END,
    lease_until = NULL,
    done_at = CASE WHEN f.outcome = 'done' THEN now() ELSE o.done_at END,
    last_error = CASE
        WHEN f.outcome IN ('done', 'release', 'hand_back') THEN o.last_error
        WHEN f.outcome IN ('retry', 'error') AND {attempts_spent}
        THEN 'attempts exhausted (' || o.attempts || ' of ' || %(max_attempts)s::int || '): '
             || f.error
        WHEN f.outcome IN ('defer', 'rate_limited')
        THEN CASE f.outcome WHEN 'defer' THEN 'deferred' ELSE 'rate limited' END
             || CASE WHEN {past_max_defer_age} THEN ' past max_defer_age: ' ELSE ': ' END
             || f.error
        ELSE f.error END,
    -- Every failed attempt is recorded (DESIGN invariant 32): retry, error and dead end an
    -- attempt the start counted, with the error given (going dead once attempts are spent
    -- included). done, release, hand_back and postpone are no failure; a defer or RateLimited
    -- refunds its attempt, so it is none either, even when it goes dead past max_defer_age.
    errors = CASE WHEN f.outcome IN ('retry', 'error', 'dead') THEN {errors_appended}
                  ELSE o.errors END
FROM {commit_mode},
     {wake_listeners} AS woke,
     {finishes} AS f(id, lease_version, outcome, delay, error),
     LATERAL (VALUES (f.error)) AS failure(error)
WHERE o.id = f.id AND o.lease_version = f.lease_version AND {fenced_processing}
  AND f.outcome IN ({steps})
  AND (f.outcome <> 'done' OR o.ordering_key IS NULL OR %(keys_locked)s::bool)
  AND (f.outcome <> 'release' OR o.started_version < o.lease_version)

-- fragment: errors_cap
-- The entries a row's errors keep (DESIGN invariant 32): the last 20 failed attempts, so that
-- a row retried for days stays small (20 entries of at most 1,000 characters of error each).
20

-- fragment: errors_appended
-- The row's errors with one more entry, written once for every failed attempt (DESIGN
-- invariant 32): the attempt (o.attempts, counted at its start), the database's now() and the
-- error of the statement's row source "failure", cut to 1,000 characters; the oldest entries
-- beyond errors_cap dropped. NULL (never failed) starts an empty list.
(SELECT jsonb_agg(kept.e ORDER BY kept.n)
 FROM (SELECT a.e, a.n
       FROM jsonb_array_elements(
                coalesce(o.errors, '[]'::jsonb)
                || jsonb_build_array(jsonb_build_object('attempt', o.attempts, 'at', now(),
                                                        'error', left(failure.error, 1000))))
            WITH ORDINALITY AS a(e, n)
       ORDER BY a.n DESC
       LIMIT {errors_cap}) AS kept)

-- fragment: lease_lost
-- The error an attempt records when its lease ran out after its start with no outcome written
-- (its worker died or hung mid-handler; DESIGN invariant 32): the row source "failure" of
-- errors_appended in claim_expired, reap, release_expired and release_keyed_expired.
(VALUES ('lease expired without a result (worker lost or timed out)'::text)) AS failure(error)

-- fragment: attempts_spent
-- A retry or a failed attempt at the limit goes dead (finish).
o.attempts >= %(max_attempts)s

-- fragment: past_max_defer_age
-- A defer or RateLimited row that would wait past max_defer_age goes dead (finish).
now() + make_interval(secs => f.delay) > o.created_at + make_interval(secs => %(max_age)s)

-- fragment: hold_until
-- The end of a RateLimited hold (flow_hold): the longest delay asked, for max_defer_age at most
-- (invariant 25).
now() + make_interval(secs => least(max(delay), %(max_hold)s::float8))

-- name: flow_hold
-- The hold of RateLimited outcomes (DESIGN invariant 23), in the transaction of their finish:
-- each row's event type held until now() + its delay in the flow table (its limit key only, in
-- the key table, when it has one: invariant 24), for max_defer_age at most (invariant 25: the
-- type's later messages are claimed again, and go dead past max_defer_age, instead of sitting
-- unclaimed); a later hold never shortens an earlier one. Only rows whose fenced finish won come
-- here (a lost lease holds nothing).
WITH h AS (
    SELECT * FROM unnest(%(event_types)s::text[], %(limit_keys)s::text[], %(delays)s::float8[])
        AS h(event_type, limit_key, delay)
),
held AS (
    INSERT INTO {flow_table} AS f (event_type, paused_until)
    SELECT event_type, {hold_until} FROM h WHERE limit_key IS NULL
    GROUP BY event_type
    ON CONFLICT (event_type) DO UPDATE
    SET paused_until = greatest(f.paused_until, excluded.paused_until), updated_at = now()
    RETURNING f.event_type
),
key_held AS (
    INSERT INTO {flow_key_table} AS f (event_type, limit_key, paused_until)
    SELECT event_type, limit_key, {hold_until} FROM h WHERE limit_key IS NOT NULL
    GROUP BY event_type, limit_key
    ON CONFLICT (event_type, limit_key) DO UPDATE
    SET paused_until = greatest(f.paused_until, excluded.paused_until), updated_at = now()
    RETURNING f.event_type
)
SELECT (SELECT count(*) FROM held) + (SELECT count(*) FROM key_held);

-- name: follow_ups_at_commit
-- The rows a transactional handler enqueued in its transaction (DESIGN invariants 18, 20), when
-- that transaction ran long: they were given the transaction's start (now()) plus their delay,
-- and would commit behind the claims' scan marks. Run just before the done, in the same
-- transaction: those already due move to this statement's time, at the commit, never before
-- now(); a row whose delay runs further keeps it. The rows are the transaction's own, uncommitted:
-- nobody else sees or locks them; the primary key finds them.
-- An event's other subscriptions' rows (payload_of, DESIGN invariant 28) move with it.
UPDATE {table}
SET available_at = statement_timestamp()
WHERE (id = ANY(%(ids)s::bigint[]) OR payload_of = ANY(%(ids)s::bigint[]))
  AND status = 'pending' AND available_at < statement_timestamp();

-- name: transaction_limits
-- First statement of a transactional handler's transaction (DESIGN invariant 20): bounds it
-- below the lease, for this transaction only (is_local). statement_timeout cancels a statement
-- that runs longer (an error: the transaction rolls back); idle_in_transaction_session_timeout
-- ends the session when the handler leaves the transaction idle that long (the server rolls it
-- back). PostgreSQL 17 added transaction_timeout, a bound on the whole transaction: set too where
-- the server has it (the CASE never evaluates the name on an older server, which would refuse
-- it). None of them is needed for correctness: the fenced done, last in the transaction, rolls
-- back a run whose claim was superseded; they bound how long its locks are held.
SELECT set_config('statement_timeout', %(ms)s::text, true) AS statement_timeout,
       set_config('idle_in_transaction_session_timeout', %(ms)s::text, true) AS idle_timeout,
       CASE WHEN current_setting('server_version_num')::int >= 170000
            THEN set_config('transaction_timeout', %(ms)s::text, true) END AS transaction_timeout,
       current_setting('transaction_isolation') AS isolation;

-- name: extend_lease
-- The lease heartbeat of one claim or many: lease_until = max(lease_until, now() + seconds),
-- each pair fenced on its own version.
UPDATE {table} AS o
SET lease_until = greatest(o.lease_until, now() + make_interval(secs => %(seconds)s))
FROM {leases} AS e(id, lease_version)
WHERE o.id = e.id AND o.lease_version = e.lease_version AND {fenced_processing}
RETURNING o.id;

-- name: canonical_name
-- The table as PostgreSQL resolves it, schema included: the base of idempotency keys, so that
-- "outbox" and "public.outbox" (one table) give every message one key (DESIGN invariant 11).
SELECT n.nspname AS schema_name, c.relname AS table_name
FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE c.oid = %(table)s::regclass;

-- name: instance
-- Whether the table's identity (migration 0006), the discriminator of idempotency keys, can
-- be read: 'missing' while the table is not migrated yet (to_regclass: no error for a missing
-- table), 'denied' when this role may not read it (a worker role granted the outbox table only).
SELECT CASE WHEN to_regclass(%(instance_table)s) IS NULL THEN 'missing'
            WHEN has_table_privilege(to_regclass(%(instance_table)s), 'SELECT') THEN 'ok'
            ELSE 'denied' END AS state;

-- name: instance_id
SELECT instance::text AS instance FROM {instance_table};

-- name: settle_heads
-- The one definition of giving a key its head back, under the keys' locks (the statement before
-- takes them): after an ordered done (the completer, in the transaction of its finish), a skip
-- (admin), a batch insert that dropped a key's first row as a duplicate dedup key (producer),
-- or a repair of keys an older release left without a head
-- (admin repair-heads). The lowest unfinished message of each key that has no unfinished
-- head becomes its head. A key that has one is left alone: by invariant 9 that head is its
-- lowest unfinished message already (a processing head while a message behind it was skipped).
-- The new head enters the heads index at the time it became claimable, never behind the claims'
-- scan marks (DESIGN invariant 18); a later available_at (a delayed event) is kept. The
-- statement's time, not the transaction's: a transactional handler's done ends a transaction
-- that may have run for longer than scan_lookback.
UPDATE {table} AS o
SET head = true, available_at = greatest(o.available_at, statement_timestamp())
FROM (SELECT DISTINCT k FROM unnest(%(keys)s::text[]) AS u(k)) AS keys,
     LATERAL (SELECT id FROM {table}
              WHERE ordering_key = keys.k AND status <> 'done'
              ORDER BY id
              LIMIT 1) AS first
WHERE o.id = first.id AND NOT o.head
  AND NOT EXISTS (SELECT 1 FROM {table} AS h
                  WHERE h.ordering_key = keys.k AND h.status <> 'done' AND h.head)
RETURNING o.id, o.ordering_key;

-- name: notify_channel
-- The channel the producer's insert signals on (pg_notify in insert / insert_many); the
-- listener LISTENs on it (as an identifier).
SELECT {notify_channel} AS channel;

-- name: notify
-- Wake this table's listeners (at commit; at once on an autocommit connection) on the channel
-- of notify_channel and insert's pg_notify, with a payload saying why: a finished delivery of
-- a concurrency-limited event type freed a slot (the listener answers it only while a
-- limit holds a type back).
SELECT pg_notify({notify_channel}, %(payload)s);

-- name: next_due
-- Seconds (database clock) until the next row of these event types becomes claimable within
-- the next %(within)s seconds: a delayed, backed-off or deferred pending row or ordered head
-- (a message behind its key's head waits for the head, not for the clock), or a live lease
-- running out. NULL when nothing comes due that soon. Each branch is one probe of a partial
-- index ordered by that time, bounded to the window: the leases of the last lease period
-- (finished ones too, while a pinned xmin horizon keeps their dead versions) lie between now()
-- and the next live lease end, and only a window's worth of them is stepped over (invariant 18).
-- With %(probe)s (an idle sweep, DESIGN invariant 36), "due" also says whether a claim run would
-- find anything to do now; without, it is false and its probes do not run (a false AND is not
-- evaluated further). "Anything" is broad: a due pending row or ordered head of any type
-- (unroutable, a subscribed type's bare rows, a type paused or held by a limit) or a lease that
-- ran out (lost, unroutable, exhausted, a worker that died). A false yes costs the claim run
-- every sweep made before; a false no would strand a row, so these probes have no lower bound:
-- each reads the first live entry of its partial index (the earliest due row, head or lease
-- end), stepping over the dead entries before it, as a claim's full pass does.
SELECT %(probe)s::boolean AND coalesce(least(
    (SELECT available_at FROM {table}
     WHERE status = 'pending' AND ordering_key IS NULL ORDER BY available_at, id LIMIT 1),
    (SELECT available_at FROM {table} WHERE status = 'pending' AND head ORDER BY available_at, id LIMIT 1),
    (SELECT lease_until FROM {table} WHERE status = 'processing' ORDER BY lease_until LIMIT 1)
) <= now(), false) AS due,
extract(epoch FROM least(
    (SELECT available_at FROM {table}
     WHERE status = 'pending' AND ordering_key IS NULL AND available_at > now()
       AND available_at <= now() + make_interval(secs => %(within)s)
       AND (%(event_types)s::text[] IS NULL OR event_type = ANY(%(event_types)s::text[]))
     ORDER BY available_at, id LIMIT 1),
    (SELECT available_at FROM {table}
     WHERE status = 'pending' AND head AND available_at > now()
       AND available_at <= now() + make_interval(secs => %(within)s)
       AND (%(event_types)s::text[] IS NULL OR event_type = ANY(%(event_types)s::text[]))
     ORDER BY available_at, id LIMIT 1),
    (SELECT lease_until FROM {table}
     WHERE status = 'processing' AND lease_until > now()
       AND lease_until <= now() + make_interval(secs => %(within)s)
     ORDER BY lease_until LIMIT 1)
) - now())::float8 AS seconds;

-- name: flow_exists
-- Whether the flow-control tables (migrations 0007 and 0008) are there: a claim of a table
-- not migrated yet runs without pauses and limits (and says so in the log) instead of failing.
SELECT to_regclass(%(flow_table)s) IS NOT NULL AND to_regclass(%(flow_key_table)s) IS NOT NULL AS ready;

-- name: flow_lock
-- The flow-control rows of the event types this claim limits or claims key by key (DESIGN
-- invariants 22 to 25), every one of which exists (flow_add ran first, before any flow lock):
-- locked in event-type order, the one order every claimer takes them in, so concurrent claimers
-- never deadlock on them and serialize on these small rows; the live deliveries the next
-- statement counts (a new snapshot under read committed) include everything an earlier claimer
-- handed out. Types merely paused or held are left out of the claim as claim_settings_flow read
-- them and need no lock. One row per type, never the backlog.
SELECT event_type, paused, coalesce(paused_until > now(), false) AS held,
       extract(epoch FROM paused_until - now())::float8 AS held_for,
       tokens, extract(epoch FROM now() - refilled_at)::float8 AS since_refill, key_cursor, at_cap
FROM {flow_table}
WHERE event_type = ANY(%(limited)s::text[])
ORDER BY event_type
FOR UPDATE;

-- name: flow_add
-- A row for each limited event type that has none yet (the first claim that limits it), in
-- event-type order, before the claim holds any flow lock: a claim never waits for another's
-- new row while it holds an existing one (flow_lock).
INSERT INTO {flow_table} (event_type)
SELECT DISTINCT t FROM unnest(%(types)s::text[]) AS u(t) ORDER BY t
ON CONFLICT (event_type) DO NOTHING;

-- name: flow_live
-- Live deliveries of the limited event types (DESIGN invariant 22): processing rows whose lease
-- has not run out, claimed or running, on any worker. Read through the leases' partial index
-- (lease_until, status = 'processing') from now(): the entries of one lease period, as
-- count_in_flight. A worker that died holds its slot only until its lease ends.
SELECT event_type, count(*) AS live
FROM {table}
WHERE status = 'processing' AND lease_until > now() AND event_type = ANY(%(limited)s::text[])
GROUP BY event_type;

-- name: flow_at_cap
-- After a claim, under the flow rows' lock: the concurrency-limited types whose at_cap flag
-- changed (DESIGN invariant 22). Written only on a change, so a type that stays at (or below)
-- its limit leaves no row version per claim.
UPDATE {flow_table} AS f
SET at_cap = u.at_cap, updated_at = now()
FROM unnest(%(types)s::text[], %(flags)s::boolean[]) AS u(event_type, at_cap)
WHERE f.event_type = u.event_type;

-- name: flow_capped
-- The event types among these that the last claim left at their concurrency limit: a worker
-- reads it (at most every AT_CAP_TTL per process) to decide whether a finish frees a slot the
-- claim waits for.
SELECT event_type FROM {flow_table} WHERE at_cap AND event_type = ANY(%(types)s::text[]);

-- name: flow_spend
-- The rate buckets after a claim: the tokens left and the time they were counted at (the
-- transaction's now(), never moved back by a claimer whose transaction began earlier).
UPDATE {flow_table} AS f
SET tokens = u.tokens,
    -- Never moved back by a claimer whose transaction began earlier; but a bucket refilled more
    -- than a minute ahead of now() was written before the database's clock stepped back (a
    -- failover to a lagging host): it counts from now(), granting nothing for the gap.
    refilled_at = CASE WHEN f.refilled_at > now() + interval '60 seconds' THEN now()
                       ELSE greatest(coalesce(f.refilled_at, now()), now()) END,
    updated_at = now()
FROM unnest(%(types)s::text[], %(tokens)s::float8[]) AS u(event_type, tokens)
WHERE f.event_type = u.event_type;

-- name: claim_expired_limited
-- claim_expired for the limited event types (DESIGN invariant 22), all in one statement:
-- per type (types[i]), at most limits[i] rows, from that type's own scan mark (since[i]). One
-- index read per type; the allowances were decided under the flow rows' lock. Here and in the
-- two statements after it, the rows of a keyed type that carry a limit key are left to
-- release_keyed_expired and claim_keyed (DESIGN invariant 24).
WITH picked AS (
    SELECT p.id
    FROM unnest(%(types)s::text[], %(limits)s::int[], %(since)s::timestamptz[]) AS u(event_type, n, since),
    LATERAL (
        SELECT id FROM {table}
        WHERE status = 'processing' AND lease_until <= now()
          AND lease_until >= coalesce(u.since, '-infinity')
          AND attempts < %(max_attempts)s
          AND started_version = lease_version
          AND event_type = u.event_type
          AND (limit_key IS NULL OR event_type <> ALL(%(keyed)s::text[]))
        ORDER BY lease_until
        LIMIT u.n
        FOR UPDATE SKIP LOCKED
    ) AS p
)
{claim_picked};

-- name: claim_heads_limited
-- claim_heads for the limited event types, as claim_expired_limited: heads only (invariant 9).
WITH picked AS (
    SELECT p.id
    FROM unnest(%(types)s::text[], %(limits)s::int[], %(since)s::timestamptz[]) AS u(event_type, n, since),
    LATERAL (
        SELECT id FROM {table}
        WHERE status = 'pending' AND head AND available_at <= now()
          AND available_at >= coalesce(u.since, '-infinity')
          AND event_type = u.event_type
          AND (limit_key IS NULL OR event_type <> ALL(%(keyed)s::text[]))
        ORDER BY available_at, id
        LIMIT u.n
        FOR UPDATE SKIP LOCKED
    ) AS p
)
{claim_picked};

-- name: claim_pending_limited
-- claim_pending for the limited event types, as claim_expired_limited.
WITH picked AS (
    SELECT p.id
    FROM unnest(%(types)s::text[], %(limits)s::int[], %(since)s::timestamptz[]) AS u(event_type, n, since),
    LATERAL (
        SELECT id FROM {table}
        WHERE status = 'pending' AND ordering_key IS NULL AND available_at <= now()
          AND available_at >= coalesce(u.since, '-infinity')
          AND event_type = u.event_type
          AND (limit_key IS NULL OR event_type <> ALL(%(keyed)s::text[]))
        ORDER BY available_at, id
        LIMIT u.n
        FOR UPDATE SKIP LOCKED
    ) AS p
)
{claim_picked};

-- name: fill_due
-- Batch handlers with max_wait (DESIGN invariant 21): per event type (types[i]), its due
-- unordered rows counted up to limits[i] (a full batch: no need to count further), and how long
-- (the database's clock) the oldest of them has been due. One read of the pending index per
-- type from its scan mark (since[i], DESIGN invariant 18), stopping at limits[i] rows; a type
-- with no due row has n = 0 and no age. Ordered rows are not counted: max_wait never holds a
-- key's head.
SELECT u.event_type, d.n, extract(epoch FROM now() - d.oldest)::float8 AS waited
FROM unnest(%(types)s::text[], %(limits)s::int[], %(since)s::timestamptz[]) AS u(event_type, n, since),
LATERAL (
    SELECT count(*)::int AS n, min(due.available_at) AS oldest
    FROM (
        SELECT available_at FROM {table}
        WHERE status = 'pending' AND ordering_key IS NULL AND available_at <= now()
          AND available_at >= coalesce(u.since, '-infinity')
          AND event_type = u.event_type
        ORDER BY available_at, id
        LIMIT u.n
    ) AS due
) AS d
ORDER BY u.event_type;

-- name: flow_keys_clear
-- Key holds that ran out, of the types this claim locked (their flow rows, so after the lock:
-- one lock order), cleared so that they leave the held keys' index: one range of the holds'
-- index (migration 0009), the holds that ended since the last claim.
UPDATE {flow_key_table} SET paused_until = NULL
WHERE paused_until IS NOT NULL AND paused_until <= now()
  AND event_type = ANY(%(types)s::text[]);

-- name: release_keyed_expired
-- Started leases of a keyed event type that ran out with attempts left (the worker died or hung
-- mid-handler; DESIGN invariants 22, 24): back to pending, due as before (at the front of their
-- key), where claim_keyed takes them under their key's limit. Re-claiming them in place, as
-- claim_expired does, would not see the key's other live deliveries. The attempt stays counted:
-- the next start counts another, as a re-claim's would.
WITH picked AS (
    SELECT id FROM {table}
    WHERE status = 'processing' AND lease_until <= now()
      AND lease_until >= coalesce(%(expired_since)s::timestamptz, '-infinity')
      AND attempts < %(max_attempts)s
      AND started_version = lease_version
      AND limit_key IS NOT NULL AND event_type = ANY(%(keyed)s::text[])
    ORDER BY lease_until
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS o
SET status = 'pending', lease_until = NULL,
    -- The started attempt ended without a result: recorded (DESIGN invariant 32).
    errors = {errors_appended}
FROM picked, {lease_lost}
WHERE o.id = picked.id
RETURNING o.id;

-- name: claim_keyed
-- The rows of one keyed event type (DESIGN invariant 24) that carry a limit key, round robin
-- between its keys: at most %(n)s rows in all, none of a key at its key_cap (live deliveries of
-- the key counted from the key leases' index, after the flow row's lock) and none of a key paused
-- or held (read here, after the lock).
-- The keys are walked in key order from the one after %(after)s (where the previous claim of the
-- type stopped, kept in its flow row), wrapping around, at most %(max_keys)s of them: one probe
-- of the keyed index per key (a loose index scan), never the backlog behind a key. Each key
-- offers its oldest due rows (heads only for ordered keys, invariant 9), at most twice its fair
-- share of n; the claim takes the first row of every key, then the second, and so on.
-- The CTEs are named ck_* so that no outbox table name can be shadowed by one of them.
-- key_rate bounds each key's starts by a token bucket in its <table>_flow_key row, read and
-- written here, under the type's flow-row lock (as the type's own rate bucket).
-- The last row (id NULL) holds the last key walked, counts the keys this claim left at their
-- key_cap with a row still due (the listener claims again soon, as for a type at its
-- concurrency limit) and the seconds until a key held by its key_rate has its next token.
WITH RECURSIVE ck_after AS (
    (SELECT limit_key AS k, 1 AS pos FROM {table}
     WHERE status = 'pending' AND limit_key IS NOT NULL AND (ordering_key IS NULL OR head)
       AND event_type = %(event_type)s
       AND (%(after)s::text IS NULL OR limit_key > %(after)s::text)
     ORDER BY event_type, limit_key LIMIT 1)
    UNION ALL
    SELECT (SELECT limit_key FROM {table}
            WHERE status = 'pending' AND limit_key IS NOT NULL AND (ordering_key IS NULL OR head)
              AND event_type = %(event_type)s AND limit_key > a.k
            ORDER BY event_type, limit_key LIMIT 1), a.pos + 1
    FROM ck_after AS a
    WHERE a.k IS NOT NULL AND a.pos < %(max_keys)s
),
-- The wrap-around, only when the keys after the cursor did not fill the walk.
ck_before AS (
    (SELECT limit_key AS k, 1 AS pos FROM {table}
     WHERE status = 'pending' AND limit_key IS NOT NULL AND (ordering_key IS NULL OR head)
       AND event_type = %(event_type)s AND %(after)s::text IS NOT NULL
       AND limit_key <= %(after)s::text
       AND (SELECT count(*) FROM ck_after WHERE k IS NOT NULL) < %(max_keys)s
     ORDER BY event_type, limit_key LIMIT 1)
    UNION ALL
    SELECT (SELECT limit_key FROM {table}
            WHERE status = 'pending' AND limit_key IS NOT NULL AND (ordering_key IS NULL OR head)
              AND event_type = %(event_type)s AND limit_key > b.k AND limit_key <= %(after)s::text
            ORDER BY event_type, limit_key LIMIT 1), b.pos + 1
    FROM ck_before AS b
    WHERE b.k IS NOT NULL AND b.pos < %(max_keys)s
),
ck_walked AS (
    SELECT k, pos FROM ck_after WHERE k IS NOT NULL
    UNION ALL
    SELECT k, pos + (SELECT count(*) FROM ck_after WHERE k IS NOT NULL) FROM ck_before
    WHERE k IS NOT NULL
),
-- Keys paused or held are walked (the cursor moves past them) but offer nothing: one probe of
-- the key table's primary key per key walked, read after the flow row's lock.
ck_keys AS (
    SELECT k, pos, count(*) OVER () AS walked_keys FROM ck_walked
    WHERE pos <= %(max_keys)s
      AND NOT EXISTS (SELECT 1 FROM {flow_key_table} AS h
                      WHERE h.event_type = %(event_type)s AND h.limit_key = ck_walked.k
                        AND (h.paused OR h.paused_until > now()))
),
ck_rooms AS (
    SELECT ck_keys.k, ck_keys.pos,
           coalesce(%(key_cap)s::int - live.n, %(n)s) AS slots,
           bucket.tokens,
           least(coalesce(%(key_cap)s::int - live.n, %(n)s),
                 coalesce(floor(bucket.tokens)::int, %(n)s),
                 ceil(2.0 * %(n)s / ck_keys.walked_keys)::int) AS room
    FROM ck_keys
    CROSS JOIN LATERAL (
        SELECT count(*)::int AS n FROM {table}
        WHERE status = 'processing' AND limit_key IS NOT NULL
          AND event_type = %(event_type)s AND limit_key = ck_keys.k AND lease_until > now()
    ) AS live
    -- key_rate: the key's token bucket refilled to now() (no row yet: a full bucket).
    CROSS JOIN LATERAL (
        SELECT CASE WHEN %(key_rate)s::float8 IS NOT NULL THEN least(
                   %(key_burst)s::float8,
                   -- A bucket refilled ahead of now() (the clock stepped back) refills
                   -- nothing until ck_reclock's write, then counts from now().
                   coalesce((SELECT greatest(f.tokens, 0)
                                    + %(key_rate)s::float8
                                      * greatest(extract(epoch FROM now() - f.refilled_at), 0)
                             FROM {flow_key_table} AS f
                             WHERE f.event_type = %(event_type)s AND f.limit_key = ck_keys.k
                               AND f.tokens IS NOT NULL),
                            %(key_burst)s::float8)) END AS tokens
    ) AS bucket
),
ck_offered AS (
    SELECT c.id, c.available_at, ck_rooms.k, ck_rooms.pos,
           row_number() OVER (PARTITION BY ck_rooms.k ORDER BY c.available_at, c.id) AS rn
    FROM ck_rooms
    CROSS JOIN LATERAL (
        SELECT id, available_at FROM {table}
        WHERE status = 'pending' AND limit_key IS NOT NULL AND (ordering_key IS NULL OR head)
          AND event_type = %(event_type)s AND limit_key = ck_rooms.k AND available_at <= now()
        ORDER BY event_type, limit_key, available_at, id
        LIMIT greatest(ck_rooms.room, 0)
        FOR UPDATE SKIP LOCKED
    ) AS c
),
ck_picked AS (
    SELECT id, pos, k FROM ck_offered ORDER BY rn, pos LIMIT %(n)s
),
ck_taken AS (
    SELECT k, count(*) AS n FROM ck_picked GROUP BY k
),
-- The key_rate buckets of the keys served: the refilled tokens minus what this claim took.
ck_spent AS (
    INSERT INTO {flow_key_table} AS f (event_type, limit_key, tokens, refilled_at, full_at)
    SELECT %(event_type)s, r.k, r.tokens - t.n, now(),
           -- When the bucket is full again: past it the row may be pruned (flow_keys_prune).
           now() + make_interval(secs => greatest(%(key_burst)s::float8 - (r.tokens - t.n), 0)
                                         / %(key_rate)s::float8)
    FROM ck_taken AS t JOIN ck_rooms AS r ON r.k = t.k
    WHERE r.tokens IS NOT NULL
    ON CONFLICT (event_type, limit_key) DO UPDATE
    SET tokens = excluded.tokens, refilled_at = excluded.refilled_at, full_at = excluded.full_at,
        updated_at = now(),
        -- A key served is not held: an expired hold leaves the held keys' index.
        paused_until = CASE WHEN f.paused_until > now() THEN f.paused_until END
),
-- Buckets of the keys walked that were refilled more than a minute ahead of now(): written
-- before the database's clock stepped back. They count from now() from the next claim on
-- (this claim refills them nothing): neither a stall until the clock catches up nor a grant
-- for the gap. Bounded by the keys walked.
ck_reclock AS (
    UPDATE {flow_key_table} AS f SET refilled_at = now(), updated_at = now()
    FROM ck_keys
    WHERE f.event_type = %(event_type)s AND f.limit_key = ck_keys.k
      AND f.refilled_at > now() + interval '60 seconds'
      AND NOT EXISTS (SELECT 1 FROM ck_taken WHERE ck_taken.k = ck_keys.k)
),
-- The keys this claim left at a limit with a row still due (the statement's snapshot still
-- shows the rows it claimed as pending, hence "more than taken").
ck_left AS (
    SELECT r.k, r.slots, r.tokens, coalesce(t.n, 0) AS taken
    FROM ck_rooms AS r LEFT JOIN ck_taken AS t ON t.k = r.k
    WHERE (r.slots <= coalesce(t.n, 0) OR floor(r.tokens) <= coalesce(t.n, 0))
      AND (SELECT count(*) FROM (
               SELECT 1 FROM {table}
               WHERE status = 'pending' AND limit_key IS NOT NULL
                 AND (ordering_key IS NULL OR head)
                 AND event_type = %(event_type)s AND limit_key = r.k
                 AND available_at <= now()
               LIMIT coalesce(t.n, 0) + 1) AS due) > coalesce(t.n, 0)
),
ck_claimed AS (
    UPDATE {table} AS o
    SET status = 'processing',
        lease_owner = %(owner)s,
        lease_until = now() + make_interval(secs => %(lease)s),
        lease_version = o.lease_version + 1
    FROM ck_picked
    WHERE o.id = ck_picked.id
    RETURNING o.id, o.lease_version, o.event_type, o.lease_until, o.available_at, o.limit_key,
              ck_picked.pos, o.attempts
)
SELECT id, lease_version, event_type, lease_until, available_at, limit_key, pos, NULL::bigint AS blocked,
       NULL::float8 AS token_wait, attempts
FROM ck_claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL,
       -- The last key walked, paused and held ones included: a window of held keys never
       -- keeps the cursor (and the keys behind it) still.
       (SELECT k FROM ck_walked WHERE pos <= %(max_keys)s ORDER BY pos DESC LIMIT 1), NULL,
       (SELECT count(*) FROM ck_left WHERE slots <= taken),
       -- Seconds until the first key held by its key_rate alone has its next token.
       (SELECT min((1 - (tokens - taken)) / %(key_rate)s::float8) FROM ck_left
        WHERE slots > taken AND floor(tokens) <= taken),
       NULL;

-- name: flow_key_cursor
-- Where the next claim of each keyed event type starts walking its keys (round robin, DESIGN
-- invariant 24): the last key this claim took a row of. Written under the flow row's lock.
UPDATE {flow_table} AS f
SET key_cursor = u.k, updated_at = now()
FROM unnest(%(types)s::text[], %(keys)s::text[]) AS u(event_type, k)
WHERE f.event_type = u.event_type;

-- fragment: group_settle
-- The one definition of counting a group's outcomes (DESIGN invariant 29). The statement that
-- writes a member's final outcome names what it changed "group_moves" (group_id, id, event_type,
-- last_error, d_done, d_dead: +1 for an outcome reached, -1 for one undone by an operator's
-- requeue or skip) and this follows it in the same statement, so the count commits with the
-- outcome, once per row, as the fenced write itself. Only open groups count. Each open group is
-- locked (in id order: two finalizers never deadlock) and read at its latest version (FOR
-- UPDATE waits for a concurrent finalizer's commit and re-reads the row), so exactly one
-- finalizer sees done + dead reach total; the lock is held to the end of this finalize only.
-- That finalizer closes the group: 'skipped' when a member is dead and skip_on_dead, else
-- 'fired' with the callback's event inserted here (its id drawn in the group's update, so the
-- group row records it), its payload the declared object plus "outbox_group": the counts and
-- the first dead members (at most 100; group_outcomes in admin.sql reads them all). A new
-- callback wakes the table's listeners at commit (push).
gs_moves AS (
    SELECT group_id, sum(d_done)::int AS d_done, sum(d_dead)::int AS d_dead,
           coalesce(jsonb_agg(jsonb_build_object('id', id, 'event_type', event_type,
                                                 'last_error', left(last_error, 1000)) ORDER BY id)
                    FILTER (WHERE d_dead > 0), '[]'::jsonb) AS died,
           coalesce(array_agg(id) FILTER (WHERE d_dead < 0), ARRAY[]::bigint[]) AS revived
    FROM group_moves GROUP BY group_id
),
gs_old AS (
    SELECT g.id, g.total, g.done, g.dead, g.skip_on_dead, g.dead_members
    FROM {group_table} AS g
    WHERE g.id IN (SELECT group_id FROM gs_moves) AND g.state = 'open'
    ORDER BY g.id
    FOR UPDATE
),
gs_sums AS (
    SELECT o.id, o.done + m.d_done AS done, o.dead + m.d_dead AS dead,
           o.done + m.d_done + o.dead + m.d_dead >= o.total AS complete,
           o.skip_on_dead AND o.dead + m.d_dead > 0 AS skip,
           CASE WHEN m.died = '[]'::jsonb AND m.revived = ARRAY[]::bigint[] THEN o.dead_members
           ELSE (SELECT coalesce(jsonb_agg(e ORDER BY (e ->> 'id')::bigint), '[]'::jsonb)
                 FROM (SELECT e FROM jsonb_array_elements(o.dead_members || m.died) AS e
                       WHERE (e ->> 'id')::bigint <> ALL(m.revived)
                       ORDER BY (e ->> 'id')::bigint LIMIT 100) AS kept) END AS dead_members
    FROM gs_old AS o JOIN gs_moves AS m ON m.group_id = o.id
),
gs_new AS (
    UPDATE {group_table} AS g
    SET done = s.done, dead = s.dead, dead_members = s.dead_members,
        state = CASE WHEN NOT s.complete THEN 'open' WHEN s.skip THEN 'skipped' ELSE 'fired' END,
        closed_at = CASE WHEN s.complete THEN now() END,
        callback_id = CASE WHEN s.complete AND NOT s.skip
                           THEN nextval(pg_get_serial_sequence(%(table)s::text, 'id')) END
    FROM gs_sums AS s
    WHERE g.id = s.id
    RETURNING g.*
),
gs_fired AS ({group_callback}),
gs_fired_subs AS ({group_callback_subs})

-- fragment: group_callback
-- The callback's event of every group the statement's "gs_new" closed with a callback id (a
-- group's row as updated, RETURNING g.*): the declared payload object with "outbox_group" added
-- (the counts, the first dead members and whether there were more), due after its delay; it
-- wakes the table's listeners at commit. A callback of a type with subscriptions is fanned out
-- as a producer's event is (invariant 28): this row is its first subscription's and holds the
-- payload, the other subscriptions' rows (group_callback_subs) read it. Written once for
-- group_settle and an operator's finish.
INSERT INTO {table} (id, event_type, aggregate_type, aggregate_id, payload, available_at,
                     trace_context, limit_key)
OVERRIDING SYSTEM VALUE
SELECT n.callback_id,
       coalesce(n.event_type || '@' || (SELECT min(s.name) FROM {subscription_table} AS s
                                        WHERE s.event_type = n.event_type AND s.removed_at IS NULL),
                n.event_type),
       n.aggregate_type, n.aggregate_id,
       (left(rtrim(n.payload::text), -1)
        || CASE WHEN (SELECT count(*) FROM json_object_keys(n.payload)) = 0 THEN '' ELSE ', ' END
        || '"outbox_group": '
        || json_build_object('id', n.id, 'state', n.state, 'total', n.total, 'done', n.done,
                             'dead', n.dead, 'dead_members', n.dead_members,
                             'truncated', n.dead > jsonb_array_length(n.dead_members))::text
        || chr(125))::json,
       now() + make_interval(secs => n.delay), n.trace_context, n.limit_key
FROM gs_new AS n
WHERE n.callback_id IS NOT NULL
RETURNING id, pg_notify({notify_channel}, '') IS NULL AS woke, event_type, aggregate_type,
          aggregate_id, available_at, trace_context, limit_key

-- fragment: group_callback_subs
-- The rows of a fanned-out callback's other subscriptions (group_callback): one per live
-- subscription of its type after the first, each reading the first's payload.
INSERT INTO {table} (event_type, aggregate_type, aggregate_id, payload, payload_of, available_at,
                     trace_context, limit_key)
SELECT s.event_type || '@' || s.name, f.aggregate_type, f.aggregate_id, NULL, f.id,
       f.available_at, f.trace_context, f.limit_key
FROM gs_fired AS f
JOIN {subscription_table} AS s
  ON s.event_type = split_part(f.event_type, '@', 1) AND s.removed_at IS NULL
 AND s.name > split_part(f.event_type, '@', 2) AND strpos(f.event_type, '@') > 0
ORDER BY f.id, s.name
RETURNING id

-- name: subscribed_types
-- The event types with a live subscription: those whose bare rows the claim fans out. None
-- before migration 0011 (no subscription table yet).
SELECT DISTINCT event_type FROM {subscription_table} WHERE removed_at IS NULL ORDER BY event_type;

-- name: subscriptions_exist
-- Whether the subscription table (migration 0011) is there.
SELECT to_regclass(%(subscription_table)s) IS NOT NULL AS ready;

-- name: fan_out_bare
-- The safety net of invariant 28: a pending row of a type with subscriptions but no route (written
-- before the subscriptions were registered, by SQL, by a producer of an older release) becomes
-- what the producer's insert would have written, in the claim's transaction, once: the row itself
-- its first subscription's (it keeps its id, payload and dedup key; its ordering key gets the
-- route), one new row for each other subscription reading its payload, a group's total grown by
-- them. Unordered rows come through the pending index, ordered ones through the ordered index,
-- key by key in id order, so each route's key gets its head as the producer would have given it.
WITH fob_subs AS (
    SELECT event_type, name, row_number() OVER (PARTITION BY event_type ORDER BY name) AS rank
    FROM {subscription_table}
    WHERE event_type = ANY(%(types)s::text[]) AND removed_at IS NULL
),
fob_unordered AS (
    SELECT o.id FROM {table} AS o
    WHERE o.status = 'pending' AND o.ordering_key IS NULL AND o.event_type = ANY(%(types)s::text[])
    ORDER BY o.available_at, o.id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
fob_ordered AS (
    SELECT o.id FROM {table} AS o
    WHERE o.ordering_key IS NOT NULL AND o.status = 'pending' AND o.event_type = ANY(%(types)s::text[])
    ORDER BY o.ordering_key, o.id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
fob_plan AS (
    SELECT o.id, o.event_type || '@' || s.name AS route,
           o.ordering_key || chr(31) || o.event_type || '@' || s.name AS k,
           row_number() OVER (PARTITION BY o.ordering_key ORDER BY o.id) AS nth
    FROM {table} AS o
    JOIN fob_subs AS s ON s.event_type = o.event_type AND s.rank = 1
    WHERE o.id IN (SELECT id FROM fob_unordered UNION ALL SELECT id FROM fob_ordered)
),
fob_owner AS (
    UPDATE {table} AS o
    SET event_type = p.route, ordering_key = p.k,
        head = p.k IS NOT NULL AND p.nth = 1
               AND NOT EXISTS (SELECT 1 FROM {table} AS x WHERE x.ordering_key = p.k AND x.status <> 'done')
    FROM fob_plan AS p
    WHERE o.id = p.id
    RETURNING o.id, o.event_type, o.aggregate_type, o.aggregate_id, o.ordering_key, o.available_at,
              o.trace_context, o.limit_key, o.group_id
),
fob_rest AS (
    SELECT w.id, s.event_type || '@' || s.name AS route, w.aggregate_type, w.aggregate_id,
           split_part(w.ordering_key, chr(31), 1) || chr(31) || s.event_type || '@' || s.name AS k,
           w.available_at, w.trace_context, w.limit_key, w.group_id, s.rank
    FROM fob_owner AS w
    JOIN fob_subs AS s ON s.event_type = split_part(w.event_type, '@', 1) AND s.rank > 1
),
fob_others AS (
    INSERT INTO {table} (event_type, aggregate_type, aggregate_id, payload, payload_of,
                         ordering_key, available_at, head, trace_context, limit_key, group_id)
    SELECT r.route, r.aggregate_type, r.aggregate_id, NULL, r.id, r.k, r.available_at,
           r.k IS NOT NULL
           AND row_number() OVER (PARTITION BY r.k ORDER BY r.id) = 1
           AND NOT EXISTS (SELECT 1 FROM {table} AS x WHERE x.ordering_key = r.k AND x.status <> 'done'),
           r.trace_context, r.limit_key, r.group_id
    FROM fob_rest AS r
    ORDER BY r.id, r.rank
    RETURNING id, group_id
),
fob_grown AS (
    UPDATE {group_table} AS g
    SET total = g.total + n.added
    FROM (SELECT group_id, count(*) AS added FROM fob_others
          WHERE group_id IS NOT NULL GROUP BY group_id) AS n
    WHERE g.id = n.group_id
    RETURNING g.id
)
SELECT (SELECT count(*) FROM fob_owner) AS fanned, (SELECT count(*) FROM fob_others) AS added;
