-- no-transaction
-- Tasks that ended, by last update: what retention prunes, oldest first.
-- Built without holding writes to the table (replicas of the release before
-- keep serving while it is built).
CREATE INDEX CONCURRENTLY IF NOT EXISTS a2a_tasks_ended ON a2a_tasks (updated_at) WHERE terminal = 1;
