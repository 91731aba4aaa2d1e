-- Sessions by last update (creation, or a turn claimed in them): retention
-- deletes those left with no turns, oldest first.
CREATE INDEX sessions_by_update ON sessions (updated_at);
