-- The operator console's reads (outbox_celery.console, outbox_celery.web): bounded reads only.
-- Loaded by the query registry (outbox_celery/_sql.py) like admin.sql. Every read of live rows
-- goes through one of the schema's partial indexes and stops after %(cap)s entries, so its cost
-- is bounded by the cap whatever the done history or the backlog holds; a figure that reached
-- the cap is shown as "cap+" (console.Count.capped). Done rows are read only through done_idx,
-- only within the last hour and at most %(minute_cap)s per minute.

-- The overview's counts per event type, in three parts: ready; retrying and scheduled; behind a
-- key, in flight and dead. Each branch reads the first %(cap)s entries of one partial index in
-- its order; a kind is "capped" when a branch of it stopped at the cap (its figures are then
-- lower bounds, and event types whose rows all lie past the cap are not seen by that branch).
-- Of the rows read, also what stats' attention line reports: claims whose task never started
-- ("lost", stats' rule: a live lease's own claim may still start) and leases that ran out.
-- Three statements, so that a console can read them at once on three connections (the cost
-- of a part is the index entries it walks, dead versions included); each part is one
-- snapshot, the parts are three.

-- fragment: console_part
-- One row of a part: now(), each kind's capped flag (from the part's "capped" rows), and per
-- kind and event type of its "counted" rows how many, the oldest ready wait, the claims never
-- started and the expired leases.
SELECT now() AS now,
       (SELECT json_object_agg(kind, capped) FROM capped) AS capped,
       (SELECT coalesce(json_agg(t), '[]'::json) FROM (
            SELECT what, event_type, count(*) AS n,
                   extract(epoch FROM now() - min(available_at))::float8 AS oldest_ready_wait,
                   count(*) FILTER (WHERE lost > 0) AS unstarted,
                   count(*) FILTER (WHERE expired) AS expired
            FROM counted GROUP BY what, event_type) AS t) AS counts

-- name: console_counts_ready
-- Pending, due and in turn (unordered, or the head of its key).
WITH free AS (
    SELECT event_type, available_at, lease_version - started_version AS lost FROM {table}
    WHERE status = 'pending' AND ordering_key IS NULL AND available_at <= now()
    ORDER BY available_at, id LIMIT %(cap)s
),
heads AS (
    SELECT event_type, available_at, lease_version - started_version AS lost FROM {table}
    WHERE status = 'pending' AND head AND available_at <= now()
    ORDER BY available_at, id LIMIT %(cap)s
),
counted AS (
    SELECT 'ready' AS what, event_type, available_at, lost, false AS expired FROM free
    UNION ALL SELECT 'ready', event_type, available_at, lost, false FROM heads
),
capped(kind, capped) AS (
    VALUES ('ready', (SELECT count(*) FROM free) >= %(cap)s OR (SELECT count(*) FROM heads) >= %(cap)s)
)
{console_part};

-- name: console_counts_later
-- Pending, not yet due: a backoff (attempts spent: retrying) or a delay or defer (none spent:
-- scheduled).
WITH free AS (
    SELECT event_type, attempts, lease_version - started_version AS lost FROM {table}
    WHERE status = 'pending' AND ordering_key IS NULL AND available_at > now()
    ORDER BY available_at, id LIMIT %(cap)s
),
heads AS (
    SELECT event_type, attempts, lease_version - started_version AS lost FROM {table}
    WHERE status = 'pending' AND head AND available_at > now()
    ORDER BY available_at, id LIMIT %(cap)s
),
counted AS (
    SELECT CASE WHEN attempts > 0 THEN 'retrying' ELSE 'scheduled' END AS what, event_type,
           NULL::timestamptz AS available_at, lost, false AS expired
    FROM (SELECT * FROM free UNION ALL SELECT * FROM heads) AS later
),
capped(kind, capped) AS (
    SELECT kind, (SELECT count(*) FROM free) >= %(cap)s OR (SELECT count(*) FROM heads) >= %(cap)s
    FROM (VALUES ('retrying'), ('scheduled')) AS k(kind)
)
{console_part};

-- name: console_counts_rest
-- Ordered rows that are neither done nor a head (they wait behind their key's head), rows in
-- flight (processing) and dead rows.
WITH ordered AS (
    SELECT event_type FROM {table}
    WHERE ordering_key IS NOT NULL AND status <> 'done' AND NOT head
    ORDER BY ordering_key, id LIMIT %(cap)s
),
flight AS (
    SELECT event_type, lease_until <= now() AS expired,
           lease_version - started_version - CASE WHEN lease_until > now() THEN 1 ELSE 0 END AS lost
    FROM {table}
    WHERE status = 'processing' ORDER BY lease_until LIMIT %(cap)s
),
dead AS (
    SELECT event_type FROM {table} WHERE status = 'dead' ORDER BY id LIMIT %(cap)s
),
counted AS (
    SELECT 'behind_key' AS what, event_type, NULL::timestamptz AS available_at, 0 AS lost,
           false AS expired FROM ordered
    UNION ALL SELECT 'in_flight', event_type, NULL, lost, expired FROM flight
    UNION ALL SELECT 'dead', event_type, NULL, 0, false FROM dead
),
capped(kind, capped) AS (
    VALUES ('behind_key', (SELECT count(*) FROM ordered) >= %(cap)s),
           ('in_flight', (SELECT count(*) FROM flight) >= %(cap)s),
           ('dead', (SELECT count(*) FROM dead) >= %(cap)s)
)
{console_part};

-- name: console_routes
-- The subscriptions' routes (DESIGN invariant 28) and whether each is live (not removed): what
-- the database knows of who handles an event type when the console has no app.
SELECT event_type || '@' || name AS route, removed_at IS NULL AS live
FROM {subscription_table}
ORDER BY 1;

-- name: console_state_rows
-- One page of the rows of one state of the overview (%(state)s: ready, in_flight, retrying,
-- scheduled, behind_key), read as the overview's counts read them: the first %(cap)s entries of that
-- state's partial indexes in their order (a branch whose state is another is not run), then
-- those of %(event_type)s (NULL: every type), by id after %(after)s. "matching" is how many of
-- the rows read match, the figure of the overview's cell; the page's rows are then read by
-- their primary key. One row of NULLs but "matching" when the page is empty.
WITH seen AS (
    (SELECT id, event_type, attempts FROM {table}
     WHERE %(state)s::text = 'ready' AND status = 'pending' AND ordering_key IS NULL
       AND available_at <= now()
     ORDER BY available_at, id LIMIT %(cap)s)
    UNION ALL
    (SELECT id, event_type, attempts FROM {table}
     WHERE %(state)s::text = 'ready' AND status = 'pending' AND head AND available_at <= now()
     ORDER BY available_at, id LIMIT %(cap)s)
    UNION ALL
    (SELECT id, event_type, attempts FROM {table}
     WHERE %(state)s::text IN ('retrying', 'scheduled') AND status = 'pending'
       AND ordering_key IS NULL AND available_at > now()
     ORDER BY available_at, id LIMIT %(cap)s)
    UNION ALL
    (SELECT id, event_type, attempts FROM {table}
     WHERE %(state)s::text IN ('retrying', 'scheduled') AND status = 'pending' AND head
       AND available_at > now()
     ORDER BY available_at, id LIMIT %(cap)s)
    UNION ALL
    (SELECT id, event_type, attempts FROM {table}
     WHERE %(state)s::text = 'behind_key' AND ordering_key IS NOT NULL AND status <> 'done'
       AND NOT head
     ORDER BY ordering_key, id LIMIT %(cap)s)
    UNION ALL
    (SELECT id, event_type, attempts FROM {table}
     WHERE %(state)s::text = 'in_flight' AND status = 'processing'
     ORDER BY lease_until LIMIT %(cap)s)
),
matching AS MATERIALIZED (
    SELECT id FROM seen
    WHERE (%(event_type)s::text IS NULL OR event_type = %(event_type)s::text)
      AND (%(state)s::text <> 'retrying' OR attempts > 0)
      AND (%(state)s::text <> 'scheduled' OR attempts = 0)
),
page AS (
    SELECT id FROM matching WHERE id > %(after)s ORDER BY id LIMIT %(limit)s
)
SELECT m.n AS matching, o.id, o.event_type, o.aggregate_type, o.aggregate_id, o.ordering_key,
       o.limit_key, o.attempts, o.created_at,
       extract(epoch FROM now() - o.created_at)::float8 AS age,
       extract(epoch FROM o.available_at - now())::float8 AS available_in,
       extract(epoch FROM o.lease_until - now())::float8 AS lease_expires_in,
       o.lease_version - o.started_version AS unstarted_claims,
       left(o.last_error, 300) AS last_error
FROM (SELECT count(*) AS n FROM matching) AS m
LEFT JOIN (page JOIN {table} AS o USING (id)) ON true
ORDER BY o.id;

-- name: console_headless
-- Ordering keys with unfinished messages and no head (see admin.sql stats), among the first
-- %(cap)s entries of the ordered index: a bounded read (a key past the cap is not seen).
SELECT count(*) AS keys, (SELECT count(*) FROM (
           SELECT 1 FROM {table} WHERE ordering_key IS NOT NULL AND status <> 'done'
           LIMIT %(cap)s) AS c) >= %(cap)s AS capped
FROM (
    SELECT ordering_key FROM (
        SELECT ordering_key, head FROM {table}
        WHERE ordering_key IS NOT NULL AND status <> 'done'
        ORDER BY ordering_key, id LIMIT %(cap)s
    ) AS o
    GROUP BY ordering_key HAVING NOT bool_or(head)
) AS h;

-- name: console_blocked
-- Ordering keys whose head is dead (they block their key), with the dead head's id; read from
-- dead_idx, at most %(cap)s.
SELECT ordering_key, id, event_type FROM {table}
WHERE status = 'dead' AND head AND ordering_key IS NOT NULL
ORDER BY id LIMIT %(cap)s;

-- name: console_minutes
-- Done rows per minute over the last hour and their enqueue -> done latency (done_at -
-- created_at: created_at is the producing transaction's now(), so the latency includes the
-- producer's transaction, any intended delay, retries and backoffs). Each minute reads at most
-- %(minute_cap)s rows of done_idx; "capped" marks a minute that had more (its count is a lower
-- bound, its percentiles are of the first rows of that minute). Skipped rows are left out.
SELECT m.minute,
       s.done,
       s.done >= %(minute_cap)s AS capped,
       s.p50,
       s.p99
FROM generate_series(date_trunc('minute', now()) - interval '59 minutes',
                     date_trunc('minute', now()), interval '1 minute') AS m(minute)
CROSS JOIN LATERAL (
    SELECT count(*) AS done,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY lat) AS p50,
           percentile_cont(0.99) WITHIN GROUP (ORDER BY lat) AS p99
    FROM (
        SELECT extract(epoch FROM d.done_at - d.created_at)::float8 AS lat
        FROM {table} AS d
        WHERE d.status = 'done' AND d.done_at >= m.minute AND d.done_at < m.minute + interval '1 minute'
          AND (d.last_error IS NULL OR d.last_error NOT LIKE %(skip_like)s)
        ORDER BY d.done_at
        LIMIT %(minute_cap)s
    ) AS x
) AS s
ORDER BY m.minute;

-- name: console_key_use
-- Live leases per limit key (key_lease_idx), the busiest first, at most %(cap)s leases read.
SELECT event_type, limit_key, count(*) AS in_flight FROM (
    SELECT event_type, limit_key FROM {table}
    WHERE status = 'processing' AND limit_key IS NOT NULL AND lease_until > now()
    ORDER BY event_type, limit_key, lease_until LIMIT %(cap)s
) AS k
GROUP BY event_type, limit_key
ORDER BY count(*) DESC, event_type, limit_key
LIMIT 50;

-- fragment: seen_payload
-- The payload of the row d as its handler receives it: its own, or for a subscription's row
-- that is not the owner (payload NULL) its owner's through payload_of, one primary-key probe
-- made only for those rows (DESIGN invariant 28).
coalesce(d.payload, (SELECT w.payload FROM {table} AS w WHERE w.id = d.payload_of))

-- fragment: console_dead_filter
-- The console's dead-letter filters over the alias d (a NULL filter matches every row): type,
-- key (ordering, limit or aggregate id), and text found in the last error or the payload
-- (case-insensitive substring; LIKE's wildcards in the text are matched literally). A
-- producer's ordering key also finds its subscriptions' rows, whose stored key is "<key>",
-- chr(31), route (DESIGN invariant 28): starts_with, not a range, since a collation may sort
-- chr(31) apart from its byte order; a predicate on the rows the dead scan reads, as the
-- others are. The payload searched is the one the handler receives (seen_payload): a
-- subscription's row is found by its owner's payload. A UUID typed in its usual form also
-- finds its hex form (%(payload_uuid)s), which kombu's envelope stores.
(%(event_type)s::text IS NULL OR d.event_type = %(event_type)s::text)
  AND (%(key)s::text IS NULL OR d.ordering_key = %(key)s::text OR d.limit_key = %(key)s::text
       OR d.aggregate_id = %(key)s::text
       OR starts_with(d.ordering_key, %(key)s::text || chr(31)))
  AND (%(error)s::text IS NULL
       OR strpos(lower(coalesce(d.last_error, '')), lower(%(error)s::text)) > 0)
  AND (%(payload)s::text IS NULL
       OR strpos(lower({seen_payload}::text), lower(%(payload)s::text)) > 0
       OR (%(payload_uuid)s::text IS NOT NULL
           AND strpos(lower({seen_payload}::text), %(payload_uuid)s::text) > 0))
  -- An index condition on dead_idx (its end, when no bound is given), not a filter of every row.
  AND d.id <= coalesce(%(upto)s::bigint, 9223372036854775807)

-- fragment: console_dead_shown
-- The columns a dead row is listed with, over the alias d and its payload s.seen (the one the
-- handler receives, read once per row by console_dead_seen): the last error cut to 300
-- characters, the payload's JSON cut to 200, and whole (payload_json) when it is at most 2,000
-- characters, for the page to decode (a page never carries a large payload).
d.id, d.event_type, d.aggregate_type, d.aggregate_id, d.ordering_key, d.limit_key, d.attempts,
d.created_at, extract(epoch FROM now() - d.created_at)::float8 AS age,
left(d.last_error, 300) AS last_error, left(s.seen::text, 200) AS payload,
CASE WHEN length(s.seen::text) <= 2000 THEN s.seen END AS payload_json

-- fragment: console_dead_seen
-- The payload of d as its handler receives it, as s.seen: OFFSET 0 keeps the subquery from
-- being pulled up, so the owner's probe runs once per row, not once per use.
CROSS JOIN LATERAL (SELECT {seen_payload} AS seen OFFSET 0) AS s

-- name: console_dead_list
-- One page of matching dead rows by id (dead_idx), after the previous page's last id.
SELECT {console_dead_shown}
FROM (SELECT d.id FROM {table} AS d
      WHERE d.status = 'dead' AND d.id > %(after)s AND {console_dead_filter}
      ORDER BY d.id
      LIMIT %(limit)s) AS page
JOIN {table} AS d USING (id)
{console_dead_seen}
ORDER BY d.id;

-- name: console_dead_page
-- The dead-letter page in one read of the dead rows: how many match and the highest matching
-- id (console_dead_count's figures) with the page after %(after)s (console_dead_list's rows).
-- A text filter reads each dead row's error or payload once, not once for the count and again
-- for the page. One row of NULLs but the count when the page is empty.
WITH matching AS MATERIALIZED (
    SELECT d.id FROM {table} AS d WHERE d.status = 'dead' AND {console_dead_filter}
),
page AS (
    SELECT id FROM matching WHERE id > %(after)s ORDER BY id LIMIT %(limit)s
)
SELECT m.n AS matching, m.upto, shown.*
FROM (SELECT count(*) AS n, max(id) AS upto FROM matching) AS m
LEFT JOIN (
    SELECT {console_dead_shown}
    FROM page JOIN {table} AS d USING (id)
    {console_dead_seen}
) AS shown ON true
ORDER BY shown.id;

-- name: console_dead_count
-- How many dead rows match, and the highest id among them (what a bulk action is bounded by, so
-- that a row that dies after the count is not taken by it).
SELECT count(*) AS n, max(d.id) AS upto FROM {table} AS d
WHERE d.status = 'dead' AND {console_dead_filter};

-- name: console_dead_ids
-- The next batch of matching dead ids for a bulk action, after the previous batch's last id.
SELECT d.id FROM {table} AS d
WHERE d.status = 'dead' AND d.id > %(after)s AND {console_dead_filter}
ORDER BY d.id
LIMIT %(limit)s;
