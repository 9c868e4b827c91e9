-- The payload is kept as its text (DESIGN invariant 27): kombu's JSON, the serializer of Celery's
-- task arguments, read back exactly as written (key order, 1e+20 a float). jsonb normalized
-- both; docs/design.md ("The payload") has the trade-off.
--
-- The new decoder reads an object of exactly the keys "__type__" and "__value__" as a typed
-- value (kombu's envelope); the previous one read it as that object. So that every row keeps
-- decoding as before, the migration refuses while an unfinished row holds such an object:
-- deliver it (or delete it) with the previous release first. Finished (done) rows are never
-- decoded again.
DO $migration$
DECLARE
    held bigint;
BEGIN
    SELECT count(*) INTO held
    FROM {table} AS o
    WHERE o.status <> 'done'
      AND o.payload::text LIKE '%"\_\_type\_\_"%'
      AND EXISTS (
          SELECT 1
          FROM jsonb_path_query(o.payload, 'strict $.**') AS v(obj)
          WHERE jsonb_typeof(v.obj) = 'object'
            AND (SELECT array_agg(k ORDER BY k) FROM jsonb_object_keys(v.obj) AS k)
                = ARRAY['__type__', '__value__']);
    IF held > 0 THEN
        RAISE EXCEPTION 'outbox-celery migration 0010: % unfinished row(s) hold a payload object of exactly the keys __type__ and __value__, which the new payload decoder reads as a typed value; deliver or delete them with the previous release, then migrate', held;
    END IF;
END
$migration$;
-- Rewrites the table (ACCESS EXCLUSIVE until commit): producers and workers wait meanwhile.
-- The text written is jsonb's output of each row, which decodes as it did before.
ALTER TABLE {table} ALTER COLUMN payload TYPE json USING payload::json;
