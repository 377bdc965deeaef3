"""lmprobe dataset format 2.0 (specs/lmprobe-dataset-format-2.0.txt): format.py (names, options), write.py, read.py.

Where lmprobe 0.10.3's own reader differs from the spec text we follow the reader (specs/README.md):
logits tensors are keyed `logits_topk.values` / `logits_topk.indices`; file and key patterns are always the
defaults below (lmprobe ignores custom ones); the index is `index/train-00000-of-00001.parquet`.
Full-sequence storage follows lmprobe's own layout: shards 0..last_token_shards-1 hold each prompt's last token;
the sequence shards after them hold tokens 0..T-2 of each prompt, and `token_shard_ids[-1]` points at the
last-token shard. Our reader also accepts the spec's `topk_values` / `topk_indices` keys.
"""

from saeflow.interop.lmprobe.format import HIDDEN_FILE_PATTERN, PARQUET_PATH, STORAGES, LmprobeOptions
from saeflow.interop.lmprobe.read import LmprobeDataset, read_info, read_safetensors_header, read_tensor, validate
from saeflow.interop.lmprobe.write import check_duplicates, write

__all__ = ["HIDDEN_FILE_PATTERN", "PARQUET_PATH", "STORAGES", "LmprobeDataset", "LmprobeOptions", "check_duplicates",
           "read_info", "read_safetensors_header", "read_tensor", "validate", "write"]
