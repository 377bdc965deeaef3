"""Sparse probing: which latents of an SAE predict the labels its validation shard directory carries.

    cfg = probe.ProbeConfig(run=RUN)                  # RUN/inference/<shard_hash>/ must exist (saeflow inference)
    fpath = probe.run_probe(cfg)                 # RUN/probe/<shard_hash>.json

Labels come from the shard directory's side files: `labels.bin` (one uint8 label per patch: segmentation folders,
generated shapes) is scored per patch, on that patch's codes; `classes.bin` (one class per example: image folders,
a `hf_dataset` label column) is scored per example, on the example's codes max-pooled over its tokens (the positions
the SAE trained on, the run's `tokens`). Each label value is one binary task (this label or not):

- held-out split by example, seeded: a `test_frac` of the examples (with all their patches) is never trained on;
- samples: per label up to `train_per_label` positives (`test_per_label` held out) and as many negatives from one
  uniform sample of the data, every choice a pure function of (seed, unit): the same on any machine, whatever the
  reading order. At most `max_units` patches or examples are held, so memory does not grow with the data;
- the best single latent: among the 20 latents of largest mean difference (positives minus negatives, training
  sample), the one with the highest training AUROC; its held-out AUROC, and the held-out F1 of "fires above t" at
  the t >= 0 that maximizes F1 on the training sample;
- k-sparse probes: the k latents of largest |mean difference| (SAEBench's selection), then logistic regression;
- a dense probe: logistic regression on the raw activations (per example: their mean over the same tokens).

The solvers are scikit-learn's: `LogisticRegression` (L2, C=1, lbfgs) after `StandardScaler`. AUROC (Mann-Whitney,
ties half), accuracy and F1 are computed here, for many columns at once (the tests compare them with
`sklearn.metrics`). Codes are read from the inference dump (`patch_acts.npz`, row by row: saeflow.analysis.csr_stream),
raw activations from the shards (one read per example), labels in chunks.
"""

import dataclasses
import logging
import os
import pathlib

import numpy as np
import scipy.sparse
import scipy.stats
import sklearn
import threadpoolctl  # scikit-learn's own dependency: BLAS threads
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from saeflow import config
from saeflow.analysis import latent_labels
from saeflow.analysis.csr_stream import CsrFile
from saeflow.analysis.probe_samples import LabelSource, Sample, label_sources, sample_units
from saeflow.errors import SaeflowError
from saeflow.store import atomic, layout, provenance, runs
from saeflow.store.hashing import read_json_object
from saeflow.store.layout import ShardLayout
from saeflow.store.shards import ShardDir
from saeflow.store.shards.metadata import locate

logger = logging.getLogger(__name__)

DEFAULTS = config.section_defaults("probe")
N_CANDIDATES = 20  # latents of largest mean difference considered for the best single latent (and shown per latent)
CHUNK_EX = 4096  # examples per read of codes and raw activations


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """One probe: which run and dump, how the data are split and sampled."""

    run: pathlib.Path
    shards_hash: str | None = None  # which dump (optional when the run has one)
    shards: pathlib.Path | None = None  # the dump's shard directory; None: the path its config.json records
    seed: int = DEFAULTS["seed"]
    test_frac: float = DEFAULTS["test_frac"]
    train_per_label: int = DEFAULTS["train_per_label"]
    test_per_label: int = DEFAULTS["test_per_label"]
    max_units: int = DEFAULTS["max_units"]
    ks: tuple[int, ...] = tuple(DEFAULTS["ks"])

    def __post_init__(self):
        object.__setattr__(self, "ks", tuple(sorted({int(k) for k in self.ks})))
        if not 0 < self.test_frac < 1:
            raise SaeflowError(f"probe test_frac must be in (0, 1), got {self.test_frac}")
        if min(self.train_per_label, self.test_per_label) < 2 or self.max_units < 16 or min(self.ks) < 1:
            raise SaeflowError("probe train_per_label and test_per_label must be at least 2, max_units at least 16, "
                               f"every k at least 1; got {self.train_per_label}, {self.test_per_label}, "
                               f"{self.max_units}, {list(self.ks)}")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Features: codes from the dump, raw activations from the shards
# ---------------------------------------------------------------------------------------------------------------


class RawReader:
    """One layer's (T, D) rows of an example, one pread each (protocol 4.2 offsets)."""

    def __init__(self, sd: ShardDir, layer: int):
        self.sd, self.layer, self.md = sd, layer, sd.metadata
        self.row_bytes = self.md.d_model * np.dtype(self.md.dtype).itemsize
        self._fds: dict[int, int] = {}

    def example(self, ex: int) -> np.ndarray:
        shard_idx, offset = locate(self.md, ex, self.layer, 0)
        if shard_idx not in self._fds:
            self._fds[shard_idx] = os.open(self.sd.shard_fpath(shard_idx), os.O_RDONLY)
        want = self.md.tokens_per_ex * self.row_bytes
        buf = os.pread(self._fds[shard_idx], want, offset)
        if len(buf) != want:
            raise SaeflowError(f"{self.sd.shard_fpath(shard_idx)}: ended early (truncated after validation?)")
        return np.frombuffer(buf, self.md.dtype).reshape(self.md.tokens_per_ex, self.md.d_model).astype(np.float32)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def max_pool(rows_ms: scipy.sparse.csr_matrix, keep_nt: np.ndarray) -> scipy.sparse.csr_matrix:
    """(n * T, S) codes of n examples' tokens -> (n, S): each latent's largest code over the kept tokens (codes are
    non-negative, so the stored entries suffice)."""
    n, T = keep_nt.shape
    coo = rows_ms.tocoo()
    sel = keep_nt.reshape(-1)[coo.row]
    key = (coo.row[sel] // T).astype(np.int64) * rows_ms.shape[1] + coo.col[sel]
    val = coo.data[sel]
    order = np.lexsort((val, key))
    key, val = key[order], val[order]
    last = np.r_[key[1:] != key[:-1], True] if key.size else np.zeros(0, bool)
    key, val = key[last], val[last]
    n_latents = rows_ms.shape[1]
    return scipy.sparse.csr_matrix((val, (key // n_latents, key % n_latents)), shape=(n, n_latents))


def unit_features(sample: Sample, source: LabelSource, sd: ShardDir, dump_csr: CsrFile, layer: int,
                  tokens: str) -> tuple[scipy.sparse.csr_matrix, np.ndarray]:  # fmt: skip
    """Codes (n_units, S) and raw activations (n_units, D) of the sample's units, in `units_n` order: a patch's own,
    or an example's codes max-pooled and raw activations mean-pooled over the tokens the SAE trained on (`tokens`,
    selected by saeflow.training.loaders, imported only then: it brings torch)."""
    md, T = sd.metadata, sd.metadata.tokens_per_ex
    if source.scope == "example":
        from saeflow.training import loaders

        selection = loaders.TokenSelection(sd, tokens)
    ex_n = sample.units_n // source.units_per_ex
    raw_nd = np.empty((len(ex_n), md.d_model), np.float32)
    codes, reader = [], RawReader(sd, layer)
    try:
        for lo in range(0, len(ex_n), CHUNK_EX):
            units, exs = sample.units_n[lo : lo + CHUNK_EX], ex_n[lo : lo + CHUNK_EX]
            uniq = np.unique(exs)
            acts_xtd = np.stack([reader.example(int(ex)) for ex in uniq])
            where = np.searchsorted(uniq, exs)
            if source.scope == "patch":
                tok_n = units % source.units_per_ex + int(md.cls_token)
                raw_nd[lo : lo + len(units)] = acts_xtd[where, tok_n]
                codes.append(dump_csr.gather(exs * T + tok_n))
                continue
            keep_xt = selection.keep_nt[uniq] if selection.keep_nt is not None else np.broadcast_to(
                selection.keep(0, 1), (len(uniq), T))  # fmt: skip
            n_kept = np.maximum(keep_xt.sum(1, keepdims=True), 1)
            raw_nd[lo : lo + len(units)] = ((acts_xtd * keep_xt[..., None]).sum(1) / n_kept)[where]
            pooled = max_pool(dump_csr.gather((uniq[:, None] * T + np.arange(T)).reshape(-1)), keep_xt)
            codes.append(pooled[where])
    finally:
        reader.close()
    empty = scipy.sparse.csr_matrix((0, dump_csr.shape[1]), dtype=np.float32)
    return (scipy.sparse.vstack(codes, format="csr") if codes else empty), raw_nd


# ---------------------------------------------------------------------------------------------------------------
# Probes (scikit-learn)
# ---------------------------------------------------------------------------------------------------------------


def auroc_columns(x_nk: np.ndarray, y_n: np.ndarray) -> np.ndarray:
    """The AUROC of each column as a score for y (ties count half): Mann-Whitney's U over n_pos * n_neg, what
    sklearn.metrics.roc_auc_score gives column by column (tests/test_probe.py compares them), without its input
    checks, which cost 4 ms a call (6,000 calls for 1,000 labels)."""
    y_n = np.asarray(y_n, bool)
    n_pos, n_neg = int(y_n.sum()), int((~y_n).sum())
    ranks_nk = scipy.stats.rankdata(x_nk, axis=0)
    return (ranks_nk[y_n].sum(0) - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def logistic_probe(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray) -> dict:
    """scikit-learn's L2 logistic regression (C=1, lbfgs) on standardized features: held-out accuracy and AUROC.
    The inputs are ours (finite, checked shapes): scikit-learn's parameter checks are skipped, a third of the time."""
    with sklearn.config_context(skip_parameter_validation=True, assume_finite=True):
        clf = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=1000)).fit(x_train, y_train)
        scores_n = clf.decision_function(x_test)
    return {"accuracy": float(np.mean((scores_n > 0) == y_test)),
            "auroc": float(auroc_columns(scores_n[:, None], y_test)[0])}  # fmt: skip


def f1_threshold(x_n: np.ndarray, y_n: np.ndarray) -> float:
    """The threshold t >= 0 for which "code > t" has the best F1 on (x, y): the latent must fire (t = 0 at least), so
    "every unit is positive", F1 2/3 on a balanced sample, is never a latent's answer."""
    y_n = np.asarray(y_n, bool)
    ts = np.unique(np.r_[0.0, x_n[x_n > 0]])  # ascending: "code > ts[i]"
    order = np.argsort(x_n, kind="stable")
    x_sorted, y_sorted = x_n[order], y_n[order]
    n_le = np.searchsorted(x_sorted, ts, side="right")  # units with code <= t
    pos_le = np.r_[0, np.cumsum(y_sorted)][n_le]
    tp, fp = y_n.sum() - pos_le, (len(y_n) - n_le) - (y_n.sum() - pos_le)
    f1 = np.divide(2 * tp, 2 * tp + fp + (y_n.sum() - tp), out=np.zeros(len(ts)), where=tp > 0)
    return float(ts[int(np.argmax(f1))])


def best_latent(cand_s: np.ndarray, xc_train: np.ndarray, y_train, xc_test: np.ndarray, y_test) -> dict:
    """Of the candidate latents, the one of highest training AUROC: its held-out AUROC, and its held-out F1 of
    "code > t" at the threshold t >= 0 that maximizes F1 on the training sample."""
    train_auroc_k = auroc_columns(xc_train, y_train)
    j = int(np.argmax(train_auroc_k))  # the first of equals: the larger mean difference
    threshold = f1_threshold(xc_train[:, j], y_train)
    predicted_n, y_test = xc_test[:, j] > threshold, np.asarray(y_test, bool)
    tp = int((predicted_n & y_test).sum())
    return {
        "latent": int(cand_s[j]),
        "auroc": float(auroc_columns(xc_test[:, j : j + 1], y_test)[0]),
        "f1": 2 * tp / (predicted_n.sum() + y_test.sum()) if tp else 0.0,
        "train_auroc": float(train_auroc_k[j]),
        "threshold": threshold,
    }


def probe_label(sample: Sample, vi: int, codes_us, raw_ud: np.ndarray, ks: tuple[int, ...]) -> dict:
    """Every probe of one label (value index `vi`) on its balanced train and held-out samples."""
    rows, ys = [], []
    for split in (0, 1):
        pos, neg = sample.task(split, vi)
        rows.append(np.searchsorted(sample.units_n, np.concatenate([pos, neg])))
        ys.append(np.r_[np.ones(len(pos), bool), np.zeros(len(neg), bool)])
    (train, test), (y_train, y_test) = rows, ys
    out = {"n_train": int(len(train)), "n_test": int(len(test))}
    if y_train.sum() < 2 or y_test.sum() < 1:
        return {**out, "skipped": skip_reason(sample, vi)}
    x_train, x_test = codes_us[train], codes_us[test]
    diff_s = np.asarray(x_train[y_train].mean(0) - x_train[~y_train].mean(0)).ravel()
    by_diff = np.argsort(-diff_s, kind="stable")[:N_CANDIDATES]  # latents firing more on the label
    xc_train, xc_test = x_train[:, by_diff].toarray(), x_test[:, by_diff].toarray()
    out["best_latent"] = best_latent(by_diff, xc_train, y_train, xc_test, y_test)
    out["candidates"] = [[int(s), round(float(diff_s[s]), 6), round(float(a), 4)]
                         for s, a in zip(by_diff, auroc_columns(xc_test, y_test))]  # fmt: skip
    by_abs = np.argsort(-np.abs(diff_s), kind="stable")
    out["sparse"] = {}
    for k in ks:
        cols = by_abs[:k]
        fit = logistic_probe(x_train[:, cols].toarray(), y_train, x_test[:, cols].toarray(), y_test)
        out["sparse"][str(k)] = {"latents": [int(s) for s in cols], **fit}
    out["dense"] = logistic_probe(raw_ud[train], y_train, raw_ud[test], y_test)
    return out


def skip_reason(sample: Sample, vi: int) -> str:
    """Why a label cannot be probed: a probe needs 2 training pairs (a positive and a negative each) and 1 held out."""
    n_pairs = [len(sample.task(split, vi)[0]) for split in (0, 1)]
    mine_s, all_s = sample.counts_sv[:, vi], sample.counts_sv.sum(1)
    return (f"{n_pairs[0]} training and {n_pairs[1]} held-out pairs (a probe needs 2 and 1): the label has "
            f"{mine_s[0]} of {all_s[0]} training units and {mine_s[1]} of {all_s[1]} held-out ones, and every "
            "other unit is a negative")  # fmt: skip


def skip_warnings(result: dict) -> list[str]:
    """The lines `saeflow probe` writes to stderr when no label could be probed: why, per label."""
    if result["metrics"]["n_probed"]:
        return []
    if not result["labels"]:
        return [f"no label was probed: every unit of {' and '.join(result['config']['label_files'])} is unlabelled "
                "(a negative class id, -1, marks an unlabelled example)"]  # fmt: skip
    return ["no label was probed:"] + [f"  {e['name']} ({e['file']}): {e['skipped']}" for e in result["labels"]]


def summarize(labels: list[dict], ks: tuple[int, ...]) -> dict:
    """Means over the probed labels: the summary's `probe.*` columns."""
    done = [entry for entry in labels if "skipped" not in entry]
    out = {"n_labels": len(labels), "n_probed": len(done)}
    if not done:
        return out
    out["best_latent_auroc"] = float(np.mean([e["best_latent"]["auroc"] for e in done]))
    out["best_latent_f1"] = float(np.mean([e["best_latent"]["f1"] for e in done]))
    for k in ks:
        out[f"sparse_k{k}_accuracy"] = float(np.mean([e["sparse"][str(k)]["accuracy"] for e in done]))
    out["dense_accuracy"] = float(np.mean([e["dense"]["accuracy"] for e in done]))
    return out


# ---------------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------------


def open_dump(cfg: ProbeConfig) -> tuple[runs.Run, layout.DumpLayout, dict, ShardDir]:
    """The run, its dump (config.json read) and the dump's shard directory, cross-checked."""
    run = runs.open_run(cfg.run)
    if cfg.shards_hash is None:  # the run's only dump (visuals' rule; it imports torch, so only when asked)
        from saeflow.analysis.visuals.site import find_dump

        dump = layout.DumpLayout(find_dump(run, None))
    else:
        dump = run.dump(cfg.shards_hash)
    for fpath in (dump.config_fpath, dump.acts_fpath):
        if not fpath.exists():
            raise SaeflowError(f"{fpath}: missing; run `saeflow inference` first")
    dump_config = read_json_object(dump.config_fpath)
    sd = ShardDir(cfg.shards or dump_config["shards"])
    if sd.hash != dump.dpath.name:
        raise SaeflowError(f"{sd.dpath} holds shards {sd.hash}, not the dump's {dump.dpath.name}")
    return run, dump, dump_config, sd


def run_probe(cfg: ProbeConfig) -> pathlib.Path:
    """Probe every label of the dump's shard directory; write RUN/probe/<shard_hash>.json (atomically) and the
    labels each latent predicts onto the dump's latent pages (visuals/labels.js), when drawn."""
    run, dump, dump_config, sd = open_dump(cfg)
    sources = label_sources(sd)
    if not sources:
        raise SaeflowError(f"{sd.dpath}: no {ShardLayout.LABELS_FNAME} or {ShardLayout.CLASSES_FNAME}: nothing to "
                           "probe (labels come from segmentation folders, generated images, image folders and "
                           "hf_dataset label columns)")  # fmt: skip
    tokens, layer = run.tokens(), int(dump_config["layer"])
    started_at, labels = provenance.utc_now(), []
    # Every fit is small: BLAS threads would only wait on each other (10x slower on a busy 2-core machine).
    with CsrFile(dump.acts_fpath) as dump_csr, threadpoolctl.threadpool_limits(1):
        if dump_csr.shape[0] != sd.n_ex * sd.metadata.tokens_per_ex:
            raise SaeflowError(f"{dump.acts_fpath}: {dump_csr.shape[0]} rows, but {sd.dpath} has "
                               f"{sd.n_ex} x {sd.metadata.tokens_per_ex} tokens")  # fmt: skip
        if max(cfg.ks) > dump_csr.shape[1]:
            raise SaeflowError(f"probe ks: k {max(cfg.ks)} exceeds the SAE's {dump_csr.shape[1]} latents (d_sae); "
                               f"give ks of at most {dump_csr.shape[1]}")  # fmt: skip
        for source in sources:
            sample = sample_units(sd, source, cfg)
            codes_us, raw_ud = unit_features(sample, source, sd, dump_csr, layer, tokens)
            for vi, value in enumerate(sample.values):
                entry = {"name": source.name(int(value)), "value": int(value), "file": source.fname,
                         "scored": source.scope, "n_units": [int(c) for c in sample.counts_sv[:, vi]]}  # fmt: skip
                labels.append({**entry, **probe_label(sample, vi, codes_us, raw_ud, cfg.ks)})
    result = {
        "config": {"run": str(run.root.resolve()), "sae_sha256": dump_config["sae_sha256"], "shard_hash": sd.hash,
                   "layer": layer, "tokens": tokens, **_settings(cfg), "solver": SOLVER,
                   "label_files": [source.fname for source in sources],
                   "pooling": "per example: codes max-pooled, raw activations mean-pooled over the SAE's tokens"},
        "metrics": summarize(labels, cfg.ks),
        "labels": labels,
        "provenance": {**provenance.collect(), "started_at": started_at, "finished_at": provenance.utc_now()},
    }  # fmt: skip
    out_fpath = run.probe_fpath(sd.hash)
    out_fpath.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(out_fpath, result)
    latent_labels.write_labels_page(dump, result)
    return out_fpath


SOLVER = "sklearn LogisticRegression(C=1, lbfgs) after StandardScaler"


def _settings(cfg: ProbeConfig) -> dict:
    keys = ("seed", "test_frac", "train_per_label", "test_per_label", "max_units", "ks")
    return {**{key: getattr(cfg, key) for key in keys}, "ks": list(cfg.ks), "sklearn": sklearn.__version__}
