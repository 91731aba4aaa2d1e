-- Every A2A task belongs to the user who created it (the authenticated
-- caller, or a2a-anonymous without authentication), and a caller sees and
-- acts on its own tasks only (see src/store/a2a_tasks.rs).
ALTER TABLE a2a_tasks ADD COLUMN owner TEXT;
-- A task stored before belongs to the user of its session; one that never
-- named a session (refused before it ran) to a2a-anonymous, the user every
-- task ran as without authentication. A row an older release writes during a
-- rolling upgrade has no owner, and is read as its session's user's.
UPDATE a2a_tasks SET owner = COALESCE(
    (SELECT user_id FROM sessions WHERE sessions.id = a2a_tasks.session_id),
    'a2a-anonymous'
);
CREATE INDEX a2a_tasks_by_owner ON a2a_tasks (owner, created_at, id);
