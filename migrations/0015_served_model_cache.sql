-- What a queue's workers answer from the result cache (issue 20): the fingerprint of
-- the weights they serve (null: their results are not cached), and their cache
-- settings. The CPU worker's render step answers cached requests with them, so a
-- shard the cache answers whole never goes to a GPU worker, and a cached item is
-- written to the ledger once instead of three times. A worker clears its weights
-- when it stops; render trusts a row only while it is being refreshed.
ALTER TABLE served_models
    ADD COLUMN weights      text,
    ADD COLUMN cache        boolean NOT NULL DEFAULT false,
    ADD COLUMN cache_shared boolean NOT NULL DEFAULT false;
