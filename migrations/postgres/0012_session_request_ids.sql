-- CreateSession's idempotency key: a creation repeated with the same user
-- and request_id answers the session the first one made. Sessions made
-- without a key leave it NULL. Adding a column without a default rewrites
-- nothing; replicas of the release before ignore it.
ALTER TABLE sessions ADD COLUMN IF NOT EXISTS request_id TEXT;
