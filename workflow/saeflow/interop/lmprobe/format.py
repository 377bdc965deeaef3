"""The lmprobe 2.0 format's names (file and key patterns, index columns) and the options of a dataset."""

import dataclasses

from saeflow import config
from saeflow.errors import SaeflowError

FORMAT_VERSION = "2.0"
PARQUET_PATH = "index/train-00000-of-00001.parquet"
HIDDEN_FILE_PATTERN = "tensors/hidden_layer{layer:03d}_shard{shard:03d}.safetensors"
HIDDEN_KEY_PATTERN = "hidden.layer_{layer}"
LOGITS_FILE_PATTERN = "tensors/logits_topk_{shard:03d}.safetensors"
LOGITS_KEYS = ("logits_topk.values", "logits_topk.indices")
SPEC_LOGITS_KEYS = ("topk_values", "topk_indices")
STORAGES = config.enum("export_spec", "lmprobe", "storage")
CORE_COLUMNS = {"text", "label", "num_tokens", "shard_index", "row_offset", "token_offset", "token_shard_ids",
                "token_shard_offsets", "shard_index_logits", "row_offset_logits", "perplexity_mean",
                "perplexity_min", "perplexity_max", "token_ids", "token_perplexity", "token_strings"}


@dataclasses.dataclass(frozen=True)
class LmprobeOptions:
    """What an lmprobe dataset holds (`exports.<name>.lmprobe`); `defaults` are the schema's."""

    storage: str  # "pooled" (last-token vectors) or "full_sequence" (every token, plus last-token shards)
    prompts_per_shard: int  # prompts per safetensors shard
    top_k: int  # top-k logits at the last token; 0: no logits shards
    perplexity: bool  # perplexity_mean/min/max and token_perplexity columns
    token_ids: bool  # a token_ids column
    token_strings: bool  # a token_strings column
    allow_duplicate_texts: bool  # lmprobe maps text -> label, so duplicates are refused unless set

    @classmethod
    def defaults(cls, **overrides) -> "LmprobeOptions":
        """The schema's defaults, with `overrides` (for writing without an export spec)."""
        return cls(**{**config.export_defaults(cls, "lmprobe"), **overrides})

    def __post_init__(self):
        if self.storage not in STORAGES:
            raise SaeflowError(f"lmprobe storage must be one of {STORAGES}, got {self.storage!r}")
        if self.prompts_per_shard < 1 or self.top_k < 0:
            raise SaeflowError("lmprobe prompts_per_shard must be >= 1 and top_k >= 0")
