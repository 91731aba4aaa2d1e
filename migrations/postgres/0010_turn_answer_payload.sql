-- A turn's final answer's payload, kept beside its answer: later turns get
-- it in their history (a remote A2A agent's conversation, for one). NULL
-- for none, and in the rows of every turn that ended before this column or
-- on a replica of the release before, which neither reads nor writes it
-- and keeps serving beside this one during a rollout (adding a nullable
-- column without a default rewrites nothing and holds the table for a
-- moment only).
ALTER TABLE turns ADD COLUMN IF NOT EXISTS answer_payload TEXT;
