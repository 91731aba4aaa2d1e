-- Tasks that ended, by last update: what retention prunes, oldest first.
CREATE INDEX a2a_tasks_ended ON a2a_tasks (updated_at) WHERE terminal = 1;
