-- no-transaction
-- The idempotency keys of CreateSession (migration 12), one session per
-- (user, key). Built without holding writes to the table (replicas of the
-- release before keep creating sessions, without keys, while it is built).
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS sessions_by_request
    ON sessions (user_id, request_id) WHERE request_id IS NOT NULL;
