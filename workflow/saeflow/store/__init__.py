"""The store: every byte saeflow keeps on disk (layout, atomic publishing, hashing, provenance, shard and run dirs)."""
