-- Models routed to remote endpoints (issue 18): `llm-batch endpoint add|update NAME
-- --serve-as MODEL` declares that a job or an OpenAI Batch API batch naming MODEL (for
-- the task) runs on the endpoint's remote worker queue instead of a GPU queue. One
-- endpoint per (model, task), so a name never means two places; read by the API
-- (batches and GET /v1/models), `llm-batch submit` and `llm-batch schedule create`.
CREATE TABLE endpoint_models (
    model      text        NOT NULL,
    task       text        NOT NULL,
    endpoint   text        NOT NULL REFERENCES endpoints (name) ON DELETE CASCADE,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (model, task)
);
CREATE INDEX endpoint_models_endpoint ON endpoint_models (endpoint);
