-- Provider batches in flight (issue 19): an endpoint's --batch-max-in-flight is enforced
-- by numbered slots. A shard's submission holds a row from before it creates its
-- provider batch until the batch ends (completed, failed, expired, cancelled); while no
-- slot is free its row waits with slot NULL (what `status` shows). Keyed by the
-- submission's batch token, so a retried take or release is a no-op, never a second
-- slot; the unique (endpoint, slot) caps what is in flight across jobs and workers.
CREATE TABLE provider_batch_slots (
    token      text        PRIMARY KEY,
    endpoint   text        NOT NULL,
    job_id     text        NOT NULL,
    shard      integer     NOT NULL,
    slot       integer     CHECK (slot IS NULL OR slot >= 0),
    created_at timestamptz NOT NULL DEFAULT now(),
    taken_at   timestamptz
);
CREATE UNIQUE INDEX provider_batch_slots_taken ON provider_batch_slots (endpoint, slot)
    WHERE slot IS NOT NULL;
CREATE INDEX provider_batch_slots_job ON provider_batch_slots (job_id);

-- How a routed model's batches run on its endpoint (issue 19): 'online' on the
-- endpoint's remote workers, 'batch' through the endpoint's Batch API.
ALTER TABLE endpoint_models ADD COLUMN via text NOT NULL DEFAULT 'online'
    CHECK (via IN ('online', 'batch'));
