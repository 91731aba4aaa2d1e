-- The event log moves to one row per group commit: a batch's events as one
-- protobuf blob (see src/store/codec.rs). A row per event cost an insert and
-- an index update on every event.
CREATE TABLE event_batches (
    session_id  TEXT NOT NULL,
    request_id  TEXT NOT NULL,
    first_seq   BIGINT NOT NULL,
    last_seq    BIGINT NOT NULL,
    events      BLOB NOT NULL,
    PRIMARY KEY (session_id, request_id, first_seq),
    FOREIGN KEY (session_id, request_id) REFERENCES turns (session_id, request_id) ON DELETE CASCADE
);

-- A turn's final answer, kept beside it so the history that agents receive
-- is read without decoding event logs.
ALTER TABLE turns ADD COLUMN answer TEXT;
UPDATE turns SET answer = (
    SELECT e.text FROM events e
    WHERE e.session_id = turns.session_id AND e.request_id = turns.request_id AND e.kind = 'final_answer'
    ORDER BY e.seq DESC LIMIT 1
);

-- Rows of the old per-event table are moved into batches by the server at
-- start-up (it holds the codec); the table stays until a later migration.
