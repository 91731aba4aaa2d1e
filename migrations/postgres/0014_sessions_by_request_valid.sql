-- 0013 builds its index CONCURRENTLY. A build that fails leaves the index
-- behind, invalid: never used (a keyed CreateSession's ON CONFLICT would
-- find no index to use), and skipped by 0013's IF NOT EXISTS when it runs
-- again. Rebuilt here if so, holding writes to sessions while it is built:
-- only on a database whose first build failed (as 0007 does for 0006).
DO $$
BEGIN
  IF EXISTS (
    SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
    WHERE c.relname = 'sessions_by_request'
      AND c.relnamespace = current_schema()::regnamespace
      AND NOT i.indisvalid
  ) THEN
    REINDEX INDEX sessions_by_request;
  END IF;
END
$$;
