-- Subscriptions of an outbox table (DESIGN invariant 28): the rows the producers' insert reads
-- to fan an event out, one delivery row per live subscription. "{table}" and the other
-- identifiers are bound by the query registry (outbox_celery/_sql.py).

-- name: exists
-- Whether the subscription table is there (migration 0011).
SELECT to_regclass(%(subscription_table)s) IS NOT NULL;

-- name: register
-- The subscriptions a worker's handlers (or an app, at a deploy step) declare, added when
-- missing. One row per declared subscription says what it is now: "added" by this statement,
-- "exists" (live already, or added meanwhile by another registration) or "removed" (an
-- operator removed it, and it stays so: returned, so the caller can say so).
WITH wanted AS (
    SELECT * FROM unnest(%(event_types)s::text[], %(names)s::text[]) AS u(event_type, name)
),
added AS (
    INSERT INTO {subscription_table} (event_type, name)
    SELECT event_type, name FROM wanted ORDER BY event_type, name
    ON CONFLICT (event_type, name) DO NOTHING
    RETURNING event_type, name
)
SELECT CASE WHEN a.name IS NOT NULL THEN 'added'
            WHEN s.removed_at IS NOT NULL THEN 'removed'
            ELSE 'exists' END AS what,
       w.event_type, w.name
FROM wanted AS w
LEFT JOIN added AS a USING (event_type, name)
LEFT JOIN {subscription_table} AS s USING (event_type, name)
ORDER BY w.event_type, w.name;

-- name: declared
-- What register would find, changing nothing: "exists", "removed" or "missing" per declared
-- subscription (migrate --check).
SELECT CASE WHEN s.name IS NULL THEN 'missing'
            WHEN s.removed_at IS NOT NULL THEN 'removed'
            ELSE 'exists' END AS what,
       w.event_type, w.name
FROM unnest(%(event_types)s::text[], %(names)s::text[]) AS w(event_type, name)
LEFT JOIN {subscription_table} AS s USING (event_type, name)
ORDER BY w.event_type, w.name;

-- name: add
-- An operator's add: a new subscription, or a removed one back (its created_at is then now():
-- it receives the events committed from now on). No row when it was live already.
INSERT INTO {subscription_table} AS s (event_type, name)
VALUES (%(event_type)s, %(name)s)
ON CONFLICT (event_type, name) DO UPDATE
SET removed_at = NULL, created_at = now()
WHERE s.removed_at IS NOT NULL
RETURNING created_at;

-- name: remove
-- Producers stop fanning out to it at once; its rows stay as they are (visible, never done).
UPDATE {subscription_table} SET removed_at = now()
WHERE event_type = %(event_type)s AND name = %(name)s AND removed_at IS NULL
RETURNING removed_at;

-- name: list
-- Every subscription, removed ones included, with its unfinished rows by status: one probe of
-- the ordered and pending indexes is not possible per route, so counted up to %(cap)s each.
SELECT s.event_type, s.name, s.created_at, s.removed_at,
       (SELECT count(*) FROM (SELECT 1 FROM {table} AS o
                              WHERE o.event_type = s.event_type || '@' || s.name
                                AND o.status = 'pending' LIMIT %(cap)s) AS p) AS pending,
       (SELECT count(*) FROM (SELECT 1 FROM {table} AS o
                              WHERE o.event_type = s.event_type || '@' || s.name
                                AND o.status = 'processing' LIMIT %(cap)s) AS p) AS processing,
       (SELECT count(*) FROM (SELECT 1 FROM {table} AS o
                              WHERE o.event_type = s.event_type || '@' || s.name
                                AND o.status = 'dead' LIMIT %(cap)s) AS p) AS dead
FROM {subscription_table} AS s
WHERE %(event_type)s::text IS NULL OR s.event_type = %(event_type)s::text
ORDER BY s.event_type, s.name;

-- name: replay_facts
-- A replay's next batch: the retained facts of the event type (their owner rows: the row that
-- holds the payload) written from %(since)s, after id %(after)s, that have no row for the route
-- yet, in id order, at most %(limit)s. Read before the key locks, to know which keys to lock.
SELECT f.id, split_part(f.ordering_key, chr(31), 1) AS k
FROM {table} AS f
WHERE f.payload IS NOT NULL AND f.id > %(after)s AND f.created_at >= %(since)s
  AND f.id <= %(until)s
  AND split_part(f.event_type, '@', 1) = %(event_type)s AND f.event_type <> %(route)s
  AND NOT EXISTS (SELECT 1 FROM {table} AS r WHERE r.payload_of = f.id AND r.event_type = %(route)s)
ORDER BY f.id
LIMIT %(limit)s;

-- name: replay_insert
-- The rows of a replay batch for the route (under the producers' locks of their keys, taken by
-- lock_keys before: a replayed ordered row is its key's head only when nothing of the
-- subscription's key is unfinished, as the producers' insert decides it, invariant 9). Each
-- reads its fact's payload (payload_of); due now. The facts are locked as a foreign key's check
-- locks the row it references (FOR KEY SHARE: claims and finishes go on, a delete waits), until
-- commit: a purge deleting one already makes this wait, then skip it (read committed); a purge
-- after it skips it (purge_batch's SKIP LOCKED) or sees the committed row that reads it.
WITH facts AS (
    SELECT f.id, f.aggregate_type, f.aggregate_id, f.ordering_key, f.trace_context, f.limit_key
    FROM {table} AS f
    WHERE f.id = ANY(%(ids)s::bigint[])
    FOR KEY SHARE OF f
)
INSERT INTO {table} (event_type, aggregate_type, aggregate_id, payload, payload_of, ordering_key,
                     head, trace_context, limit_key)
SELECT %(route)s, f.aggregate_type, f.aggregate_id, NULL, f.id, v.k,
       v.k IS NOT NULL
       AND row_number() OVER (PARTITION BY v.k ORDER BY f.id) = 1
       AND NOT EXISTS (SELECT 1 FROM {table} AS o WHERE o.ordering_key = v.k AND o.status <> 'done'),
       f.trace_context, f.limit_key
FROM facts AS f,
     LATERAL (SELECT split_part(f.ordering_key, chr(31), 1) || chr(31) || %(route)s AS k) AS v
ORDER BY f.id
RETURNING id;

-- name: replay_until
-- The last fact a replay may take: written before the subscription existed (later ones fanned
-- out to it already, or will: their statements see it).
SELECT coalesce(max(id), 0) FROM {table};

-- name: routes
-- The routes of an event type's subscriptions, removed ones included (their rows may still be
-- claimed by a worker that has the handler): what pausing or resuming the type reaches.
SELECT event_type || '@' || name AS route
FROM {subscription_table}
WHERE event_type = %(event_type)s
ORDER BY name;
