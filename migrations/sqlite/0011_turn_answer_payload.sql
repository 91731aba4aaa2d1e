-- A turn's final answer's payload, kept beside its answer: later turns get
-- it in their history (a remote A2A agent's conversation, for one). NULL
-- for none, and in the rows of every turn that ended before this column.
ALTER TABLE turns ADD COLUMN answer_payload TEXT;
