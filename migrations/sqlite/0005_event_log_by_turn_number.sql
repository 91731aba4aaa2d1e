-- Turns get a number, in the order they are claimed, and the event log is
-- keyed by it instead of by (session_id, request_id). Session ids are
-- random, so batches of the turns running at one moment went into the old
-- key's index at random places: every commit rewrote one 64 KiB index page
-- per turn it held. Numbers of turns running together are close, so their
-- batches' index entries share the last page or two.
ALTER TABLE turns ADD COLUMN turn_no INTEGER;
UPDATE turns SET turn_no = rowid;
CREATE UNIQUE INDEX turns_by_number ON turns (turn_no);

CREATE TABLE ev.event_log (
    turn_no    INTEGER NOT NULL,
    first_seq  BIGINT NOT NULL,
    last_seq   BIGINT NOT NULL,
    events     BLOB NOT NULL,
    PRIMARY KEY (turn_no, first_seq)
);
INSERT INTO ev.event_log (turn_no, first_seq, last_seq, events)
    SELECT t.turn_no, b.first_seq, b.last_seq, b.events
    FROM ev.event_batches b JOIN turns t ON t.session_id = b.session_id AND t.request_id = b.request_id
    ORDER BY t.turn_no, b.first_seq;
DROP TABLE ev.event_batches;
