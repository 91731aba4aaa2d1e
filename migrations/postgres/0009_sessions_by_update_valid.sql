-- A CONCURRENTLY build that fails (its process killed, say) leaves 0008's
-- index behind, invalid: never used, and skipped by 0008's IF NOT EXISTS
-- when it runs again. Rebuilt here if so (as 0007 does for 0006's).
DO $$
BEGIN
  IF EXISTS (
    SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
    WHERE c.relname = 'sessions_by_update'
      AND c.relnamespace = current_schema()::regnamespace
      AND NOT i.indisvalid
  ) THEN
    REINDEX INDEX sessions_by_update;
  END IF;
END
$$;
