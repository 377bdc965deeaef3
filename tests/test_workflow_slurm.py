"""The OSC profile through the real Slurm executor plugin, against fake sbatch/sacct/squeue/srun/scontrol/sacctmgr.

The fake sbatch (tests/fake_slurm/) records every call and runs the job script here, so the test checks both what
would be asked of Slurm (account, partition, GPUs, time, memory) and that the workflow completes through it.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from saeflow import cli, runs, train
from saeflow.commands.workflow import install_profile
from workflow_helpers import REPO_ROOT, SNAKEFILE, env, tiny_config, write_config

FAKE_SLURM_DPATH = REPO_ROOT / "tests" / "fake_slurm"


def _snakemake_output(tmp_path) -> str:
    return (tmp_path / "slurm" / "snakemake.out").read_text()


def _run_through_fake_slurm(tmp_path, profile, config_fpath, *targets, expect_restarts=0, **env_extra):
    """Snakemake with `profile` against the fake Slurm commands; the sbatch command lines, keyed by rule (a list).
    Snakemake's output is kept in slurm/snakemake.out. The profile retries failed jobs: a failure the test does not
    expect (`expect_restarts`) must not hide behind a retry, so every restart is counted."""
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
            **env_extra,
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    (state / "snakemake.out").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    restarts = (proc.stdout + proc.stderr).count("Trying to restart job")
    assert restarts == expect_restarts, f"{restarts} job(s) failed and were retried:\n{proc.stderr[-4000:]}"
    calls = [json.loads(line) for line in (state / "sbatch_calls.jsonl").read_text().splitlines()]
    by_rule = {}
    for argv in calls:
        line = " ".join(argv)
        rule = line.split("--comment ")[1].split()[0].strip("'\"").removeprefix("rule_").split("_wildcards")[0]
        by_rule.setdefault(rule, []).append(line)
    return by_rule


def test_osc_profile_submits_gpu_jobs_and_completes_and_training_survives_the_warning_signal(tmp_path):
    """The whole workflow through the profile; the training job gets Slurm's warning signal (USR1, asked for with
    --signal) from the fake scheduler once its first resume checkpoint exists, saves and fails, and Snakemake's
    retry (with a longer time limit) resumes it to the weights of an uninterrupted run."""
    profile = install_profile("PAS1234", tmp_path / "profile" / "osc", allow_cpu_torch=True)
    cfg = tiny_config(k=(4,))
    cfg["saes"]["topk"]["n_epochs"] = 60  # 180 steps: the signal comes long before the end
    cfg["train"] = {"checkpoint_every": 5}
    config_fpath = write_config(tmp_path, cfg)
    resume_glob = str(tmp_path / "ess" / "*" / "checkpoint" / "resume.pt")
    lines_by_rule = _run_through_fake_slurm(
        tmp_path, profile, config_fpath, expect_restarts=1, FAKE_SLURM_SIGNAL_WHEN=resume_glob
    )
    (sent,) = [json.loads(line) for line in (tmp_path / "slurm" / "signals.jsonl").read_text().splitlines()]
    assert sent["signal"] == "SIGUSR1" and not sent["batch_only"] and sent["to"], sent
    first, retry = lines_by_rule["train"]  # the signalled attempt and its retry, with a longer time limit
    assert "-t 720" in first and "-t 1440" in retry, (first, retry)
    stopped = re.search(
        r"stopped by SIGUSR1: resume checkpoints saved at step (\d+) of 180", _snakemake_output(tmp_path)
    )
    assert stopped, "the failed attempt's log (show-failed-logs) says where it stopped"
    (run_dpath,) = (p.parents[1] for p in (tmp_path / "ess").glob("*/checkpoint/sae.pt"))
    (train_log,) = (tmp_path / "logs" / "train").iterdir()  # the retry's
    assert f"resuming at step {stopped.group(1)} of 180" in train_log.read_text()
    alone = runs.create_run(tmp_path / "alone", json.loads((run_dpath / "checkpoint" / "config.json").read_text()),
                            train_shards=(run_dpath / "links" / "train-shards").resolve(),
                            val_shards=(run_dpath / "links" / "val-shards").resolve())  # fmt: skip
    train.train_runs([alone.root], device="cpu")
    assert (run_dpath / "checkpoint" / "sae.pt").read_bytes() == alone.sae_fpath.read_bytes()

    by_rule = {rule: lines[0] for rule, lines in lines_by_rule.items()}
    # create_run and summary are local rules: they never reach Slurm.
    assert set(by_rule) == {"extract", "train", "inference", "evaluate"}, sorted(by_rule)
    for line in by_rule.values():
        assert "-A PAS1234" in line or "--account PAS1234" in line or "--account=PAS1234" in line, line
        # No partition of the profile's: the plugin names the default one `sinfo` reports (the fake says cpu).
        assert " -p cpu " in line and "--partition" not in line, line
        assert "--gpus=1" in line or "--gres=gpu:1" in line or "--gpus 1" in line, line
    assert "-t 360" in by_rule["extract"] and "--mem 96000" in by_rule["extract"], by_rule["extract"]
    assert "-t 720" in by_rule["train"] and "--mem 96000" in by_rule["train"], by_rule["train"]
    assert "-t 120" in by_rule["inference"] and "--mem 48000" in by_rule["inference"], by_rule["inference"]
    assert "-t 60" in by_rule["evaluate"] and "--mem 48000" in by_rule["evaluate"], by_rule["evaluate"]

    summary_csv = tmp_path / "summary" / "summary.csv"
    assert summary_csv.is_file() and len(summary_csv.read_text().splitlines()) == 2
    assert list((tmp_path / "scratch").glob("*/shards.json")) and list((tmp_path / "ess").glob("*/checkpoint/sae.pt"))


def test_install_profile_fills_in_the_account_and_refuses_to_overwrite(tmp_path, capsys):
    dest = install_profile("PAS4321", tmp_path / "osc", allow_cpu_torch=True)
    text = (dest / "config.yaml").read_text()
    assert "PAS0000" not in text and "SAEFLOW_PYTHON" not in text
    assert "slurm_account: PAS4321" in text and "/fs/scratch/PAS4321/$USER/saev/shards" in text
    assert f"python: {json.dumps(sys.executable)}" in text
    base = ["install-profile", "--account", "PAS4321", "--cluster", "pitzer", "--allow-cpu-torch"]
    assert cli.main([*base, "--dest", str(dest)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert cli.main([*base[:2], "PAS 1", *base[3:], "--dest", str(tmp_path / "x")]) == 1
    assert "not a Slurm account name" in capsys.readouterr().err
    assert cli.main([*base, "--dest", str(dest), "--force"]) == 0
    # This venv has a CPU-only torch: without --allow-cpu-torch the profile is refused, naming the problem.
    assert cli.main([*base[:-1], "--dest", str(tmp_path / "y")]) == 1
    err = capsys.readouterr().err
    assert "a CPU-only build: GPU jobs would refuse to run" in err and not (tmp_path / "y").exists()


def test_literal_profile_osc_works_after_install(tmp_path):
    """`saeflow install-profile` then the literal `snakemake --profile osc` (found in ~/.config/snakemake)."""
    home = tmp_path / "home"
    install_profile("PAS4321", home / ".config" / "snakemake" / "osc", allow_cpu_torch=True)
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

    profile = install_profile("PAS1234", tmp_path / "profile" / "osc", allow_cpu_torch=True)
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


# What each cluster's profile asks of Slurm: GPU request, cores and memory per GPU, partition, walltime per attempt.
CLUSTER_REQUESTS = {
    "cardinal": {"gpu_cpus": 12, "gpu_mem": {"extract": 96000, "train": 96000, "inference": 48000}},
    "ascend": {"gpu_cpus": 16, "gpu_mem": {"extract": 160000, "train": 160000, "inference": 80000}},
    "pitzer": {"gpu_cpus": 10, "gpu_mem": {"extract": 72000, "train": 72000, "inference": 36000}},
}
RUNTIME_MIN = {"extract": 360, "extract_part": 360, "extract_seal": 120, "train": 720, "inference": 120}


@pytest.fixture(scope="module")
def half_built(tmp_path_factory):
    """A config whose every GPU rule has one job ready to submit: an activation to extract in one job (`one`),
    one to extract in 2 parts (`split`), a run to train (k=8) and a trained run to run inference with (k=4)."""
    from saeflow import config as config_mod
    from saeflow.planning import WorkflowPlan

    root = tmp_path_factory.mktemp("half-built")
    cfg = tiny_config(k=(4, 8), patches_per_shard=4 * 16)
    cfg.update(shards_root=str(root / "scratch"), runs_root=str(root / "ess"))
    docs = cfg["activations"]["docs"]
    cfg["activations"]["one"] = {**docs, "layers": [2]}
    cfg["activations"]["split"] = {**docs, "layers": [3], "parts": 2}
    config_fpath = write_config(root, cfg)
    plan = WorkflowPlan.from_config(config_mod.load(config_fpath))
    assert cli.main(["extract", str(config_fpath), "--activation", "docs", "--no-progress"]) == 0
    for index in (0, 1):
        roots = ["--shards-root", cfg["shards_root"], "--runs-root", cfg["runs_root"]]
        assert cli.main(["create-run", str(config_fpath), "--sae", "topk", "--index", str(index), *roots]) == 0
    k4, k8 = (plan.run(run_id) for run_id, p in sorted(plan.runs.items(), key=lambda kv: kv[1].index))
    assert cli.main(["train", "--run", str(k4.root)]) == 0
    targets = [
        plan.activation_shards("one").shards_fpath,
        plan.activation_shards("split").shards_fpath,
        k8.sae_fpath,
        k4.dump(plan.shard_hash["docs"]).index_fpath,
    ]
    roots = [f"shards_root={cfg['shards_root']}", f"runs_root={cfg['runs_root']}"]
    return config_fpath, roots, [str(t) for t in targets]


@pytest.mark.parametrize("cluster", sorted(CLUSTER_REQUESTS))
def test_each_cluster_profile_asks_slurm_for_what_exists_there(tmp_path, half_built, cluster):
    """Every GPU rule through the installed profile and the fake sbatch (which records and fails each job, so each
    is retried on Cardinal): the GPU flag, cores and memory per GPU, no partition for GPU jobs, and a walltime
    that grows with each attempt."""
    config_fpath, roots, targets = half_built
    want = CLUSTER_REQUESTS[cluster]
    n_attempts = 2 if cluster == "cardinal" else 1  # the walltime per attempt once: retries are slow to simulate
    profile = install_profile("PAS1234", tmp_path / "osc", cluster=cluster, allow_cpu_torch=True)
    # The one partition named anywhere: Ascend's CPU-only jobs (the seal) go to `cpuonly`.
    partitions = re.findall(r"slurm_partition: (\S+)", (profile / "config.yaml").read_text())
    assert partitions == (["cpuonly"] if cluster == "ascend" else [])
    state = tmp_path / "slurm"
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(SNAKEFILE), "--directory", str(tmp_path),
         "--configfile", str(config_fpath), "--profile", str(profile), "--latency-wait", "0", "--config", *roots,
         "--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "1",
         "--retries", str(n_attempts - 1), "--", *targets],
        env=env(PATH=f"{FAKE_SLURM_DPATH}{os.pathsep}{env()['PATH']}", FAKE_SLURM_DIR=str(state),
                FAKE_SLURM_ACCOUNT="PAS1234", FAKE_SLURM_NO_RUN="1"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    # Every job "failed": only the submissions are of interest.
    assert proc.returncode != 0 and (state / "sbatch_calls.jsonl").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    by_rule = {}
    for argv in map(json.loads, (state / "sbatch_calls.jsonl").read_text().splitlines()):
        line = " ".join(argv)
        rule = line.split("--comment ")[1].split()[0].strip("'\"").removeprefix("rule_").split("_wildcards")[0]
        by_rule.setdefault(rule, []).append(line)
    n_jobs = {"extract": 1, "extract_part": 2, "train": 1, "inference": 1}
    assert {r: len(lines) for r, lines in by_rule.items()} == {r: n * n_attempts for r, n in n_jobs.items()}
    for rule, lines in by_rule.items():
        minutes = sorted(int(line.split(" -t ")[1].split()[0]) for line in lines)
        assert minutes == sorted([RUNTIME_MIN[rule] * (a + 1) for a in range(n_attempts)] * n_jobs[rule]), rule
        for line in lines:
            assert "--account PAS1234" in line or "-A PAS1234" in line, line
            assert "--gpus=1" in line, line
            assert f"--cpus-per-gpu={want['gpu_cpus']}" in line or f"--cpus-per-task={want['gpu_cpus']}" in line, line
            assert f"--mem {want['gpu_mem'][rule.removesuffix('_part')]}" in line, line
            # Slurm's warning signal 3 minutes before the limit where saeflow saves its resume point on it.
            assert (" --signal=USR1@180 " in line) == (rule != "inference"), line  # one bare argument
            # No partition of the profile's: the plugin names the default one `sinfo` reports (the fake says cpu).
            assert " -p cpu " in line and "cpuonly" not in line and "--partition" not in line, line
