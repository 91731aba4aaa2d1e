-- Sessions, the turn side table keyed by (session_id, request_id), and the
-- event log. Times are microseconds since the Unix epoch.
CREATE TABLE sessions (
    id          TEXT PRIMARY KEY NOT NULL,
    user_id     TEXT NOT NULL,
    created_at  BIGINT NOT NULL,
    updated_at  BIGINT NOT NULL
);
CREATE INDEX sessions_by_user ON sessions (user_id, created_at, id);

CREATE TABLE turns (
    session_id        TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    request_id        TEXT NOT NULL,
    user_text         TEXT NOT NULL,
    agent             TEXT NOT NULL,
    state             TEXT NOT NULL,
    owner             TEXT NOT NULL,
    lease_expires_at  BIGINT NOT NULL,
    status_code       BIGINT,
    status_message    TEXT,
    created_at        BIGINT NOT NULL,
    updated_at        BIGINT NOT NULL,
    PRIMARY KEY (session_id, request_id)
);
CREATE INDEX turns_by_session ON turns (session_id, created_at);
CREATE INDEX turns_running ON turns (lease_expires_at) WHERE state = 'running';
CREATE INDEX turns_by_age ON turns (updated_at) WHERE state <> 'running';

CREATE TABLE events (
    session_id          TEXT NOT NULL,
    request_id          TEXT NOT NULL,
    seq                 BIGINT NOT NULL,
    kind                TEXT NOT NULL,
    author              TEXT NOT NULL,
    text                TEXT NOT NULL,
    tool_name           TEXT NOT NULL,
    tool_call_id        TEXT NOT NULL,
    payload_json        TEXT NOT NULL,
    created_unix_nanos  BIGINT NOT NULL,
    PRIMARY KEY (session_id, request_id, seq),
    FOREIGN KEY (session_id, request_id) REFERENCES turns (session_id, request_id) ON DELETE CASCADE
);
