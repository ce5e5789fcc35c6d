-- Ledger retention (issue 20): `llm-batch purge` deletes a finished job's item rows and
-- the rows that depend on them, and keeps the job's own row (its totals) as history.
-- purge_started_at is set before the first row goes, in the job's row, which a
-- dead-letter re-drive locks before it makes items pending again: so a re-drive and a
-- purge of one job never interleave. purged_at is set once every row is gone; a purge
-- that was interrupted is finished by the next one.
ALTER TABLE jobs ADD COLUMN purge_started_at timestamptz;
ALTER TABLE jobs ADD COLUMN purged_at timestamptz;

-- Purging by age walks only finished jobs not purged yet, oldest first.
CREATE INDEX jobs_to_purge ON jobs (finished_at) WHERE purged_at IS NULL AND finished_at IS NOT NULL;
