-- A job can be paused (the pause update of BatchJobWorkflow): its running `generate`
-- activities cannot receive signals, so they read this flag and hold back new engine
-- requests while it is set.

ALTER TABLE jobs ADD COLUMN paused boolean NOT NULL DEFAULT false;
