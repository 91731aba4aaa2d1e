-- A2A tasks: the serialized task (A2A JSON) plus the columns ListTasks
-- filters and pages on. A task belongs to the session of its context and is
-- removed with it. Times are microseconds since the Unix epoch.
CREATE TABLE a2a_tasks (
    id          TEXT PRIMARY KEY NOT NULL,
    context_id  TEXT NOT NULL,
    -- Set once the task's executor has named its session (see
    -- src/store/a2a_tasks.rs); removed with that session.
    session_id  TEXT REFERENCES sessions (id) ON DELETE CASCADE,
    state       TEXT NOT NULL,
    terminal    BIGINT NOT NULL,
    status_at   BIGINT,
    task_json   TEXT NOT NULL,
    version     BIGINT NOT NULL,
    created_at  BIGINT NOT NULL,
    updated_at  BIGINT NOT NULL
);
CREATE INDEX a2a_tasks_by_created ON a2a_tasks (created_at, id);
CREATE INDEX a2a_tasks_by_context ON a2a_tasks (context_id, created_at, id);
CREATE INDEX a2a_tasks_by_state ON a2a_tasks (state, created_at, id);
CREATE INDEX a2a_tasks_by_session ON a2a_tasks (session_id);
CREATE INDEX a2a_tasks_running ON a2a_tasks (terminal) WHERE terminal = 0;
