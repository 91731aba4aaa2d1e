-- A claimed turn marks its session updated in the statement that claims it,
-- so a group of claims is one statement (and one commit).
CREATE TRIGGER turns_claim_touches_session AFTER INSERT ON turns
BEGIN
    UPDATE sessions SET updated_at = NEW.created_at WHERE id = NEW.session_id;
END;
