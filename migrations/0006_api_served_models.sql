-- The models GPU workers serve, so `GET /v1/models` can name them: task queue names
-- are hashed (Settings.gpu_task_queue), so the names cannot be read back from Temporal.
-- A GPU worker records its queue at start and refreshes last_seen while it runs; the
-- server lists the rows whose queue has pollers now (DescribeTaskQueue), so a row of a
-- stopped worker is harmless.
CREATE TABLE served_models (
    task_queue text        PRIMARY KEY,
    model      text        NOT NULL,
    task       text        NOT NULL,
    identity   text        NOT NULL,       -- the last worker that recorded it
    first_seen timestamptz NOT NULL DEFAULT now(),
    last_seen  timestamptz NOT NULL DEFAULT now()
);

-- Lines counted while an upload streams in, so a batch over the requests-per-batch
-- limit is refused at creation without reading the file again. Null for files the
-- server did not receive (a batch's output and error files).
ALTER TABLE api_files ADD COLUMN lines bigint;
