-- A generate attempt keeps its dedup leads alive with one row, its shard's, naming the
-- attempt's lease (issue 20): renewing every lead of the attempt at every heartbeat
-- wrote each lead again every 5 s, on a long shard more writes an item than claiming
-- and recording it. A lead counts as renewed at the later of its own time (when it
-- was taken, or renewed by a worker of an earlier release) and its shard's.
ALTER TABLE shards
    ADD COLUMN leads_lease      text,
    ADD COLUMN leads_renewed_at timestamptz;
