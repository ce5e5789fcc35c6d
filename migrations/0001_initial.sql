-- Jobs, the item ledger (the source of truth for "done") and the dead-letter list.

CREATE TABLE jobs (
    job_id            text PRIMARY KEY,
    spec              jsonb       NOT NULL,
    model             text        NOT NULL,
    status            text        NOT NULL DEFAULT 'running',
    output_uri        text        NOT NULL,
    items_total       bigint      NOT NULL DEFAULT 0,
    items_succeeded   bigint      NOT NULL DEFAULT 0,
    items_dead        bigint      NOT NULL DEFAULT 0,
    prompt_tokens     bigint      NOT NULL DEFAULT 0,
    completion_tokens bigint      NOT NULL DEFAULT 0,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    finished_at       timestamptz
);

CREATE TABLE items (
    job_id            text        NOT NULL,
    item_id           text        NOT NULL,
    shard             integer     NOT NULL,
    ordinal           bigint      NOT NULL,
    status            text        NOT NULL DEFAULT 'pending'
                      CHECK (status IN ('pending', 'running', 'succeeded', 'dead')),
    attempt           integer     NOT NULL DEFAULT 0,
    lease_owner       text,
    prompt_hash       text,
    source            text,
    result            jsonb,
    prompt_tokens     integer,
    completion_tokens integer,
    latency_ms        double precision,
    error_class       text,
    error_message     text,
    started_at        timestamptz,
    finished_at       timestamptz,
    updated_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, item_id)
);

-- Output order within a shard. No status column here: with one, the planner walks
-- every running row of a job for each batch of results instead of using the key.
CREATE INDEX items_by_shard ON items (job_id, shard, ordinal);

CREATE TABLE dead_letters (
    job_id        text        NOT NULL,
    item_id       text        NOT NULL,
    shard         integer     NOT NULL,
    error_class   text        NOT NULL,
    error_message text        NOT NULL,
    source        text,
    attempts      integer     NOT NULL DEFAULT 0,
    created_at    timestamptz NOT NULL DEFAULT now(),
    redriven_at   timestamptz,
    PRIMARY KEY (job_id, item_id)
);
