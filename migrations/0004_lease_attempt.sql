-- Which activity and attempt hold a running item, apart from the lease owner string:
-- a claim must never take items from a newer attempt of the same activity (a worker
-- that was stopped with a task in hand wakes up as an older, stale attempt).

ALTER TABLE items ADD COLUMN lease_activity text;
ALTER TABLE items ADD COLUMN lease_attempt integer;
