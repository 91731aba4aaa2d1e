-- The event log moves to a file of its own, attached to every connection as
-- `ev` (see src/store/sqlite.rs), with 64 KiB pages. A foreign key cannot
-- reach across files: the store deletes a turn's batches with the turn.
CREATE TABLE ev.event_batches (
    session_id  TEXT NOT NULL,
    request_id  TEXT NOT NULL,
    first_seq   BIGINT NOT NULL,
    last_seq    BIGINT NOT NULL,
    events      BLOB NOT NULL,
    PRIMARY KEY (session_id, request_id, first_seq)
);
INSERT INTO ev.event_batches (session_id, request_id, first_seq, last_seq, events)
    SELECT session_id, request_id, first_seq, last_seq, events FROM main.event_batches;
DROP TABLE main.event_batches;
