"""Zarr v2 activation store (specs/zarr-activation-logger.md): format.py, write.py (shards, manifest, merge), read.py.

One store (`*.zarr`, consolidated metadata) holds N samples:

    arrays/prompt_activations    (N, L, P_max, H) float16, chunks (1, 1, T_chunk_prompt, H), no compression
    arrays/response_activations  (N, L, R_max, H) float16, chunks (1, 1, R_max, H)       (when R_max > 0)
    arrays/prompt_len, response_len  (N,) int32: true lengths capped at P_max / R_max
    arrays/sample_key            (N,) |S64: sha256 hex of the prompt text
    arrays/label                 (N,) int64, -1 = none                                      (integer labels only)
    text/prompts.jsonl, text/responses.jsonl, text/extra_metadata.jsonl   {"i", "sample_key", ...} per line
    .zattrs                      model, layers, sizes, chunking, truncation counts and fractions

Axis 1 indexes `layers` (the attrs list), not block numbers; the reader takes block numbers. Parallel writers
each publish `shards/shard-XXXX.zarr` (atomically); `manifest.json` maps global sample indices to shards.

compat.py writes format 2 under zarr-python 2.18 and 3.
"""

from saeflow.interop.zarr_store.format import MANIFEST_FNAME, PROMPT, RESPONSE, ZarrOptions, sample_key, shard_dname
from saeflow.interop.zarr_store.read import V3_METADATA_FNAME, ZarrReader, refuse_format_3
from saeflow.interop.zarr_store.write import merge, shard_bounds, write_manifest, write_store

__all__ = ["MANIFEST_FNAME", "PROMPT", "RESPONSE", "V3_METADATA_FNAME", "ZarrOptions", "ZarrReader", "merge",
           "refuse_format_3", "sample_key", "shard_bounds", "shard_dname", "write_manifest", "write_store"]
