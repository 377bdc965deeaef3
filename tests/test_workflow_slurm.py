"""The OSC profile through the real Slurm executor plugin, against fake sbatch/sacct/squeue/srun/scontrol/sacctmgr.

The fake sbatch (tests/fake_slurm/) records every call and runs the job script here, so the test checks both what
would be asked of Slurm (account, partition, GPUs, time, memory) and that the workflow completes through it.
"""

import json
import os
import subprocess
import sys

import yaml

from saeflow import cli
from saeflow.commands.workflow import install_profile
from workflow_helpers import REPO_ROOT, SNAKEFILE, env, tiny_config, write_config

FAKE_SLURM_DPATH = REPO_ROOT / "tests" / "fake_slurm"


def test_osc_profile_submits_gpu_jobs_and_completes(tmp_path):
    profile = install_profile("PAS1234", tmp_path / "profile" / "osc")
    cfg = tiny_config(k=(4,))
    config_fpath = write_config(tmp_path, cfg)
    state = tmp_path / "slurm"
    state.mkdir()
    proc = subprocess.run(
        [
            sys.executable, "-m", "snakemake", "-s", str(SNAKEFILE), "--directory", str(tmp_path),
            "--configfile", str(config_fpath), "--profile", str(profile),
            "--config", f"shards_root={tmp_path / 'scratch'}", f"runs_root={tmp_path / 'ess'}",
            "--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "1",
        ],  # fmt: skip
        env=env(
            PATH=f"{FAKE_SLURM_DPATH}{os.pathsep}{env()['PATH']}",
            FAKE_SLURM_DIR=str(state),
            FAKE_SLURM_ACCOUNT="PAS1234",
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    calls = [json.loads(line) for line in (state / "sbatch_calls.jsonl").read_text().splitlines()]
    by_rule = {}
    for argv in calls:
        line = " ".join(argv)
        rule = line.split("--comment ")[1].split()[0].strip("'\"").removeprefix("rule_").split("_wildcards")[0]
        by_rule[rule] = line
    # create_run and summary are local rules: they never reach Slurm.
    assert set(by_rule) == {"extract", "train", "inference", "evaluate"}, sorted(by_rule)
    for line in by_rule.values():
        assert "-A PAS1234" in line or "--account PAS1234" in line or "--account=PAS1234" in line, line
        assert "-p gpu" in line or "--partition gpu" in line or "--partition=gpu" in line, line
        assert "--gpus=1" in line or "--gres=gpu:1" in line or "--gpus 1" in line, line
    assert "-t 360" in by_rule["extract"] and "--mem 64000" in by_rule["extract"], by_rule["extract"]
    assert "-t 720" in by_rule["train"] and "--mem 64000" in by_rule["train"], by_rule["train"]
    assert "-t 120" in by_rule["inference"] and "--mem 32000" in by_rule["inference"], by_rule["inference"]
    assert "-t 60" in by_rule["evaluate"] and "--mem 32000" in by_rule["evaluate"], by_rule["evaluate"]

    summary_csv = tmp_path / "summary" / "summary.csv"
    assert summary_csv.is_file() and len(summary_csv.read_text().splitlines()) == 2
    assert list((tmp_path / "scratch").glob("*/shards.json")) and list((tmp_path / "ess").glob("*/checkpoint/sae.pt"))


def test_install_profile_fills_in_the_account_and_refuses_to_overwrite(tmp_path, capsys):
    dest = install_profile("PAS4321", tmp_path / "osc")
    text = (dest / "config.yaml").read_text()
    assert "PAS0000" not in text
    assert "slurm_account: PAS4321" in text and "/fs/scratch/PAS4321/$USER/saev/shards" in text
    assert cli.main(["install-profile", "--account", "PAS4321", "--dest", str(dest)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert cli.main(["install-profile", "--account", "PAS 1", "--dest", str(tmp_path / "x")]) == 1
    assert "not a Slurm account name" in capsys.readouterr().err
    assert cli.main(["install-profile", "--account", "PAS4321", "--dest", str(dest), "--force"]) == 0


def test_literal_profile_osc_works_after_install(tmp_path):
    """`saeflow install-profile` then the literal `snakemake --profile osc` (found in ~/.config/snakemake)."""
    home = tmp_path / "home"
    install_profile("PAS4321", home / ".config" / "snakemake" / "osc")
    config_fpath = write_config(tmp_path, tiny_config(k=(4,)))
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(SNAKEFILE), "--directory", str(tmp_path),
         "--configfile", str(config_fpath), "--profile", "osc", "-n"],
        env=env(HOME=str(home), USER="alice", PATH=f"{FAKE_SLURM_DPATH}{os.pathsep}{env()['PATH']}"),
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "output: /fs/scratch/PAS4321/alice/saev/shards/" in proc.stdout
    assert "/fs/ess/PAS4321/alice/saev/runs/" in proc.stdout


def test_the_default_profile_overrides_no_key_of_the_osc_profile():
    """profiles/default/ (the workflow's rerun triggers, docs/workflow.md) is applied after --profile osc, so it
    must hold no key the cluster profile sets."""
    default = yaml.safe_load((REPO_ROOT / "profiles" / "default" / "config.yaml").read_text())
    osc = yaml.safe_load((REPO_ROOT / "profiles" / "osc" / "config.yaml").read_text())
    assert default == {"rerun-triggers": ["mtime"]}
    assert not set(default) & set(osc)
