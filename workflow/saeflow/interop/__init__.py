"""Interop formats: lmprobe 2.0 datasets, a Zarr activation store, gzip-pickle shards; all via `records.Record`."""
