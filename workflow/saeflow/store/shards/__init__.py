"""The saev protocol 2.0 shard store: content-addressed directories of activations, published atomically.

`metadata` is the hashed description and the sizing maths, `validate` checks a directory without trusting it,
`reader` memory-maps a published one and `writer` streams examples into one. Every path of a shard directory
comes from `saeflow.store.layout.ShardLayout`; docs/store.md describes each file and the crash/resume/concurrency
guarantees.
"""

from saeflow.store.shards.metadata import (
    AUX_FILES,
    DEFAULT_PATCHES_PER_SHARD,
    DTYPES,
    INTRODUCED_DATA,
    PROTOCOL,
    AuxSpec,
    Metadata,
    canonical_data,
    data_value,
    expected_shards_json,
    locate,
)
from saeflow.store.shards.reader import ShardDir, open_existing
from saeflow.store.shards.validate import Report, validate
from saeflow.store.shards.writer import ShardWriter

__all__ = [
    "AUX_FILES",
    "DEFAULT_PATCHES_PER_SHARD",
    "DTYPES",
    "INTRODUCED_DATA",
    "PROTOCOL",
    "AuxSpec",
    "Metadata",
    "Report",
    "canonical_data",
    "data_value",
    "ShardDir",
    "ShardWriter",
    "expected_shards_json",
    "locate",
    "open_existing",
    "validate",
]
