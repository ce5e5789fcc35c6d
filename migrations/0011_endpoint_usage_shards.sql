-- What operators see of remote work (issue 18, item 6): an endpoint's figures per job
-- *and shard*, so each shard's ShardSummary carries its own (the job's workflow sums
-- them, as it sums GPU usage), and the time requests spent at the server beside the
-- time they waited for the rate budget (`rate_wait_s`): which of the two is larger
-- says whether a job is rate-bound or engine-bound. Rows from before have shard -1.
ALTER TABLE endpoint_usage ADD COLUMN shard integer NOT NULL DEFAULT -1;
ALTER TABLE endpoint_usage ADD COLUMN server_s double precision NOT NULL DEFAULT 0;
ALTER TABLE endpoint_usage DROP CONSTRAINT endpoint_usage_pkey;
ALTER TABLE endpoint_usage ADD PRIMARY KEY (job_id, endpoint, shard);
