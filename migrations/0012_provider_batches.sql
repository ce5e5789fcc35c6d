-- Provider batches (issue 19): endpoints that speak OpenAI's Files + Batches API take
-- whole shards as provider batches, at their own (batch) prices and within their limits.
CREATE TABLE endpoint_batch_api (
    endpoint           text             PRIMARY KEY REFERENCES endpoints (name) ON DELETE CASCADE,
    -- USD per million tokens at batch prices (usually half the online ones).
    batch_input_price  double precision CHECK (batch_input_price IS NULL OR batch_input_price >= 0),
    batch_output_price double precision CHECK (batch_output_price IS NULL OR batch_output_price >= 0),
    max_requests       integer          NOT NULL DEFAULT 50000 CHECK (max_requests > 0),
    max_bytes          bigint           NOT NULL DEFAULT 209715200 CHECK (max_bytes > 0),
    max_in_flight      integer          NOT NULL DEFAULT 100 CHECK (max_in_flight > 0),
    completion_window  text             NOT NULL DEFAULT '24h',
    updated_at         timestamptz      NOT NULL DEFAULT now()
);

-- One row per provider batch llm-batch creates (or is about to): `token` is derived
-- from (job, shard, re-drive, submission) and sent as the batch's metadata, so a retry after a
-- crash between "create" and "record" finds the batch on the provider instead of
-- paying for a second one. The file and batch ids are recorded before any wait.
CREATE TABLE provider_batches (
    token             text        PRIMARY KEY,
    job_id            text        NOT NULL,
    shard             integer     NOT NULL,
    submission        integer     NOT NULL,
    endpoint          text        NOT NULL,
    -- The ledger lease the batch's items are claimed under: results land only while
    -- it still holds them (fenced as the generate step's are).
    lease_owner       text        NOT NULL,
    input_file_id     text,
    url               text,
    batch_id          text,
    status            text        NOT NULL DEFAULT 'preparing',
    requests          integer     NOT NULL DEFAULT 0,
    completed         integer     NOT NULL DEFAULT 0,
    failed            integer     NOT NULL DEFAULT 0,
    -- Deduplicated requests: the lead item's id (the line's custom_id) -> the ids of
    -- the items that share its answer.
    followers         jsonb       NOT NULL DEFAULT '{}',
    collected         boolean     NOT NULL DEFAULT false,
    prompt_tokens     bigint      NOT NULL DEFAULT 0,
    completion_tokens bigint      NOT NULL DEFAULT 0,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX provider_batches_job ON provider_batches (job_id, shard);
