"""Two real Snakemake workflows with `--nolock`, started together on the same shards and runs roots: both finish
and every file they share is intact (the shard lock and the run lock make the second writer wait and reuse)."""

import json
import subprocess

import pytest
import yaml

from hang import HANG_SEC
from saeflow.store.shards.validate import validate
from saeflow.training.sae import load_sae
from workflow_helpers import REPO_ROOT, env, snakemake_cmd, write_config

pytestmark = pytest.mark.slow  # every test here runs Snakemake or the CLI end to end

TEST_CONFIG = yaml.safe_load((REPO_ROOT / ".test" / "config" / "config.yaml").read_text())
# 32 examples of 16 tokens, less the one special id each (`tokens: auto` trains text on no_special): 480 vectors
N_STEPS = 480 // 16


def test_two_nolock_workflows_on_the_same_roots(tmp_path):
    cfg = {
        **TEST_CONFIG,
        "shards_root": str(tmp_path / "shards"),
        "runs_root": str(tmp_path / "runs"),
        "activations": {"text": TEST_CONFIG["activations"]["text"]},
        "saes": {"text-topk": {**TEST_CONFIG["saes"]["text-topk"], "batch_size": 16}},  # N_STEPS per run
    }
    procs = []
    for name in ("a", "b"):
        workdir = tmp_path / name
        workdir.mkdir()
        cfg_fpath = write_config(workdir, {**cfg, "summary_dir": str(workdir / "summary")})
        cmd = snakemake_cmd(workdir, cfg_fpath, "--nolock", "--cores", "1")
        procs.append(subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [proc.communicate(timeout=HANG_SEC)[0] for proc in procs]
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-4000:]

    (shard_dpath,) = [p for p in (tmp_path / "shards").iterdir() if not p.name.startswith(".")]
    assert validate(shard_dpath, name=shard_dpath.name).ok
    run_dpaths = [p for p in (tmp_path / "runs").iterdir() if not p.name.startswith(".")]
    assert len(run_dpaths) == 2
    for run_dpath in run_dpaths:
        lines = [json.loads(line) for line in (run_dpath / "checkpoint" / "metrics.jsonl").read_text().splitlines()]
        steps = [r["step"] for r in lines if not r.get("final")]
        assert steps == sorted(set(steps)), steps  # strictly increasing: no second trainer interleaved
        assert lines[-1]["final"] and sum(bool(r.get("final")) for r in lines) == 1
        load_sae(run_dpath / "checkpoint" / "sae.pt")
        assert json.loads((run_dpath / "checkpoint" / "metrics.json").read_text())["step"] == steps[-1] == N_STEPS
        assert not list((run_dpath / "checkpoint").glob(".*"))  # no temporaries, no staged publish
        (dump,) = (run_dpath / "inference").glob("[0-9a-f]*")
        assert (dump / "metrics.json").exists() and (dump / "visuals" / "index.html").exists()
