"""The in-memory per-example record every interop sink writes and every interop reader yields.

Converters go format -> records -> format, never format-to-format. Layer numbers follow the extraction engine:
layer k is the output of transformer block k, i.e. Hugging Face `hidden_states[k + 1]` (the embeddings are
`hidden_states[0]` and are not a layer).
"""

import csv
import dataclasses
import json
import pathlib
import typing

import numpy as np

from saeflow.errors import SaeflowError


@dataclasses.dataclass(frozen=True)
class Record:
    """One prompt (and optionally the model's greedy response) with its activations.

    acts: {layer: (T, D) float32} for the T prompt tokens; pooled formats carry one token (T = 1): the last, or
    token 0 for an lmprobe dataset pooled at its first token (`Source.pooling` says which).
    topk_values/topk_indices: (k,) logits at the last prompt token, largest first.
    token_nll: (T - 1,) negative log-likelihood of tokens 1..T-1 given their prefix (natural log).
    response_*: the greedy continuation (R tokens) and its activations {layer: (R, D)}.
    """

    text: str
    acts: dict[int, np.ndarray]
    label: int | str | None = None
    token_ids: np.ndarray | None = None
    token_strings: tuple[str, ...] | None = None
    topk_values: np.ndarray | None = None
    topk_indices: np.ndarray | None = None
    token_nll: np.ndarray | None = None
    response_text: str | None = None
    response_ids: np.ndarray | None = None
    response_acts: dict[int, np.ndarray] | None = None
    extra: dict = dataclasses.field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return next(iter(self.acts.values())).shape[0]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.acts)

    def perplexity_stats(self) -> tuple[float, float, float] | None:
        """(mean, min, max) perplexity as lmprobe computes it: exp of the mean/min/max token NLL."""
        if self.token_nll is None or len(self.token_nll) == 0:
            return None
        nll = np.asarray(self.token_nll, dtype=np.float64)
        return float(np.exp(nll.mean())), float(np.exp(nll.min())), float(np.exp(nll.max()))


def check_uniform(records: typing.Sequence[Record], where: str) -> tuple[tuple[int, ...], int]:
    """Every record has the same layers and width; returns (layers, d_model) or says which record differs."""
    if not records:
        raise SaeflowError(f"{where}: no examples to write")
    layers = records[0].layers
    d_model = records[0].acts[layers[0]].shape[-1]
    for i, rec in enumerate(records):
        if rec.layers != layers:
            raise SaeflowError(f"{where}: example {i} has layers {list(rec.layers)}, example 0 has {list(layers)}")
        for layer, acts_td in rec.acts.items():
            if acts_td.ndim != 2 or acts_td.shape[1] != d_model or acts_td.shape[0] != rec.n_tokens:
                raise SaeflowError(
                    f"{where}: example {i} layer {layer} has shape {acts_td.shape}, "
                    f"expected ({rec.n_tokens}, {d_model})"
                )
    return layers, d_model


# ---------------------------------------------------------------------------------------------------------------
# Prompt datasets: a table with a `text` column, an optional `label` column, and any extra columns
# ---------------------------------------------------------------------------------------------------------------


def read_prompts(fpath: str | pathlib.Path, text_key: str = "text", label_key: str = "label") -> list[dict]:
    """Rows of a .jsonl, .csv or .parquet prompt table as dicts with `text`, `label` and the other columns."""
    fpath = pathlib.Path(fpath)
    if not fpath.is_file():
        raise SaeflowError(f"prompt dataset {fpath} does not exist")
    suffix = fpath.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = []
        for line_no, line in enumerate(fpath.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise SaeflowError(f"{fpath}:{line_no}: not valid JSON ({err})") from None
            if not isinstance(row, dict):
                raise SaeflowError(f"{fpath}:{line_no}: each line must be a JSON object")
            rows.append(row)
    elif suffix == ".csv":
        with open(fpath, newline="", encoding="utf-8") as fd:
            rows = list(csv.DictReader(fd))
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(fpath).to_pylist()
    else:
        raise SaeflowError(f"prompt dataset {fpath}: unknown format {suffix!r} (use .jsonl, .csv or .parquet)")
    out = []
    for i, row in enumerate(rows):
        text = row.pop(text_key, None)
        if not isinstance(text, str) or not text:
            raise SaeflowError(f"{fpath}: row {i} has no non-empty string column {text_key!r}")
        label = row.pop(label_key, None)
        if isinstance(label, str) and suffix == ".csv" and label.lstrip("-").isdigit():
            label = int(label)
        out.append({"text": text, "label": label, "extra": row})
    if not out:
        raise SaeflowError(f"prompt dataset {fpath} has no rows")
    return out
