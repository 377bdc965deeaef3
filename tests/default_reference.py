"""The default workflow's committed reference: what must hold on any machine (tests/test_default_workflow.py).

    python tests/default_reference.py RESULTS_SAEV_DIR      # re-record from a fresh run's results/saev

Platform-independent bytes are pinned exactly (tests/data/default-workflow.json): each shard directory's
metadata.json (so its name), its integer side files (labels.bin, tokens.bin) and the run ids. Float outputs are
compared within a tolerance against a small sample (tests/data/default-workflow-reference.npz): 64 stored vectors
and the mean vector of each shard directory, and per run the validation metrics, b_dec, and the first 32 decoder
rows and encoder columns. CPU kernels round differently per instruction set (saeflow.numerics), and training
amplifies that rounding, so the tolerances are those of `saeflow compare` (saeflow.store.compare): 1e-4 relative per
vector for the shards, 0.1 of a tensor's norm for trained weights, and 1% for the metrics.
"""

import hashlib
import json
import pathlib
import sys

import numpy as np

DATA_DPATH = pathlib.Path(__file__).parent / "data"
PINS_FPATH = DATA_DPATH / "default-workflow.json"
REFERENCE_FPATH = DATA_DPATH / "default-workflow-reference.npz"
EXACT_FNAMES = ("metadata.json", "labels.bin", "tokens.bin", "classes.bin")
N_SAMPLED_VECTORS, N_SAMPLED_LATENTS = 64, 32
METRICS = ("nmse", "l0", "explained_variance")
METRICS_TOL = 0.01


def _sha256(fpath: pathlib.Path) -> str:
    return hashlib.sha256(fpath.read_bytes()).hexdigest()


def shard_sample(shard_dpath: pathlib.Path, rows_n=None) -> dict[str, np.ndarray]:
    """Sampled vectors (at `rows_n`, chosen with seed 0 when None) and the mean vector of every layer."""
    from saeflow.store.shards import ShardDir

    sd = ShardDir(shard_dpath)
    out = {}
    for layer in sd.metadata.layers:
        vectors_nd = np.concatenate([block.reshape(-1, block.shape[-1]) for _, block in sd.iter_blocks(layer)])
        if rows_n is None:
            rng = np.random.default_rng(0)
            rows_n = np.sort(rng.choice(len(vectors_nd), N_SAMPLED_VECTORS, replace=False))
        out[f"layer{layer}/rows"] = rows_n
        out[f"layer{layer}/vectors"] = vectors_nd[rows_n].astype(np.float32)
        out[f"layer{layer}/mean"] = vectors_nd.astype(np.float64).mean(0).astype(np.float32)
    return out


def run_sample(run_dpath: pathlib.Path) -> dict[str, np.ndarray]:
    from saeflow.training.sae import load_sae

    sae = load_sae(run_dpath / "checkpoint" / "sae.pt")
    metrics = json.loads((run_dpath / "checkpoint" / "metrics.json").read_text())
    return {
        "b_dec": sae.b_dec.detach().numpy(),
        "W_dec_rows": sae.W_dec[:N_SAMPLED_LATENTS].detach().numpy(),
        "W_enc_cols": sae.W_enc[:, :N_SAMPLED_LATENTS].detach().numpy(),
        "metrics": np.array([metrics[name] for name in METRICS], np.float64),
    }


def record(results_dpath: pathlib.Path) -> None:
    """Write the pins and the reference from a fresh default run's results/saev directory."""
    exact, arrays = {}, {}
    for shard_dpath in sorted((results_dpath / "shards").iterdir()):
        for fname in EXACT_FNAMES:
            if (shard_dpath / fname).exists():
                exact[f"shards/{shard_dpath.name}/{fname}"] = _sha256(shard_dpath / fname)
        arrays.update({f"{shard_dpath.name}/{k}": v for k, v in shard_sample(shard_dpath).items()})
    run_ids = sorted(p.name for p in (results_dpath / "runs").iterdir() if (p / "checkpoint" / "sae.pt").exists())
    for run_id in run_ids:
        arrays.update({f"{run_id}/{k}": v for k, v in run_sample(results_dpath / "runs" / run_id).items()})
    shard_prov = json.loads((next((results_dpath / "shards").iterdir()) / "provenance.json").read_text())
    pins = {"exact": exact, "runs": run_ids, "recorded_on": shard_prov["platform"]}
    PINS_FPATH.write_text(json.dumps(pins, indent=2, sort_keys=True) + "\n")
    np.savez_compressed(REFERENCE_FPATH, **arrays)


def check(results_dpath: pathlib.Path) -> list[str]:
    """Every difference from the pins and the reference beyond its tolerance, one line each."""
    from saeflow.store import compare

    pins = json.loads(PINS_FPATH.read_text())
    problems = [f"{rel}: sha256 differs" for rel, digest in pins["exact"].items()
                if not (results_dpath / rel).exists() or _sha256(results_dpath / rel) != digest]  # fmt: skip
    trained = sorted(p.name for p in (results_dpath / "runs").iterdir() if (p / "checkpoint" / "sae.pt").exists())
    if trained != pins["runs"]:
        problems.append(f"run ids moved: {trained} != {pins['runs']}")
        return problems
    ref = np.load(REFERENCE_FPATH)
    for shard_hash in sorted({rel.split("/")[1] for rel in pins["exact"]}):
        keys = [k for k in ref.files if k.startswith(shard_hash + "/")]
        rows = {k.split("/")[1]: ref[k] for k in keys if k.endswith("/rows")}
        for layer_key, rows_n in rows.items():
            got = shard_sample(results_dpath / "shards" / shard_hash, rows_n)
            for part in ("vectors", "mean"):
                rel = compare.vector_rel(ref[f"{shard_hash}/{layer_key}/{part}"], got[f"{layer_key}/{part}"]).max()
                if rel > compare.FLOAT32_TOL:
                    problems.append(f"{shard_hash[:12]} {layer_key} {part}: relative difference {rel:.2e}")
    for run_id in pins["runs"]:
        got = run_sample(results_dpath / "runs" / run_id)
        for name in ("b_dec", "W_dec_rows", "W_enc_cols"):
            row = compare.compare_tensor(name, ref[f"{run_id}/{name}"], got[name])
            if not row.ok(compare.RUN_TOL):
                problems.append(f"run {run_id[:12]} {name}: relative difference {row.rel:.3g}")
        for name, want, have in zip(METRICS, ref[f"{run_id}/metrics"], got["metrics"]):
            if abs(have - want) > METRICS_TOL * abs(want):
                problems.append(f"run {run_id[:12]} {name}: {have:.6g}, reference {want:.6g}")
    return problems


if __name__ == "__main__":
    record(pathlib.Path(sys.argv[1]))
