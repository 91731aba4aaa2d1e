-- no-transaction
-- ListTasks lists a caller's tasks most recently updated first (the A2A
-- specification's order), and pages by (updated_at, id). Built without
-- holding writes to the table (replicas of the release before keep serving
-- while it is built).
CREATE INDEX CONCURRENTLY IF NOT EXISTS a2a_tasks_by_owner_update ON a2a_tasks (owner, updated_at, id);
