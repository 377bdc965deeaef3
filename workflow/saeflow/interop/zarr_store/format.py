"""The Zarr store's names (schema version, text files, per-sample arrays) and the options of a store."""

import dataclasses
import hashlib

from saeflow import config
from saeflow.errors import SaeflowError

SCHEMA_VERSION = "saeflow-zarr-activations-1"
MANIFEST_FNAME = "manifest.json"
PROMPT, RESPONSE = "prompt", "response"
TEXT_FILES = {PROMPT: "text/prompts.jsonl", RESPONSE: "text/responses.jsonl", "extra": "text/extra_metadata.jsonl"}
SAMPLE_CORE = ("prompt_len", "response_len", "sample_key", "label")  # per-sample arrays that are not extra fields


@dataclasses.dataclass(frozen=True)
class ZarrOptions:
    """The layout of a store (`exports.<name>.zarr` but workers/merge); `defaults` are the schema's."""

    prompt_max: int  # P_max: stored prompt tokens (pad/truncate)
    response_max: int  # R_max: stored response tokens; 0 = no response arrays
    t_chunk_prompt: int  # prompt chunk length along tokens (aim for 0.5-2 MB chunks)
    samples_per_shard: int  # samples per writer shard

    @classmethod
    def defaults(cls, **overrides) -> "ZarrOptions":
        """The schema's defaults, with `overrides` (for writing without an export spec)."""
        return cls(**{**config.export_defaults(cls, "zarr"), **overrides})

    def __post_init__(self):
        if self.prompt_max < 1 or self.response_max < 0 or self.t_chunk_prompt < 1 or self.samples_per_shard < 1:
            raise SaeflowError(f"invalid zarr options {self}: prompt_max, t_chunk_prompt, samples_per_shard >= 1")


def sample_key(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).hexdigest().encode("ascii")


def shard_dname(shard: int) -> str:
    return f"shard-{shard:04d}.zarr"
