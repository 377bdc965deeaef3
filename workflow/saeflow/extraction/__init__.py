"""Extraction: an activation spec (model + dataset + layers) -> shard metadata (planning) -> a shard directory."""
