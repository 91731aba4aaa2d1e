-- CreateSession's idempotency key: a creation repeated with the same user
-- and request_id answers the session the first one made. Sessions made
-- without a key leave it NULL, which the index leaves out.
ALTER TABLE sessions ADD COLUMN request_id TEXT;
CREATE UNIQUE INDEX sessions_by_request ON sessions (user_id, request_id)
    WHERE request_id IS NOT NULL;
