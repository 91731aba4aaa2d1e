-- Every session counts the turns ever claimed in it. A replica that keeps a
-- session's history in memory reads the count with each claim it makes in
-- that session: a count it did not expect says another replica claimed a
-- turn there since, and the history is read again (src/store/session_cache.rs).
--
-- The count is kept by a trigger, so that every insert of a turn counts,
-- whichever release of agentd made it: replicas of the release before keep
-- serving beside this one during a rollout. The trigger also marks the
-- session updated by its newest claim, as those replicas' claims do in
-- their own statement (a second update of the same row by them, during the
-- rollout only). Adding a column with a constant default rewrites nothing.
ALTER TABLE sessions ADD COLUMN IF NOT EXISTS claims BIGINT NOT NULL DEFAULT 0;

CREATE OR REPLACE FUNCTION agentd_count_claims() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE sessions s
    SET claims = s.claims + c.n, updated_at = GREATEST(s.updated_at, c.at)
    FROM (
        SELECT session_id, count(*) AS n, max(created_at) AS at
        FROM claimed GROUP BY session_id
    ) c
    WHERE s.id = c.session_id;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS turns_count_claims ON turns;
CREATE TRIGGER turns_count_claims
    AFTER INSERT ON turns
    REFERENCING NEW TABLE AS claimed
    FOR EACH STATEMENT EXECUTE FUNCTION agentd_count_claims();
