"""Seed stability: do runs that differ only in `seed` and/or `data_seed` learn the same latents?

    groups = stability.seed_groups({run_id: config_dict, ...})   # group id -> run ids (planning: no torch)
    result = stability.compare_runs([run_a, run_b, ...])          # every pair of the group matched

Runs form a group when their training configs (checkpoint/config.json) are equal once `seed` and `data_seed` are
left out; the group is named by the content hash of that shared config. Two runs' latents are matched by their
decoder directions: the cosine of every pair of decoder rows (in blocks of rows: memory is a block, never the
d_sae x d_sae matrix), and the optimal one-to-one assignment maximizing the summed cosine
(`scipy.optimize.linear_sum_assignment`), where a cosine below MATCH_FLOOR (0.7, the lowest threshold reported)
counts as 0: such a pair is never a match. Pairs above the floor form small connected components (a latent's few
near-copies in the other run), and the assignment is solved exactly on each.

Only live latents take part. A latent is live when it fired at least once in the run's inference dump on its
validation shards (latents.npz `n_fires`; the workflow's stability job waits for those dumps); for a run without
that dump (`saeflow stability` on runs never dumped), when its decoder row is nonzero. A dead TopK latent keeps its
initial decoder row, so only the dump tells it from a live one. Per pair of runs:

    frac_matched_0.7, frac_matched_0.9   matched latents with cosine >= 0.7 / >= 0.9, over the smaller number of
                                         live latents
    matched_mean_cos                     the one-to-one matched mean: the summed cosine of the assignment over the
                                         smaller number of live latents (a latent left without a partner at or
                                         above 0.7 counts 0, as in the assignment)
    mmcs                                 mean max cosine similarity: the mean over both runs' live latents of their
                                         best cosine in the other run (not one-to-one: two latents may share a
                                         best partner, so it is at least matched_mean_cos)

and per group, the mean and standard deviation of each over its pairs. The summary adds them to the grouped table.
"""

import itertools
import logging
import pathlib

import numpy as np

from saeflow.errors import SaeflowError
from saeflow.store import atomic, hashing, provenance, runs
from saeflow.training.sweeps import SEED_KEYS  # what may differ inside a group

logger = logging.getLogger(__name__)

MATCH_FLOOR = 0.7  # a cosine below this is no match (the assignment counts it as 0)
THRESHOLDS = (0.7, 0.9)
BLOCK_ROWS = 1024  # decoder rows of one run per block of the cosine matrix (memory: BLOCK_ROWS x d_sae x 4 bytes)
METRICS = (*(f"frac_matched_{t}" for t in THRESHOLDS), "matched_mean_cos", "mmcs")  # per pair; mean, std per group
STABILITY_DNAME = "stability"  # <summary_dir>/stability/<group id>.json


def group_key(train_config: dict) -> str:
    """The content hash of a training config without its seeds: runs with equal keys differ only in seeds."""
    return hashing.content_hash({k: v for k, v in train_config.items() if k not in SEED_KEYS})


def seed_groups(configs: dict[str, dict]) -> dict[str, list[str]]:
    """Group id -> the run ids (sorted) of every group of at least two runs that differ only in their seeds."""
    groups: dict[str, list[str]] = {}
    for run_id, train_config in sorted(configs.items()):
        groups.setdefault(group_key(train_config), []).append(run_id)
    return {key: members for key, members in groups.items() if len(members) > 1}


def result_fpath(summary_dpath: pathlib.Path, group: str) -> pathlib.Path:
    return pathlib.Path(summary_dpath) / STABILITY_DNAME / f"{group}.json"


def decoder_directions(sae_fpath: pathlib.Path) -> np.ndarray:
    """(d_sae, d_model) unit decoder rows (the direction each latent writes; the SAE's input scale does not change
    it). A latent whose row is zero has no direction: its row stays zero and matches nothing."""
    from saeflow.training import sae

    W_dec = sae.load_sae(sae_fpath).W_dec.detach().double().numpy()
    norms = np.linalg.norm(W_dec, axis=1, keepdims=True)
    return np.divide(W_dec, norms, out=np.zeros_like(W_dec), where=norms > 0).astype(np.float32)


def cosine_pairs(a_sd: np.ndarray, b_sd: np.ndarray, floor: float = MATCH_FLOOR, block_rows: int = BLOCK_ROWS):
    """(rows, cols, cosines) of every pair at or above `floor`, and each row's and column's largest cosine, from the
    cosine matrix computed BLOCK_ROWS rows at a time."""
    rows, cols, vals = [], [], []
    best_a, best_b = np.full(len(a_sd), -1.0), np.full(len(b_sd), -1.0)
    for lo in range(0, len(a_sd), block_rows):
        cos_bs = a_sd[lo : lo + block_rows] @ b_sd.T
        best_a[lo : lo + len(cos_bs)] = cos_bs.max(1)
        np.maximum(best_b, cos_bs.max(0), out=best_b)
        r, c = np.nonzero(cos_bs >= floor)
        rows.append(r + lo)
        cols.append(c)
        vals.append(cos_bs[r, c].astype(np.float64))
    return np.concatenate(rows), np.concatenate(cols), np.concatenate(vals), best_a, best_b


def match(rows_n: np.ndarray, cols_n: np.ndarray, cos_n: np.ndarray, n_a: int, n_b: int):
    """The assignment maximizing the summed cosine over the given pairs (every other pair counts 0), solved exactly
    on each connected component of the pairs with `linear_sum_assignment`: (rows, cols, cosines) matched."""
    import scipy.optimize
    import scipy.sparse
    import scipy.sparse.csgraph

    if not len(rows_n):
        return rows_n, cols_n, cos_n
    graph = scipy.sparse.coo_matrix((np.ones(len(rows_n)), (rows_n, n_a + cols_n)), shape=(n_a + n_b,) * 2)
    _, comp_of = scipy.sparse.csgraph.connected_components(graph, directed=False)
    comp_n = comp_of[rows_n]
    order = np.argsort(comp_n, kind="stable")
    starts = np.r_[0, np.flatnonzero(np.diff(comp_n[order])) + 1, len(order)]
    got = []
    for lo, hi in zip(starts[:-1], starts[1:]):
        edges = order[lo:hi]
        if hi - lo == 1:  # one pair: it is the component's assignment
            got.append(edges)
            continue
        r_u, r_i = np.unique(rows_n[edges], return_inverse=True)
        c_u, c_i = np.unique(cols_n[edges], return_inverse=True)
        cost = np.zeros((len(r_u), len(c_u)))
        cost[r_i, c_i] = cos_n[edges]
        ri, ci = scipy.optimize.linear_sum_assignment(cost, maximize=True)
        lookup = {(int(r), int(c)): e for r, c, e in zip(r_i, c_i, edges)}
        got.append(np.array([lookup[(r, c)] for r, c in zip(ri, ci) if (r, c) in lookup], dtype=np.int64))
    picked = np.concatenate(got)
    return rows_n[picked], cols_n[picked], cos_n[picked]


def compare_pair(a_sd: np.ndarray, b_sd: np.ndarray) -> dict:
    """Two runs' (live) decoder directions matched: the fractions matched above each threshold, the one-to-one
    matched mean and the MMCS."""
    n = min(len(a_sd), len(b_sd))
    if n == 0:
        raise SaeflowError("stability: a run of the pair has no live latent; nothing to match")
    rows, cols, cos, best_a, best_b = cosine_pairs(a_sd, b_sd)
    _, _, matched = match(rows, cols, cos, len(a_sd), len(b_sd))
    out = {f"frac_matched_{t}": float((matched >= t).sum() / n) for t in THRESHOLDS}
    out["matched_mean_cos"] = float(matched.sum() / n)
    out["mmcs"] = float(np.r_[best_a, best_b].mean())
    out["n_pairs_above_floor"] = int(len(cos))
    return out


def live_latents(run: runs.Run, directions_sd: np.ndarray) -> tuple[np.ndarray, str]:
    """(mask of live latents, how liveness was read): fired in the dump on the run's validation shards, else a
    nonzero decoder row."""
    val_shards = run.config().get("val_shards")
    dump = run.dump(val_shards) if val_shards else None
    if dump is not None and dump.latents_fpath.is_file():
        with np.load(dump.latents_fpath, allow_pickle=False) as npz:
            n_fires_s = npz["n_fires"]
        if len(n_fires_s) != len(directions_sd):
            raise SaeflowError(f"{dump.latents_fpath}: {len(n_fires_s)} latents, the SAE has {len(directions_sd)}")
        return n_fires_s > 0, f"fired in the dump on {val_shards}"
    return np.abs(directions_sd).sum(1) > 0, "nonzero decoder row (no dump on the validation shards)"


def compare_runs(run_dpaths: list[pathlib.Path]) -> dict:
    """Every pair of the runs (one seed group) matched; per metric its mean and standard deviation over pairs."""
    if len(set(run_dpaths)) < 2:
        raise SaeflowError(f"stability compares two or more runs that differ only in {' and '.join(SEED_KEYS)}; "
                           f"got {len(set(run_dpaths))}")  # fmt: skip
    opened = [runs.open_run(dpath) for dpath in run_dpaths]
    configs = {run.root.name: run.config() for run in opened}
    keys = {group_key(cfg) for cfg in configs.values()}
    if len(keys) != 1:
        differ = sorted({k for cfg in configs.values() for k, v in cfg.items()
                         if k not in SEED_KEYS and any(other.get(k) != v for other in configs.values())})
        raise SaeflowError(f"stability compares runs that differ only in {' and '.join(SEED_KEYS)}; these also "
                           f"differ in {', '.join(differ)}")  # fmt: skip
    directions, live = {}, {}
    for run in opened:
        directions_sd = decoder_directions(run.require_checkpoint())
        live_s, how = live_latents(run, directions_sd)
        directions[run.root.name] = directions_sd[live_s]
        live[run.root.name] = {"n_live": int(live_s.sum()), "d_sae": len(live_s), "live": how}
    pairs = []
    for a, b in itertools.combinations(sorted(directions), 2):
        pairs.append({"a": a, "b": b, **compare_pair(directions[a], directions[b])})
        logger.info("%s vs %s: %s", a[:12], b[:12], pairs[-1])
    metrics = {}
    for name in METRICS:
        values = np.array([pair[name] for pair in pairs])
        metrics[name] = float(values.mean())
        metrics[f"{name}_std"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
    return {
        "group": keys.pop(),
        "runs": sorted(configs),
        "seeds": {run_id: {k: cfg.get(k) for k in SEED_KEYS} for run_id, cfg in sorted(configs.items())},
        "match_floor": MATCH_FLOOR,
        "live": live,
        "metrics": {**metrics, "n_runs": len(opened), "n_pairs": len(pairs)},
        "pairs": pairs,
    }


def write_stability(run_dpaths: list[pathlib.Path], out_fpath: pathlib.Path) -> pathlib.Path:
    started_at = provenance.utc_now()
    result = compare_runs(run_dpaths)
    result["provenance"] = {**provenance.collect(), "started_at": started_at, "finished_at": provenance.utc_now()}
    out_fpath.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(out_fpath, result)
    return out_fpath
