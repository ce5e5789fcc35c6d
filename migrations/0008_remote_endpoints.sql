-- Remote endpoints (issue 18): OpenAI-compatible servers and APIs that remote workers
-- call, declared once. The API key is never stored: `api_key_env` names the
-- environment variable (or `api_key_file` the file) the worker reads it from.
CREATE TABLE endpoints (
    name            text             PRIMARY KEY,
    base_url        text             NOT NULL,
    api_key_env     text,
    api_key_file    text,
    rpm             integer          CHECK (rpm IS NULL OR rpm > 0),
    tpm             bigint           CHECK (tpm IS NULL OR tpm > 0),
    max_concurrency integer          NOT NULL DEFAULT 64 CHECK (max_concurrency > 0),
    -- USD per million tokens.
    input_price     double precision CHECK (input_price IS NULL OR input_price >= 0),
    output_price    double precision CHECK (output_price IS NULL OR output_price >= 0),
    timeout_s       double precision NOT NULL DEFAULT 600 CHECK (timeout_s > 0),
    created_at      timestamptz      NOT NULL DEFAULT now(),
    updated_at      timestamptz      NOT NULL DEFAULT now(),
    -- The budget every worker of the endpoint shares (llmbatch.remote.budget): two
    -- token buckets (requests, tokens) refilled by elapsed time at the limits times
    -- `send_factor`, the AIMD share of the limits the endpoint is sent at now (halved
    -- on a 429, raised again a little every second), and a shared Retry-After.
    req_level       double precision NOT NULL DEFAULT 0,
    tok_level       double precision NOT NULL DEFAULT 0,
    refilled_at     timestamptz      NOT NULL DEFAULT now(),
    send_factor     double precision NOT NULL DEFAULT 1 CHECK (send_factor > 0 AND send_factor <= 1),
    decreased_at    timestamptz      NOT NULL DEFAULT 'epoch',
    blocked_until   timestamptz      NOT NULL DEFAULT 'epoch',
    -- Counters for operators: what every worker sent and what the endpoint refused.
    requests_sent   bigint           NOT NULL DEFAULT 0,
    throttled       bigint           NOT NULL DEFAULT 0,
    retries         bigint           NOT NULL DEFAULT 0
);

-- Per job: what its requests did on the endpoint (requests, 429s, retries, tokens
-- and their cost), and why a job was paused by llm-batch itself (a key the
-- endpoint refuses, a model it does not serve, the cost cap).
CREATE TABLE endpoint_usage (
    job_id            text             NOT NULL,
    endpoint          text             NOT NULL,
    requests          bigint           NOT NULL DEFAULT 0,
    throttled         bigint           NOT NULL DEFAULT 0,
    retries           bigint           NOT NULL DEFAULT 0,
    prompt_tokens     bigint           NOT NULL DEFAULT 0,
    completion_tokens bigint           NOT NULL DEFAULT 0,
    cost_usd          double precision NOT NULL DEFAULT 0,
    rate_wait_s       double precision NOT NULL DEFAULT 0,
    updated_at        timestamptz      NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, endpoint)
);

ALTER TABLE jobs ADD COLUMN paused_reason text;
