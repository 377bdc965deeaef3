"""saeflow.store.layout against the specs: the one place the tests spell the shard and run layouts out.

storage-and-run-manifest v1 names a run's files; saev protocol 2.0 names a shard directory's. Everything else in
saeflow (and in the tests) asks the layout classes, so these assertions pin the whole on-disk contract.
"""

import pathlib

import pytest

from saeflow.store.layout import RUN_ID_WILDCARD, SHARD_HASH_WILDCARD, DumpLayout, RunLayout, ShardLayout, staging_dpath

ROOT = pathlib.Path("/fs/scratch/PAS1234/me/saev")
HASH = "ab" * 32


def test_run_layout_is_the_manifest_specs():
    run = RunLayout.at(ROOT / "runs", "r" * 64)
    base = ROOT / "runs" / ("r" * 64)
    assert run.root == base and run.run_id == "r" * 64
    assert run.config_fpath == base / "checkpoint" / "config.json"
    assert run.sae_fpath == base / "checkpoint" / "sae.pt"
    assert run.resume_fpath == base / "checkpoint" / "resume.pt"
    assert run.metrics_log_fpath == base / "checkpoint" / "metrics.jsonl"
    assert run.final_metrics_fpath == base / "checkpoint" / "metrics.json"
    assert [run.link(n) for n in RunLayout.LINK_NAMES] == [
        base / "links" / n for n in ("train-shards", "train-dataset", "val-shards", "val-dataset")
    ]
    with pytest.raises(ValueError, match="unknown run link"):
        run.link("train")


def test_run_lock_and_publish_staging_sit_beside_their_outputs():
    run = RunLayout.at(ROOT / "runs", "r" * 64)
    base = ROOT / "runs" / ("r" * 64)
    assert run.lock_fpath == ROOT / "runs" / f".{'r' * 64}.lock"  # outside the run, like a shard hash's lock
    assert run.publish_dpath == base / "checkpoint" / ".publish.partial"
    assert run.dump_lock_fpath(HASH) == base / "inference" / f".{HASH}.lock"


def test_dump_layout_sits_under_the_run_by_shard_hash():
    dump = RunLayout.at(ROOT, "r" * 64).dump(HASH)
    base = ROOT / ("r" * 64) / "inference" / HASH
    assert dump == DumpLayout(base)
    assert (dump.config_fpath, dump.acts_fpath, dump.latents_fpath, dump.metrics_fpath) == (
        base / "config.json", base / "patch_acts.npz", base / "latents.npz", base / "metrics.json",
    )  # fmt: skip
    assert dump.index_fpath == base / "visuals" / "index.html"
    assert dump.labels_js_fpath == base / "visuals" / "labels.js"
    run = RunLayout.at(ROOT, "r" * 64)
    assert run.probe_fpath(HASH) == ROOT / ("r" * 64) / "probe" / f"{HASH}.json"
    assert run.evaluation_fpath(HASH) == ROOT / ("r" * 64) / "evaluation" / f"{HASH}.json"
    assert [dump.plot_fpath(p) for p in DumpLayout.PLOTS] == [base / "visuals" / f"{p}.png" for p in DumpLayout.PLOTS]


def test_shard_layout_is_protocol_2_0_with_staging_and_lock_beside_it():
    shards = ShardLayout.at(ROOT / "shards", HASH)
    base = ROOT / "shards" / HASH
    assert shards.metadata_fpath == base / "metadata.json"
    assert shards.shards_fpath == base / "shards.json"
    assert shards.checksums_fpath == base / "checksums.json"
    assert shards.provenance_fpath == base / "provenance.json"
    assert shards.shard_fpath(0) == base / "acts000000.bin" and shards.shard_fpath(123) == base / "acts000123.bin"
    assert shards.staging.dpath == ROOT / "shards" / f".{HASH}.partial"
    assert shards.staging.progress_fpath == ROOT / "shards" / f".{HASH}.partial" / "progress.json"
    assert shards.lock_fpath == ROOT / "shards" / f".{HASH}.lock"
    assert staging_dpath(base) == shards.staging.dpath


def test_patterns_put_snakemake_wildcards_where_the_hashes_go():
    assert str(RunLayout.at("runs", RUN_ID_WILDCARD).sae_fpath) == "runs/{run_id}/checkpoint/sae.pt"
    assert str(ShardLayout.at("shards", SHARD_HASH_WILDCARD).shards_fpath) == "shards/{shard_hash}/shards.json"
    dump = RunLayout.at("runs", RUN_ID_WILDCARD).dump(SHARD_HASH_WILDCARD)
    assert str(dump.metrics_fpath) == "runs/{run_id}/inference/{shard_hash}/metrics.json"
