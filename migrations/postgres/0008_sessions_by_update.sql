-- no-transaction
-- Sessions by last update (creation, or a turn claimed in them): retention
-- deletes those left with no turns, oldest first. Built without holding
-- writes to the table (replicas of the release before keep serving while
-- it is built).
CREATE INDEX CONCURRENTLY IF NOT EXISTS sessions_by_update ON sessions (updated_at);
