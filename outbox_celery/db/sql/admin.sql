-- Operator-side named queries (outbox_celery.admin): stats, dead letters, retention.
-- Loaded by the query registry (outbox_celery/_sql.py): "{table}" is replaced by the quoted table
-- identifier (psycopg.sql), the other "{...}" by fragments written once (_sql.FRAGMENTS, or
-- "-- fragment: x" here); every value is a bound parameter. All time comparisons use the
-- database clock (now()).
--
-- Live rows (not done) are few and done rows are history, so every query reaches rows through
-- the schema's partial indexes: pending unordered (pending_idx), ordered not done (ordered_idx),
-- processing (lease_idx), dead (dead_idx), done by done_at (done_idx). Nothing here scans the
-- whole table or the done history.

-- name: stats
-- One statement, so every figure comes from the same snapshot. Bounded: each of the four reads
-- of "live" takes at most %(cap)s entries of its partial index, in the index's order (NULL: no
-- cap, every unfinished row), and the done rows are read only through done_idx, the most recent
-- first, at most %(cap)s. A read that stopped at the cap makes its figures lower bounds (the
-- *_capped columns); the done count past the cap is an estimate from the table's statistics
-- (pg_stat: live tuples minus the unfinished rows counted). The branches are disjoint: the
-- ordered read keeps only its pending rows (its processing and dead rows come from lease_idx and
-- dead_idx), so together they hold every row that is not done (when no read is capped).
WITH free AS (
    SELECT 'free' AS branch, status, event_type, ordering_key, id, attempts, created_at,
           available_at, lease_until, lease_version - started_version AS unstarted_claims, head
    FROM {table} WHERE status = 'pending' AND ordering_key IS NULL
    ORDER BY available_at, id LIMIT %(cap)s
),
ordered AS (
    SELECT 'ordered' AS branch, status, event_type, ordering_key, id, attempts, created_at,
           available_at, lease_until, lease_version - started_version AS unstarted_claims, head
    FROM {table} WHERE ordering_key IS NOT NULL AND status <> 'done'
    ORDER BY ordering_key, id LIMIT %(cap)s
),
flight AS (
    SELECT 'flight' AS branch, status, event_type, ordering_key, id, attempts, created_at,
           available_at, lease_until, lease_version - started_version AS unstarted_claims, head
    FROM {table} WHERE status = 'processing'
    ORDER BY lease_until LIMIT %(cap)s
),
dead AS (
    SELECT 'dead' AS branch, status, event_type, ordering_key, id, attempts, created_at,
           available_at, lease_until, lease_version - started_version AS unstarted_claims, head
    FROM {table} WHERE status = 'dead'
    ORDER BY id LIMIT %(cap)s
),
read AS MATERIALIZED (
    SELECT * FROM free
    UNION ALL SELECT * FROM ordered
    UNION ALL SELECT * FROM flight
    UNION ALL SELECT * FROM dead
),
reads AS (
    SELECT count(*) FILTER (WHERE branch = 'free') AS free,
           count(*) FILTER (WHERE branch = 'ordered') AS ordered,
           count(*) FILTER (WHERE branch = 'flight') AS flight,
           count(*) FILTER (WHERE branch = 'dead') AS dead
    FROM read
),
live AS (
    SELECT * FROM read WHERE branch <> 'ordered' OR status = 'pending'
),
-- Only the head of an ordered key (flagged, see queries.sql claim_heads) is claimable: a pending
-- row behind it waits its turn, and a dead head blocks its key. No per-key grouping is needed.
marked AS (
    SELECT live.*,
           (live.status = 'pending' AND live.available_at <= now()
            AND (live.ordering_key IS NULL OR live.head)) AS ready,
           -- Claims since the last fenced start whose task never started (DESIGN invariants
           -- 10, 16); a live lease's own claim may still start, so it does not count yet.
           CASE WHEN live.status = 'pending' THEN live.unstarted_claims
                WHEN live.status = 'processing' AND live.lease_until > now()
                THEN live.unstarted_claims - 1
                WHEN live.status = 'processing' THEN live.unstarted_claims
                ELSE 0 END AS lost_claims
    FROM live
),
-- One pass over the rows read: every per-type figure; the totals are sums and minima of these.
by_type AS (
    SELECT event_type,
           count(*) FILTER (WHERE status = 'pending') AS pending,
           count(*) FILTER (WHERE ready) AS ready,
           count(*) FILTER (WHERE status = 'pending' AND available_at > now()) AS scheduled,
           count(*) FILTER (WHERE status = 'processing') AS processing,
           count(*) FILTER (WHERE status = 'processing' AND lease_until <= now()) AS expired,
           count(*) FILTER (WHERE status = 'dead') AS dead,
           min(created_at) FILTER (WHERE status = 'pending') AS oldest_pending,
           min(available_at) FILTER (WHERE ready) AS oldest_ready,
           min(created_at) FILTER (WHERE status = 'processing') AS oldest_processing,
           extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending'))::float8
               AS oldest_pending_age,
           count(*) FILTER (WHERE lost_claims > 0) AS unstarted,
           coalesce(max(lost_claims), 0) AS unstarted_claims
    FROM marked
    GROUP BY event_type
),
by_attempts AS (
    SELECT attempts,
           count(*) FILTER (WHERE status = 'pending') AS pending,
           count(*) FILTER (WHERE status = 'processing') AS processing,
           count(*) FILTER (WHERE status = 'dead') AS dead
    FROM live
    GROUP BY attempts
),
-- Keys whose head is dead, and the unfinished messages waiting behind each: read from the dead
-- heads (dead_idx, at most %(cap)s) and, per dead head, its key's range of the ordered index (at
-- most %(cap)s entries each); O(dead heads + messages waiting behind them), not O(backlog).
blocked AS (
    SELECT d.ordering_key,
           (SELECT count(*) FROM (SELECT 1 FROM {table} AS w
            WHERE w.ordering_key = d.ordering_key AND w.status <> 'done' AND w.id > d.id
            LIMIT %(cap)s) AS b) AS waiting
    FROM {table} AS d
    WHERE d.status = 'dead' AND d.head AND d.ordering_key IS NOT NULL
    ORDER BY d.id LIMIT %(cap)s
),
-- Keys with unfinished messages none of which is flagged head: never claimed again, and
-- neither ready nor blocked. A producer or worker of a release before migration 0004 leaves
-- them (an insert that does not flag, a done that does not move the flag); repair-heads
-- (settle_heads) mends them. Read from the ordered rows already read (every status).
headless AS (
    SELECT ordering_key FROM read
    WHERE branch = 'ordered'
    GROUP BY ordering_key
    HAVING NOT bool_or(head)
),
-- The done rows through done_idx, the most recent first: exact below the cap, and how many
-- finished in the last minute (exact while fewer than %(cap)s did).
done AS (
    SELECT done_at FROM {table} WHERE status = 'done' ORDER BY done_at DESC LIMIT %(cap)s
),
done_read AS (
    SELECT count(*) AS n, count(*) FILTER (WHERE done_at > now() - interval '1 minute') AS last_minute
    FROM done
),
totals AS (
    SELECT coalesce(sum(pending), 0) AS pending, coalesce(sum(ready), 0) AS ready,
           coalesce(sum(scheduled), 0) AS scheduled, coalesce(sum(processing), 0) AS processing,
           coalesce(sum(expired), 0) AS expired, coalesce(sum(dead), 0) AS dead,
           coalesce(sum(unstarted), 0) AS unstarted, min(oldest_pending) AS oldest_pending,
           min(oldest_ready) AS oldest_ready, min(oldest_processing) AS oldest_processing
    FROM by_type
)
SELECT
    now() AS now,
    t.pending, t.ready, t.scheduled, t.processing, t.dead,
    CASE WHEN dr.n < %(cap)s OR %(cap)s::bigint IS NULL THEN dr.n
         ELSE greatest(dr.n, pg_stat_get_live_tuples(%(table)s::regclass)
                             - t.pending - t.processing - t.dead) END AS done,
    coalesce(dr.n >= %(cap)s, false) AS done_capped,
    dr.last_minute AS done_last_minute,
    coalesce(r.free >= %(cap)s OR r.ordered >= %(cap)s, false) AS pending_capped,
    coalesce(r.flight >= %(cap)s, false) AS processing_capped,
    coalesce(r.dead >= %(cap)s, false) AS dead_capped,
    coalesce(r.ordered >= %(cap)s, false) AS ordered_capped,
    t.expired AS expired_leases,
    extract(epoch FROM now() - t.oldest_pending)::float8 AS oldest_pending_age,
    extract(epoch FROM now() - t.oldest_ready)::float8 AS oldest_ready_wait,
    extract(epoch FROM now() - t.oldest_processing)::float8 AS oldest_processing_age,
    t.unstarted,
    (SELECT count(*) FROM blocked) AS blocked_keys,
    (SELECT coalesce(sum(waiting), 0) FROM blocked) AS blocked_messages,
    (SELECT count(*) FROM headless) AS headless_keys,
    (SELECT coalesce(json_agg(json_build_object(
                'event_type', event_type, 'pending', pending, 'ready', ready,
                'processing', processing, 'dead', dead, 'oldest_pending_age', oldest_pending_age,
                'unstarted', unstarted, 'unstarted_claims', unstarted_claims)
            ORDER BY event_type), '[]'::json)
     FROM by_type) AS event_types,
    (SELECT coalesce(json_agg(json_build_object(
                'attempts', attempts, 'pending', pending, 'processing', processing, 'dead', dead)
            ORDER BY attempts), '[]'::json)
     FROM by_attempts) AS attempts
FROM totals AS t, reads AS r, done_read AS dr;

-- fragment: dead_filter
-- The filters of dead_list and dead_count over the alias d (a NULL filter matches every row),
-- written once; the query registry (_sql.py) puts them in both. Age filters use created_at: a dead row records no
-- dead time.
(%(event_type)s::text IS NULL OR d.event_type = %(event_type)s::text)
  AND (%(aggregate_type)s::text IS NULL OR d.aggregate_type = %(aggregate_type)s::text)
  AND (%(aggregate_id)s::text IS NULL OR d.aggregate_id = %(aggregate_id)s::text)
  AND (%(older_than)s::float8 IS NULL
       OR d.created_at <= now() - make_interval(secs => %(older_than)s::float8))
  AND (%(newer_than)s::float8 IS NULL
       OR d.created_at > now() - make_interval(secs => %(newer_than)s::float8))

-- name: dead_list
-- Keyset paging by id (dead_idx).
-- waiting_behind: messages of the same ordering key after this one that are not done.
SELECT d.id, d.event_type, d.aggregate_type, d.aggregate_id, d.ordering_key, d.attempts,
       d.created_at, extract(epoch FROM now() - d.created_at)::float8 AS age, d.last_error,
       CASE WHEN d.ordering_key IS NULL THEN 0 ELSE (
           SELECT count(*) FROM {table} AS b
           WHERE b.ordering_key = d.ordering_key AND b.status <> 'done' AND b.id > d.id
       ) END AS waiting_behind
FROM {table} AS d
WHERE d.status = 'dead'
  AND d.id > %(after)s
  AND {dead_filter}
ORDER BY d.id
LIMIT %(limit)s;

-- name: dead_count
SELECT count(*) FROM {table} AS d
WHERE d.status = 'dead'
  AND {dead_filter};

-- name: show
-- One message of any status, with what explains its wait: times relative to now() and, for an
-- ordered message, the head of its key and how many messages wait behind it. The head is the
-- flagged one (DESIGN invariant 9: the flag is what the claim reads), never re-derived here; a
-- key whose unfinished messages carry no flag has none (repair-heads mends it).
SELECT o.id, o.status, o.event_type, o.aggregate_type, o.aggregate_id, o.ordering_key,
       -- A subscription's row reads its owner's payload (DESIGN invariant 28).
       coalesce(o.payload, (SELECT w.payload FROM {table} AS w WHERE w.id = o.payload_of)) AS payload,
       o.attempts, o.created_at, o.available_at, o.lease_owner, o.lease_until,
       o.lease_version, o.last_error, o.done_at,
       -- Every failed attempt's error, the last 20, oldest first (DESIGN invariant 32).
       o.errors,
       o.lease_version - o.started_version AS unstarted_claims,
       now() AS now,
       extract(epoch FROM now() - o.created_at)::float8 AS age,
       extract(epoch FROM o.available_at - now())::float8 AS available_in,
       extract(epoch FROM o.lease_until - now())::float8 AS lease_expires_in,
       CASE WHEN o.ordering_key IS NULL THEN NULL ELSE (
           SELECT h.id FROM {table} AS h
           WHERE h.ordering_key = o.ordering_key AND h.head AND h.status <> 'done'
           ORDER BY h.id
           LIMIT 1
       ) END AS key_head,
       CASE WHEN o.ordering_key IS NULL THEN 0 ELSE (
           SELECT count(*) FROM {table} AS b
           WHERE b.ordering_key = o.ordering_key AND b.status <> 'done' AND b.id > o.id
       ) END AS waiting_behind
FROM {table} AS o
WHERE o.id = %(id)s;

-- name: lock_ids
-- The operator's explicit ids, locked in id order (two operators never deadlock) so that the
-- check and the change see the same rows. lease_in: seconds until a processing row's lease
-- ends (<= 0: expired, no worker holds it any more).
SELECT id, status, extract(epoch FROM lease_until - now())::float8 AS lease_in
FROM {table} WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id FOR UPDATE;

-- name: requeue_ids
-- Dead -> pending, claimable now, attempts reset; the previous error is kept behind a prefix.
-- lease_version is never reset: it is the fencing token and only ever grows. A processing row
-- whose lease expired (its task lost, its event type without a handler) may be requeued too
-- (DESIGN invariant 10): no worker holds it, and a straggler's task is fenced off by status.
-- The count of claims that never started starts again from zero.
-- A dead member of an open group no longer counts as dead there (group_settle, DESIGN invariant
-- 29): it runs again and counts when it is final again.
WITH was AS (
    SELECT id, status FROM {table}
    WHERE id = ANY(%(ids)s::bigint[])
      AND (status = 'dead' OR (status = 'processing' AND lease_until <= now()))
    ORDER BY id
    FOR UPDATE
),
requeued AS (
UPDATE {table} AS o
{requeue_set}
FROM was
WHERE o.id = was.id
RETURNING o.id, o.group_id, o.event_type, was.status AS was
),
group_moves AS (
    SELECT group_id, id, event_type, NULL::text AS last_error, 0 AS d_done, -1 AS d_dead
    FROM requeued WHERE group_id IS NOT NULL AND was = 'dead'
),
{group_settle}
SELECT id FROM requeued;

-- name: requeue_batch
-- One bounded batch of "requeue --all": ids above the previous batch, so nothing is requeued
-- twice even if it dies again while the loop runs.
WITH picked AS (
    SELECT id FROM {table}
    WHERE status = 'dead' AND id > %(after)s
      AND (%(event_type)s::text IS NULL OR event_type = %(event_type)s::text)
    ORDER BY id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
, requeued AS (
UPDATE {table} AS o
{requeue_set}
FROM picked
WHERE o.id = picked.id
RETURNING o.id, o.group_id, o.event_type
),
-- As requeue_ids: a dead member of an open group no longer counts as dead (invariant 29).
group_moves AS (
    SELECT group_id, id, event_type, NULL::text AS last_error, 0 AS d_done, -1 AS d_dead
    FROM requeued WHERE group_id IS NOT NULL
),
{group_settle}
SELECT id FROM requeued;

-- fragment: requeue_set
-- What an operator's requeue writes (requeue_ids, requeue_batch) to the rows it updates, "o":
-- pending, claimable now, attempts reset, the previous error kept behind a prefix.
-- lease_version is never reset (the fencing token only ever grows); started_version catches up
-- with it, so the count of claims that never started starts again from zero. errors is left as
-- it is: the failed attempts before the requeue stay its history (DESIGN invariant 32).
SET status = 'pending',
    attempts = 0,
    available_at = now(),
    lease_until = NULL,
    started_version = o.lease_version,
    last_error = left('requeued by operator' || coalesce(': ' || %(reason)s::text, '')
                      || ' (attempts were ' || o.attempts || ')'
                      || coalesce('; previous error: ' || o.last_error, ''), 8000)

-- name: lock_keys_of_ids
-- Before a skip: the producers' key locks (queries.sql lock_keys) of every ordered message among
-- the ids, in sorted order, so the head moved by settle_heads sees every message of those keys
-- committed so far and no producer commits one until the skip does (DESIGN invariant 9).
{lock_keys_of_rows};

-- name: skip_ids
-- Done on purpose (never delivered): unblocks an ordered key. The reason is recorded behind
-- skip_mark (admin.SKIPPED_BY_OPERATOR), which is how a skipped row is told from a delivered one. In SET,
-- "status" still reads the old value. A processing row whose lease expired may be skipped too
-- (DESIGN invariant 10); a live lease never (a worker may be running it). errors is kept as
-- it is, the history of its failed attempts (DESIGN invariant 32).
-- A member of an open group counts as done there, and no longer as dead (group_settle, DESIGN
-- invariant 29); the last one enqueues the group's callback.
WITH was AS (
    SELECT id, status FROM {table}
    WHERE id = ANY(%(ids)s::bigint[])
      AND (status IN ('dead', 'pending') OR (status = 'processing' AND lease_until <= now()))
    ORDER BY id
    FOR UPDATE
),
skipped AS (
UPDATE {table} AS o
SET status = 'done',
    done_at = now(),
    lease_until = NULL,
    last_error = left(%(skip_mark)s::text || ': ' || %(reason)s::text || ' (was ' || was.status
                      || ', attempts ' || o.attempts || ')'
                      || coalesce('; previous error: ' || o.last_error, ''), 8000)
FROM was
WHERE o.id = was.id
RETURNING o.id, o.ordering_key, o.group_id, o.event_type, was.status AS was
),
group_moves AS (
    SELECT group_id, id, event_type, NULL::text AS last_error, 1 AS d_done,
           -(was = 'dead')::int AS d_dead
    FROM skipped WHERE group_id IS NOT NULL
),
{group_settle}
SELECT id, ordering_key FROM skipped;

-- name: purge_cutoff
-- Fixed once per purge run, so the run has a bounded amount of work.
SELECT now() - make_interval(secs => %(older_than)s::float8);

-- name: purge_count
SELECT count(*) FROM {table} WHERE status = 'done' AND done_at < %(cutoff)s;

-- name: purge_batch
-- A purge batch's first statement, in one short transaction with purge_delete: locks at most
-- "limit" done rows past the cutoff (SKIP LOCKED: two purges never wait on each other). A row
-- whose payload other subscriptions' rows read (payload_of, DESIGN invariant 28) is a candidate
-- only when each of them is itself purgeable; this statement's snapshot may predate the lock,
-- so purge_delete decides. A row a replay is pointing new rows at is locked by it (FOR KEY
-- SHARE, replay_insert): skipped, for a later run.
SELECT o.id FROM {table} AS o
WHERE o.status = 'done' AND o.done_at < %(cutoff)s
  AND NOT EXISTS (SELECT 1 FROM {table} AS r
                  WHERE r.payload_of = o.id
                    AND NOT (r.status = 'done' AND r.done_at < %(cutoff)s))
ORDER BY o.done_at
LIMIT %(limit)s
FOR UPDATE OF o SKIP LOCKED;

-- name: purge_delete
-- Deletes the rows purge_batch locked that no unfinished row reads, seen by this statement's
-- snapshot, taken after those locks (read committed): a row that reads one of them committed
-- before the lock (seen here, so the payload stays), or is not written yet, and its writer's
-- FOR KEY SHARE of the owner waits for this transaction, then finds the owner gone and skips it.
-- No delivery ever loses its payload.
DELETE FROM {table} AS o
WHERE o.id = ANY(%(ids)s::bigint[])
  AND NOT EXISTS (SELECT 1 FROM {table} AS r
                  WHERE r.payload_of = o.id
                    AND NOT (r.status = 'done' AND r.done_at < %(cutoff)s));

-- name: flow_keys_prune
-- Per-key state worth nothing any more (DESIGN invariant 25): rows of keys neither paused nor
-- held whose key_rate bucket is full again (or that never had one), untouched for a minute, so
-- that a key served now and then is not deleted and written again by every claim. An absent row
-- is a full bucket and no hold: deleting these changes no claim. At most %(limit)s per call.
WITH doomed AS (
    SELECT event_type, limit_key FROM {flow_key_table}
    WHERE NOT paused AND (paused_until IS NULL OR paused_until <= now())
      AND (tokens IS NULL OR full_at <= now())
      AND updated_at < now() - interval '60 seconds'
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {flow_key_table} AS f
USING doomed
WHERE f.event_type = doomed.event_type AND f.limit_key = doomed.limit_key;

-- name: horizon
-- What holds back the xmin horizon (DESIGN invariant 18): while it is held, VACUUM can remove no
-- dead row version anywhere in the database, the outbox's included. The oldest holder of each
-- kind: a transaction or session snapshot in this database (pg_stat_activity; other roles'
-- sessions show only with pg_read_all_stats), a prepared transaction in this database, a
-- replication slot or a standby's hot_standby_feedback (those hold every database's horizon). Ranked by transaction-id age; seconds where the catalog records a time.
-- Plus the outbox table's dead row versions and its last (auto)vacuum, from the statistics.
WITH holders AS (
    SELECT 'transaction' AS kind, pid::text AS name, coalesce(application_name, '') AS application,
           coalesce(state, '') AS state,
           extract(epoch FROM now() - xact_start)::float8 AS seconds,
           greatest(age(backend_xmin), age(backend_xid)) AS xid_age
    FROM pg_stat_activity
    WHERE (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL) AND pid <> pg_backend_pid()
      AND backend_type = 'client backend' AND datname = current_database()
    UNION ALL
    SELECT 'prepared transaction', gid, owner::text, 'prepared',
           extract(epoch FROM now() - prepared)::float8, age(transaction)
    FROM pg_prepared_xacts
    WHERE database = current_database()
    UNION ALL
    SELECT 'replication slot', slot_name::text, coalesce(plugin::text, 'physical'),
           CASE WHEN active THEN 'active' ELSE 'inactive' END, NULL, age(xmin)
    FROM pg_replication_slots
    WHERE xmin IS NOT NULL
    UNION ALL
    SELECT 'standby feedback', pid::text, coalesce(application_name, ''), coalesce(state, ''),
           NULL, age(backend_xmin)
    FROM pg_stat_replication
    WHERE backend_xmin IS NOT NULL
),
oldest AS (
    SELECT * FROM holders ORDER BY xid_age DESC NULLS LAST, seconds DESC NULLS LAST LIMIT 1
)
SELECT (SELECT kind FROM oldest) AS kind,
       (SELECT name FROM oldest) AS name,
       (SELECT application FROM oldest) AS application,
       (SELECT state FROM oldest) AS state,
       (SELECT seconds FROM oldest) AS seconds,
       (SELECT xid_age FROM oldest) AS xid_age,
       pg_stat_get_dead_tuples(%(table)s::regclass) AS dead_row_versions,
       pg_stat_get_live_tuples(%(table)s::regclass) AS live_row_versions,
       extract(epoch FROM now() - greatest(pg_stat_get_last_autovacuum_time(%(table)s::regclass),
                                           pg_stat_get_last_vacuum_time(%(table)s::regclass)))::float8
           AS last_vacuum_age;

-- name: headless_keys
-- One page of keys with unfinished messages and no head among them (see stats), in key order
-- after the previous page: the ordered index (ordering_key, id) serves the grouping.
SELECT ordering_key FROM {table}
WHERE ordering_key IS NOT NULL AND status <> 'done' AND ordering_key > %(after)s
GROUP BY ordering_key
HAVING NOT bool_or(head)
ORDER BY ordering_key
LIMIT %(limit)s;

-- name: unclaimed
-- Claimable messages (due, and their key's head when ordered) left unclaimed for longer than
-- older_than seconds past their available_at, per event type. A running outbox claims a due
-- message within one claim interval (at once with push); one left many intervals means no claim
-- worker is running, or none has a handler for its event type (the claim takes only those).
-- Nothing is recorded per claim: each branch is a range of a pending partial index ordered by
-- available_at (pending_idx, heads_idx), read only below the threshold and at most %(cap)s
-- entries (NULL: no cap); past the cap "messages" is a lower bound, the oldest wait exact.
SELECT event_type, count(*) AS messages,
       extract(epoch FROM now() - min(available_at))::float8 AS oldest_wait
FROM (
    (SELECT event_type, available_at FROM {table}
     WHERE status = 'pending' AND ordering_key IS NULL
       AND available_at <= now() - make_interval(secs => %(older_than)s::float8)
     ORDER BY available_at, id LIMIT %(cap)s)
    UNION ALL
    (SELECT event_type, available_at FROM {table}
     WHERE status = 'pending' AND head
       AND available_at <= now() - make_interval(secs => %(older_than)s::float8)
     ORDER BY available_at, id LIMIT %(cap)s)
) AS waiting
GROUP BY event_type
ORDER BY event_type;

-- name: flow_exists
-- Whether the flow-control table (migration 0007) is there.
SELECT to_regclass(%(flow_table)s) IS NOT NULL;

-- name: flow_list
-- Event types paused or held by a RateLimited outcome: what stats shows.
SELECT event_type, paused, extract(epoch FROM paused_until - now())::float8 AS held_for
FROM {flow_table}
WHERE paused OR paused_until > now()
ORDER BY event_type;

-- name: flow_pause
-- Pause an event type (DESIGN invariant 23): no claim hands out its messages from the next one
-- on (a claim reads the flow rows under their lock). Returns whether it was paused already.
WITH before AS (
    SELECT paused FROM {flow_table} WHERE event_type = %(event_type)s FOR UPDATE
),
up AS (
    INSERT INTO {flow_table} AS f (event_type, paused) VALUES (%(event_type)s, true)
    ON CONFLICT (event_type) DO UPDATE SET paused = true, updated_at = now()
    RETURNING f.event_type
)
SELECT coalesce((SELECT paused FROM before), false) AS was_paused, (SELECT count(*) FROM up) AS rows;

-- name: flow_resume
-- Resume an event type: its pause and any RateLimited hold end, and the table's push listeners
-- are woken at commit (the channel of insert's pg_notify), so its messages are claimed at once.
-- Returns whether it was paused or held.
WITH before AS (
    SELECT paused OR coalesce(paused_until > now(), false) AS held
    FROM {flow_table} WHERE event_type = %(event_type)s FOR UPDATE
),
up AS (
    UPDATE {flow_table} SET paused = false, paused_until = NULL, updated_at = now()
    WHERE event_type = %(event_type)s
    RETURNING event_type
)
SELECT coalesce((SELECT held FROM before), false) AS was_held,
       (SELECT count(*) FROM up) AS rows,
       pg_notify({notify_channel}, '') IS NULL AS woke;

-- name: flow_keys_exist
-- Whether the table of holds per limit key (migration 0008) is there.
SELECT to_regclass(%(flow_key_table)s) IS NOT NULL;

-- name: flow_key_full_at_exists
-- Whether migration 0009 (when a key's bucket is full again) is applied.
SELECT EXISTS (SELECT 1 FROM pg_attribute
               WHERE attrelid = to_regclass(%(flow_key_table)s) AND attname = 'full_at'
                 AND NOT attisdropped);

-- name: flow_key_list
-- Limit keys paused or held by a RateLimited outcome (DESIGN invariant 24).
SELECT event_type, limit_key, paused, extract(epoch FROM paused_until - now())::float8 AS held_for
FROM {flow_key_table}
WHERE (paused OR paused_until IS NOT NULL) AND (paused OR paused_until > now())
ORDER BY event_type, limit_key;

-- name: flow_key_pause
-- Pause one limit key of an event type (DESIGN invariant 24): no claim hands out its messages
-- from the next one on (the claim reads the held keys before the type's flow-row lock; a claim
-- already past that read finishes as it began). Returns whether it was paused already.
WITH before AS (
    SELECT paused FROM {flow_key_table}
    WHERE event_type = %(event_type)s AND limit_key = %(limit_key)s FOR UPDATE
),
up AS (
    INSERT INTO {flow_key_table} AS f (event_type, limit_key, paused)
    VALUES (%(event_type)s, %(limit_key)s, true)
    ON CONFLICT (event_type, limit_key) DO UPDATE SET paused = true, updated_at = now()
    RETURNING f.event_type
)
SELECT coalesce((SELECT paused FROM before), false) AS was_paused, (SELECT count(*) FROM up) AS rows;

-- name: flow_key_resume
-- Resume one limit key: its pause and any RateLimited hold end (its key_rate bucket stays), and
-- the table's push listeners are woken at commit. Returns whether it was paused or held.
WITH before AS (
    SELECT paused OR coalesce(paused_until > now(), false) AS held
    FROM {flow_key_table} WHERE event_type = %(event_type)s AND limit_key = %(limit_key)s FOR UPDATE
),
up AS (
    UPDATE {flow_key_table} SET paused = false, paused_until = NULL, updated_at = now()
    WHERE event_type = %(event_type)s AND limit_key = %(limit_key)s
    RETURNING event_type
)
SELECT coalesce((SELECT held FROM before), false) AS was_held, (SELECT count(*) FROM up) AS rows,
       pg_notify({notify_channel}, '') IS NULL AS woke;

-- name: group_exists
-- Whether the groups' table (migration 0012) is there: stats of a table not migrated yet show
-- no group instead of failing.
SELECT to_regclass(%(group_table)s) IS NOT NULL;

-- name: group_summary
-- Open groups (DESIGN invariant 29), read through the open groups' index, at most %(cap)s: how
-- many, the oldest one's age, and how many have a dead member (blocked: a member waits for
-- an operator's requeue or skip, or the group for a finish or cancel by hand).
SELECT count(*) AS open, extract(epoch FROM now() - min(created_at))::float8 AS oldest_open_age,
       count(*) FILTER (WHERE dead > 0) AS blocked, coalesce(count(*) >= %(cap)s, false) AS capped
FROM (SELECT created_at, dead FROM {group_table} WHERE state = 'open'
      ORDER BY created_at LIMIT %(cap)s) AS o;

-- name: group_list
-- Groups in one state (NULL: any), the newest first, at most %(limit)s.
SELECT id, state, total, done, dead, skip_on_dead, event_type, created_at, closed_at,
       extract(epoch FROM now() - created_at)::float8 AS age, callback_id, note
FROM {group_table}
WHERE %(state)s::text IS NULL OR state = %(state)s::text
ORDER BY id DESC
LIMIT %(limit)s;

-- name: group_get
SELECT id, state, total, done, dead, skip_on_dead, event_type, created_at, closed_at,
       extract(epoch FROM now() - created_at)::float8 AS age, callback_id, note
FROM {group_table} WHERE id = %(id)s;

-- name: group_dead_members
-- Every dead member of a group, in id order from %(after)s, at most %(limit)s (the members'
-- index: group_id, id).
SELECT id, event_type, last_error FROM {table}
WHERE group_id = %(id)s AND id > %(after)s AND status = 'dead'
ORDER BY id LIMIT %(limit)s;

-- name: group_close
-- An operator closes an open group by hand: 'finished' enqueues its callback now with the
-- outcomes counted so far (group_callback, as the last member's finalize would), 'cancelled'
-- never will. Members still running finish as usual and count nothing (only open groups count).
WITH gs_new AS (
    UPDATE {group_table} AS g
    SET state = %(state)s, closed_at = now(), note = %(reason)s,
        callback_id = CASE WHEN %(state)s = 'finished'
                           THEN nextval(pg_get_serial_sequence(%(table)s::text, 'id')) END
    WHERE g.id = %(id)s AND g.state = 'open'
    RETURNING g.*
),
gs_fired AS ({group_callback}),
gs_fired_subs AS ({group_callback_subs})
SELECT id, callback_id FROM gs_new;

-- name: group_purge
-- Retention of groups: closed groups (fired, skipped, cancelled, finished) closed before the
-- purge's cutoff, one bounded batch; open groups are never touched.
DELETE FROM {group_table}
WHERE id IN (
    SELECT id FROM {group_table}
    WHERE state <> 'open' AND closed_at < %(cutoff)s
    ORDER BY id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
);
