"""The saev protocol 2.0 shard store: content-addressed directories of activations, written atomically.

`metadata` holds the hashed description and the sizing maths, `validate` checks a directory without trusting it,
`reader` memory-maps a published one and `writer` streams examples into one. Where each file of a shard directory
lives is `saeflow.layout.ShardLayout`; docs/store.md describes every file and the crash/resume/concurrency guarantees.
"""

from saeflow import atomic  # noqa: F401 (test_shards reaches it as `shards.atomic`, from when the store was one module)
from saeflow.shards.metadata import (
    AUX_FILES,
    DEFAULT_PATCHES_PER_SHARD,
    DTYPES,
    PROTOCOL,
    AuxSpec,
    Metadata,
    aux_n_bytes,
    aux_row_bytes,
    ex_per_shard,
    expected_shards_json,
    locate,
    shard_sizes,
    tokens_per_ex,
)
from saeflow.shards.reader import ShardDir, open_existing
from saeflow.shards.validate import Report, read_json, validate
from saeflow.shards.writer import ShardWriter

__all__ = [
    "AUX_FILES",
    "DEFAULT_PATCHES_PER_SHARD",
    "DTYPES",
    "PROTOCOL",
    "AuxSpec",
    "Metadata",
    "Report",
    "ShardDir",
    "ShardWriter",
    "aux_n_bytes",
    "aux_row_bytes",
    "ex_per_shard",
    "expected_shards_json",
    "locate",
    "open_existing",
    "read_json",
    "shard_sizes",
    "tokens_per_ex",
    "validate",
]
