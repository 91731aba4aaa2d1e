-- 0006 builds its index CONCURRENTLY. A build that fails (replicas of a new
-- deployment starting together deadlocked it, before they took turns to
-- migrate) leaves the index behind, invalid: never used, and skipped by
-- 0006's IF NOT EXISTS when it runs again. Rebuilt here if so, holding
-- writes to a2a_tasks while it is built: only on such a database (a new
-- deployment whose first start failed, with few tasks yet).
DO $$
BEGIN
  IF EXISTS (
    SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
    WHERE c.relname = 'a2a_tasks_ended'
      AND c.relnamespace = current_schema()::regnamespace
      AND NOT i.indisvalid
  ) THEN
    REINDEX INDEX a2a_tasks_ended;
  END IF;
END
$$;
