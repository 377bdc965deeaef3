"""`saeflow migrate` on a tree saeflow made at shard layout 1 (tests/fixtures/layout1: one directory per activation
spec, every layer in it; made by make_layout1_tree.py with saeflow 3651ac5): afterwards the workflow plans nothing,
every vector and run is the layout-1 one under its layout-2 name, and nothing published was changed.

Its runs are TopK runs of saeflow-train-3, whose maths TopK has since moved on from (saeflow-train-4, issue 44): with
the config as it was, the migration moves them under their own trainer's layout-2 ids and the workflow trains the
new ones; with `trainer: saeflow-train-3` pinned on each SAE (PINNED_CONFIG, the edit the migration suggests), the
workflow plans nothing."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from saeflow import config
from saeflow.planning import WorkflowPlan
from saeflow.store import runs, shards
from saeflow.store.layout import RunLayout
from workflow_helpers import env, job_counts, snakemake, tree_state

pytestmark = pytest.mark.slow  # Snakemake dry runs and the CLI

FIXTURE_DPATH = pathlib.Path(__file__).parent / "fixtures" / "layout1"
TREE_TIME_NS = 1_700_000_000 * 10**9  # one time stamp for the whole copy: git checks files out in any order
PINNED_CONFIG = "pinned.yaml"  # the fixture's config with each SAE pinned to the trainer that made its run


def saeflow_cli(workdir: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "saeflow", *args], cwd=workdir, env=env(), capture_output=True,
                          text=True)  # fmt: skip


@pytest.fixture
def layout1(tmp_path, monkeypatch) -> dict:
    """A copy of the layout-1 tree and its config, every time stamp alike; its plan under this saeflow."""
    workdir = tmp_path / "w"
    shutil.copytree(FIXTURE_DPATH / "tree", workdir, symlinks=True)
    shutil.copy(FIXTURE_DPATH / "config.yaml", workdir / "config.yaml")
    text = (workdir / "config.yaml").read_text()
    assert text.count("batch_size: 64}") == 2
    (workdir / PINNED_CONFIG).write_text(text.replace("batch_size: 64}", "batch_size: 64, trainer: saeflow-train-3}"))
    for dirpath, _, fnames in os.walk(workdir):
        for fname in fnames:
            os.utime(pathlib.Path(dirpath) / fname, ns=(TREE_TIME_NS, TREE_TIME_NS), follow_symlinks=False)
    for link in (workdir / "runs").glob("*/links/*"):  # they named the shards root the tree was made in
        shard_hash = pathlib.Path(os.readlink(link)).name
        os.unlink(link)
        os.symlink(workdir / "shards" / shard_hash, link)
    monkeypatch.chdir(workdir)
    plan = WorkflowPlan.from_config(config.load(workdir / PINNED_CONFIG))
    plan_now = WorkflowPlan.from_config(config.load(workdir / "config.yaml"))
    return {"workdir": workdir, "plan": plan, "plan_now": plan_now,
            "old_shards": sorted(p.name for p in (workdir / "shards").iterdir()),
            "old_runs": sorted(p.name for p in (workdir / "runs").iterdir())}


def test_the_fixture_is_layout_1_and_this_saeflow_would_redo_it(layout1):
    """Without the migration, layout 2 names other directories and runs: the dry run would extract and train."""
    plan, workdir = layout1["plan"], layout1["workdir"]
    assert len(layout1["old_shards"]) == 3 and all(
        shards.ShardDir(workdir / "shards" / h).metadata.layers == (0, 1) for h in layout1["old_shards"])
    assert not set(plan.runs) & set(layout1["old_runs"])
    counts = job_counts(snakemake(workdir, workdir / "config.yaml", "-n").stdout)
    assert counts["train"] == 2 and counts["create_run"] == 2


def test_migrate_recomputes_nothing_and_the_workflow_then_plans_nothing(layout1):
    workdir = layout1["workdir"]
    before = {name: tree_state(workdir / root / name) for root in ("shards", "runs")
              for name in os.listdir(workdir / root)}  # fmt: skip
    proc = saeflow_cli(workdir, "migrate", PINNED_CONFIG)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("shards ") for line in lines) == 6  # three specs, two layers each
    assert sum(line.startswith("run ") for line in lines) == 2 and any(line.startswith("summary ") for line in lines)
    assert "Nothing to be done" in snakemake(workdir, workdir / PINNED_CONFIG, "-n").stdout
    for name, state in before.items():  # every layout-1 directory and run is kept as it was
        root = "shards" if name in layout1["old_shards"] else "runs"
        assert tree_state(workdir / root / name) == state, name
    again = saeflow_cli(workdir, "migrate", PINNED_CONFIG)  # safe to rerun: nothing moves twice
    assert again.returncode == 0 and all(line.startswith("kept ") for line in again.stdout.splitlines())


def test_a_run_of_an_earlier_trainer_moves_under_its_own_id_and_the_config_as_it_was_trains_it_anew(layout1):
    """Unpinned, the config plans TopK's runs of its trainer now (saeflow-train-5): the migration still moves the
    saeflow-train-3 ones (the same runs as the pinned config's), says how to keep them, and the workflow extracts
    nothing, training only those."""
    plan, plan_now, workdir = layout1["plan"], layout1["plan_now"], layout1["workdir"]
    assert {p.train_config.trainer for p in plan_now.runs.values()} == {"saeflow-train-5"}
    proc = saeflow_cli(workdir, "migrate", "config.yaml")
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("run ") for line in lines) == 2
    assert sum("unless saes." in line and "pins `trainer: saeflow-train-3`" in line for line in lines) == 2
    assert any(line.startswith("summary not written: ") for line in lines)
    assert all(RunLayout.at(workdir / "runs", run_id).config_fpath.exists() for run_id in plan.runs)
    counts = job_counts(snakemake(workdir, workdir / "config.yaml", "-n").stdout)
    assert counts["train"] == 2 and not any(rule.startswith("extract") for rule in counts), counts
    pinned = job_counts(snakemake(workdir, workdir / PINNED_CONFIG, "-n").stdout)  # its runs are all there
    assert set(pinned) <= {"summary", "all"}, pinned


def test_a_trainer_an_architecture_never_computed_is_refused_when_planning(layout1):
    workdir = layout1["workdir"]
    text = (workdir / PINNED_CONFIG).read_text().replace("saeflow-train-3", "saeflow-train-9", 1)
    (workdir / "bad.yaml").write_text(text)
    proc = saeflow_cli(workdir, "plan", "bad.yaml")
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "saes.topk.trainer: this saeflow does not train topk as 'saeflow-train-9'" in proc.stderr


def test_each_layers_directory_holds_the_layout_1_vectors_of_its_layer(layout1):
    plan, workdir = layout1["plan"], layout1["workdir"]
    assert saeflow_cli(workdir, "migrate", PINNED_CONFIG).returncode == 0
    for name, layer_hashes in plan.layer_hash.items():
        old = shards.ShardDir(workdir / "shards" / plan.activation_metadata[name].hash)
        for layer, new_hash in layer_hashes.items():
            assert shards.validate(workdir / "shards" / new_hash, deep=True).ok
            new = shards.ShardDir(workdir / "shards" / new_hash)
            assert new.metadata.layers == (layer,) and new.metadata.hash == new_hash
            old_ntd = np.concatenate([block for _, block in old.iter_blocks(layer)])
            new_ntd = np.concatenate([block for _, block in new.iter_blocks(layer)])
            assert np.array_equal(old_ntd, new_ntd)
            assert np.array_equal(new.aux("tokens.bin"), old.aux("tokens.bin"))
            assert new.provenance()["migrated_from"] == {"shards": old.hash, "layer": layer, "layout": 1}


def test_each_run_is_its_layout_1_run_under_its_new_id(layout1):
    plan, workdir = layout1["plan"], layout1["workdir"]
    assert saeflow_cli(workdir, "migrate", PINNED_CONFIG).returncode == 0
    old_runs = {json.loads(RunLayout.at(workdir / "runs", r).config_fpath.read_text())["layer"]: r
                for r in layout1["old_runs"]}  # fmt: skip
    for run_id, run_plan in plan.runs.items():
        new = RunLayout.at(workdir / "runs", run_id)
        old = RunLayout.at(workdir / "runs", old_runs[run_plan.train_config.layer])
        cfg = json.loads(new.config_fpath.read_text())
        assert runs.run_id(cfg) == run_id and cfg == run_plan.train_config.to_dict()
        assert os.stat(new.sae_fpath).st_ino == os.stat(old.sae_fpath).st_ino  # the same weights, not a copy
        assert pathlib.Path(os.readlink(new.link(new.TRAIN_SHARDS))).name == cfg["train_shards"]
        val = cfg["val_shards"]
        dump = json.loads(new.dump(val).config_fpath.read_text())
        assert dump["shard_hash"] == val and new.evaluation_fpath(val).exists()
        assert old.root.name not in new.dump(val).config_fpath.read_text()
    summary = (workdir / "summary" / "summary.csv").read_text()
    assert all(run_id in summary for run_id in plan.runs) and not any(r in summary for r in layout1["old_runs"])


def test_a_layout_1_directory_still_trains_as_an_existing_directory(layout1, tmp_path):
    """Published by an earlier saeflow, kept readable and trainable: a `shards:` activation plans runs on it."""
    workdir = layout1["workdir"]
    old_hash = layout1["plan"].activation_metadata["text"].hash
    cfg = config.validate({"shards_root": str(workdir / "shards"), "runs_root": str(tmp_path / "r"),
                           "activations": {"old": {"shards": old_hash}},
                           "saes": {"s": {"train": "old", "layer": 0, "k": 4, "expansion": 2}}})  # fmt: skip
    plan = WorkflowPlan.from_config(cfg)
    (run,) = plan.runs.values()
    assert plan.layer_hash["old"] == {0: old_hash, 1: old_hash} and run.train_config.train_shards == old_hash
