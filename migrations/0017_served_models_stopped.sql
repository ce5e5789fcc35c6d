-- When a queue's last recorded worker stopped (issue 53, item 11). `llm-batch queues`
-- counts a worker whose row is fresh and not stopped as serving its queue, beside the
-- pollers Temporal saw lately: a worker whose every activity slot is busy does not
-- poll, and Temporal goes on listing one that stopped for minutes. A worker that
-- records its row again clears the mark.
ALTER TABLE served_models ADD COLUMN stopped_at timestamptz;
