-- Every planned shard, so a shard that fails before its rows were read can still
-- account for each of its rows; and placeholder items that stand for such rows in
-- the ledger (dead, with the shard's failure as the reason) until a re-drive reads
-- the real rows and replaces them.

CREATE TABLE shards (
    job_id     text        NOT NULL,
    shard      integer     NOT NULL,
    uri        text        NOT NULL,
    first_row  bigint      NOT NULL,
    row_count  bigint      NOT NULL,
    first_line integer,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, shard)
);

ALTER TABLE items ADD COLUMN placeholder boolean NOT NULL DEFAULT false;
