-- Who holds a provider batch slot (issue 19): the workflow (id and run) whose take
-- activity wrote the row. A workflow that is terminated runs no code and never gives
-- its slot back; a take that finds no slot free describes the holders in Temporal and
-- frees the rows of those that are closed, fenced on the run it saw. checked_at spaces
-- those checks: a row is described at most once a period, however many shards wait.
-- created_at (0013) is when a waiting row began to wait: slots go to the oldest waiter.
ALTER TABLE provider_batch_slots
    ADD COLUMN workflow_id text,
    ADD COLUMN run_id      text,
    ADD COLUMN checked_at  timestamptz;
CREATE INDEX provider_batch_slots_queue ON provider_batch_slots (endpoint, created_at, token)
    WHERE slot IS NULL;
