-- ListTasks lists a caller's tasks most recently updated first (the A2A
-- specification's order), and pages by (updated_at, id).
CREATE INDEX a2a_tasks_by_owner_update ON a2a_tasks (owner, updated_at, id);
