"""A shard's item path, one module per stage: read → render → answer → register →
generate → record → encode."""
