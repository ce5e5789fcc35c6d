-- The OpenAI Batch API (`llm-batch serve`): API keys by project, files, and batches.
-- The server keeps nothing in memory that matters: these rows, the file bytes in the
-- object store and the batch's own BatchJobWorkflow (workflow id = job id = batch id)
-- are the whole of a batch, so any replica answers for any batch.

CREATE TABLE api_keys (
    key_id     text        PRIMARY KEY,            -- "key_<hex>", shown by `api-key list`
    project    text        NOT NULL,
    key_hash   text        NOT NULL UNIQUE,        -- sha256 hex of the secret; never the secret
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);

CREATE TABLE api_files (
    file_id    text        PRIMARY KEY,            -- "file-<hex>"
    project    text        NOT NULL,
    purpose    text        NOT NULL,               -- batch | batch_output
    filename   text        NOT NULL,
    bytes      bigint      NOT NULL,
    object_uri text        NOT NULL,               -- where the bytes are; never from a caller
    created_at timestamptz NOT NULL DEFAULT now(),
    deleted_at timestamptz
);
-- Listing: newest first within a project, with `after` as a keyset cursor.
CREATE INDEX api_files_by_project ON api_files (project, created_at DESC, file_id DESC);

CREATE TABLE api_batches (
    batch_id          text        PRIMARY KEY,     -- "batch_<hex>": also the job id
    project           text        NOT NULL,
    input_file_id     text        NOT NULL,
    endpoint          text        NOT NULL,
    completion_window text        NOT NULL,
    model             text        NOT NULL,
    metadata          jsonb,
    status            text        NOT NULL DEFAULT 'validating',
    errors            jsonb,                       -- [{code, message, param, line}]
    output_file_id    text,
    error_file_id     text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    expires_at        timestamptz NOT NULL,
    in_progress_at    timestamptz,
    finalizing_at     timestamptz,
    completed_at      timestamptz,
    failed_at         timestamptz,
    expired_at        timestamptz,
    cancelling_at     timestamptz,
    cancelled_at      timestamptz
);
CREATE INDEX api_batches_by_project ON api_batches (project, created_at DESC, batch_id DESC);
