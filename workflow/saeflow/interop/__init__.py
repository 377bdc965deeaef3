"""Other tools' formats: lmprobe 2.0 datasets, Zarr activation stores, gzip-pickle shards (all via `records.Record`),
saev shard directories, and SAE checkpoints of SAELens and sparsify."""
