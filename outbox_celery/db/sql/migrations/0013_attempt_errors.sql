-- Every failed attempt is recorded (DESIGN invariant 32): beside last_error, which holds the
-- latest error only, errors keeps a JSON array of one object per failed attempt (attempt, at,
-- error), the last 20 (queries.sql errors_appended and errors_cap), appended by the statement
-- that ends the attempt. NULL while the row never failed.
-- No default, no rewrite: rows written before it have no entry; their next failure starts one.
ALTER TABLE {table} ADD COLUMN errors jsonb;
