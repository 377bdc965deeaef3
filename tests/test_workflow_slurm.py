"""The OSC profile through the real Slurm executor plugin, against fake sbatch/sacct/squeue/srun/scontrol/sacctmgr.

The fake sbatch (tests/fake_slurm/) records every call and runs the job script here, so the test checks both what
would be asked of Slurm (account, partition, GPUs, time, memory) and that the workflow completes through it.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from saeflow import cli
from saeflow.commands.workflow import install_profile
from workflow_helpers import REPO_ROOT, SNAKEFILE, env, tiny_config, write_config

FAKE_SLURM_DPATH = REPO_ROOT / "tests" / "fake_slurm"


def _run_through_fake_slurm(tmp_path, profile, config_fpath, *targets):
    """Snakemake with `profile` against the fake Slurm commands; the sbatch command lines, keyed by rule (a list)."""
    state = tmp_path / "slurm"
    state.mkdir(exist_ok=True)
    proc = subprocess.run(
        [
            sys.executable, "-m", "snakemake", "-s", str(SNAKEFILE), "--directory", str(tmp_path),
            "--configfile", str(config_fpath), "--profile", str(profile),
            "--config", f"shards_root={tmp_path / 'scratch'}", f"runs_root={tmp_path / 'ess'}",
            "--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "1", *targets,
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
        by_rule.setdefault(rule, []).append(line)
    return by_rule


def test_osc_profile_submits_gpu_jobs_and_completes(tmp_path):
    profile = install_profile("PAS1234", tmp_path / "profile" / "osc")
    cfg = tiny_config(k=(4,))
    config_fpath = write_config(tmp_path, cfg)
    by_rule = {rule: lines[0] for rule, lines in _run_through_fake_slurm(tmp_path, profile, config_fpath).items()}
    # create_run and summary are local rules: they never reach Slurm.
    assert set(by_rule) == {"extract", "train", "inference"}, sorted(by_rule)
    for line in by_rule.values():
        assert "-A PAS1234" in line or "--account PAS1234" in line or "--account=PAS1234" in line, line
        assert "-p gpu" in line or "--partition gpu" in line or "--partition=gpu" in line, line
        assert "--gpus=1" in line or "--gres=gpu:1" in line or "--gpus 1" in line, line
    assert "-t 360" in by_rule["extract"] and "--mem 64000" in by_rule["extract"], by_rule["extract"]
    assert "-t 720" in by_rule["train"] and "--mem 64000" in by_rule["train"], by_rule["train"]
    assert "-t 120" in by_rule["inference"] and "--mem 32000" in by_rule["inference"], by_rule["inference"]

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


def test_no_default_profile_is_shipped():
    """profiles/default/ would be picked up automatically and override --profile keys."""
    assert not (REPO_ROOT / "profiles" / "default").exists()
    assert pathlib.Path(REPO_ROOT / "profiles" / "osc" / "config.yaml").is_file()


def test_split_extraction_submits_part_jobs_and_a_seal_and_a_crashed_part_resumes(tmp_path, monkeypatch):
    """4 part jobs + 1 seal job through the profile; the directory equals one job's, byte for byte; a part that
    crashed before the workflow ran resumes from its last complete shard (the other parts start from nothing)."""
    from builders import file_bytes
    from saeflow import extract, models
    from saeflow.specs import ActivationSpec

    cfg = tiny_config(k=(4,), patches_per_shard=4 * 16)  # 24 examples, 4 per shard: 6 shards -> parts of 2,2,1,1
    act = cfg["activations"]["docs"]
    act.update(parts=4, batch_size=2)
    spec = ActivationSpec.from_dict(act)
    one_job = extract.extract(spec, tmp_path / "one-job", progress=False).dpath

    real_run, calls = models.Adapter.run, []

    def crashing_run(self, batch, layers):
        calls.append(1)
        if len(calls) == 3:  # part 1 is shards 2 and 3: dies in shard 3 after shard 2 is complete
            raise RuntimeError("killed")
        return real_run(self, batch, layers)

    monkeypatch.setattr(models.Adapter, "run", crashing_run)
    with pytest.raises(RuntimeError, match="killed"):
        extract.extract(spec, tmp_path / "scratch", progress=False, part=(1, 4))
    monkeypatch.setattr(models.Adapter, "run", real_run)

    profile = install_profile("PAS1234", tmp_path / "profile" / "osc")
    config_fpath = write_config(tmp_path, cfg)
    target = tmp_path / "scratch" / one_job.name / "shards.json"
    by_rule = _run_through_fake_slurm(tmp_path, profile, config_fpath, str(target))
    assert sorted(by_rule) == ["extract_part", "extract_seal"], sorted(by_rule)
    assert len(by_rule["extract_part"]) == 4 and len(by_rule["extract_seal"]) == 1
    for line in by_rule["extract_part"]:
        assert "--gpus=1" in line or "--gres=gpu:1" in line, line
    assert "gpu" not in by_rule["extract_seal"][0], by_rule["extract_seal"][0]  # verifying and renaming needs none

    assert file_bytes(target.parent) == file_bytes(one_job)
    prov = json.loads((target.parent / "provenance.json").read_text())
    assert [p["resumed_from_ex"] for p in prov["parts"]] == [0, 4, 0, 0]
    assert len({p["slurm_job_id"] for p in prov["parts"]}) == 4  # each part ran in its own job
    assert not (tmp_path / "scratch" / f".{one_job.name}.parts").exists()
