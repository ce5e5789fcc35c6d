-- Endpoint waits and faults that operators see and lift (issue 53, items 2, 3 and 6).
-- `generation` counts up when an operator lifts the endpoint's wait (`endpoint update`,
-- `resume` of one of its jobs): running workers read it every second and drop the
-- waits they hold in memory. `blocked_reason` says why `blocked_until` holds (the
-- 429's message and the Retry-After asked, capped). The last error of the endpoint's
-- requests (a fault class of llmbatch.contract.states.EndpointFault, its message,
-- when) is kept for the endpoint and for each job's shard, for `status`.
ALTER TABLE endpoints ADD COLUMN generation bigint NOT NULL DEFAULT 0;
ALTER TABLE endpoints ADD COLUMN blocked_reason text;
ALTER TABLE endpoints ADD COLUMN last_error_class text;
ALTER TABLE endpoints ADD COLUMN last_error text;
ALTER TABLE endpoints ADD COLUMN last_error_at timestamptz;
ALTER TABLE endpoint_usage ADD COLUMN last_error_class text;
ALTER TABLE endpoint_usage ADD COLUMN last_error text;
ALTER TABLE endpoint_usage ADD COLUMN last_error_at timestamptz;
