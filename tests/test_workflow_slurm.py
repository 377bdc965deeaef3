"""The OSC profile through the real Slurm executor plugin, against fake sbatch/sacct/squeue/srun/scontrol/sacctmgr.

The fake sbatch (tests/fake_slurm/) records every call and runs the job script here, so the test checks both what
would be asked of Slurm (account, partition, GPUs, time, memory) and that the workflow completes through it.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from hang import HANG_SEC
from saeflow import cli
from saeflow.commands.workflow import DEFAULT_PROFILE_DPATH, install_profile, profile_arg
from saeflow.planning import extraction_passes
from saeflow.store import runs
from saeflow.training import train
from saeflow.training.ranks import launch
from workflow_helpers import PAPER_SNAKEFILE, REPO_ROOT, SNAKEFILE, env, tiny_config, write_config

FAKE_SLURM_DPATH = REPO_ROOT / "tests" / "fake_slurm"
SLURM_FIXTURES_DPATH = REPO_ROOT / "tests" / "fixtures" / "slurm"
GPU_RULES = {"extract", "extract_part", "train", "inference", "evaluate"}


def fixture_gpus(cluster: str) -> dict[str, int]:
    """Partition -> GPUs on `cluster` as its fixture prints them (tests/fixtures/slurm/<cluster>/: the partitions'
    TRES where the cluster accounts GPUs, else their nodes' GRES), read by the fake Slurm's own module."""
    spec = importlib.util.spec_from_file_location("_cluster", FAKE_SLURM_DPATH / "_cluster.py")
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FAKE_SLURM_CLUSTER", cluster)
        mp.delenv("FAKE_SLURM_DEFAULT_PARTITION", raising=False)
        return {partition: fake.n_gpus(partition) for partition in fake.scontrol_blocks()}


def cluster_config(**kwargs) -> dict:
    """`tiny_config` as a user of a GPU cluster writes it: every activation on device `auto` (the GPU where the job
    has one, this machine's CPU here), so extraction is a GPU job; `cpu` plans a CPU job."""
    cfg = tiny_config(**kwargs)
    for activation in cfg["activations"].values():
        activation["device"] = "auto"
    return cfg


def fake_slurm_env(state, cluster: str = "cardinal", **extra) -> dict:
    """The fake Slurm commands first on PATH, standing for `cluster` (tests/fixtures/slurm/<cluster>/)."""
    return env(
        PATH=f"{FAKE_SLURM_DPATH}{os.pathsep}{env()['PATH']}",
        FAKE_SLURM_DIR=str(state),
        FAKE_SLURM_ACCOUNT="PAS1234",
        FAKE_SLURM_CLUSTER=cluster,
        **extra,
    )


def _lines_by_rule(state) -> dict[str, list[str]]:
    """The recorded sbatch command lines, keyed by rule (a list: retries too)."""
    by_rule = {}
    for argv in map(json.loads, (state / "sbatch_calls.jsonl").read_text().splitlines()):
        line = " ".join(argv)
        rule = line.split("--comment ")[1].split()[0].strip("'\"").removeprefix("rule_").split("_wildcards")[0]
        by_rule.setdefault(rule, []).append(line)
    return by_rule


def _snakemake_output(tmp_path) -> str:
    return (tmp_path / "slurm" / "snakemake.out").read_text()


def _failed_jobs(tmp_path, proc) -> str:
    """Each "Error in rule" block of Snakemake's output and the end of every log it names: what a retry hid."""
    text, out = proc.stdout + proc.stderr, []
    for block in re.findall(r"Error in rule .*?(?=\n\n|\Z)", text, re.S):
        out.append(block[:1500])
        for logs in re.findall(r"^\s*log: (.*)$", block, re.M):
            for name in logs.split(" (")[0].split(", "):
                fpath = tmp_path / name.strip()
                if fpath.is_file():
                    out.append(f"--- {name.strip()}:\n{fpath.read_text(errors='replace')[-2000:]}")
    for fpath in sorted((tmp_path / "slurm" / "failed").glob("*/logs/**/*.log")):  # kept by the fake sbatch
        if "slurm" not in fpath.relative_to(tmp_path / "slurm" / "failed").parts[2:3]:
            out.append(f"--- failed job {fpath.relative_to(tmp_path / 'slurm' / 'failed')}:\n"
                       f"{fpath.read_text(errors='replace')[-2000:]}")  # fmt: skip
    return "\n".join(out) or text[-4000:]


def _run_through_fake_slurm(tmp_path, profile, config_fpath, *args, expect_restarts=0, **env_extra):
    """Snakemake with `profile` against the fake Slurm commands (Cardinal); the sbatch command lines, keyed by rule
    (a list). Snakemake's output is kept in slurm/snakemake.out. The roots come from the config file, as a user
    gives them: they must beat the profile's defaults. The profile retries failed jobs: a failure the test does not
    expect (`expect_restarts`) must not hide behind a retry, so every restart is counted."""
    state = tmp_path / "slurm"
    state.mkdir(exist_ok=True)
    proc = subprocess.run(
        [
            sys.executable, "-m", "snakemake", "-s", str(SNAKEFILE), "--directory", str(tmp_path),
            "--configfile", str(config_fpath), "--profile", str(profile),
            "--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "1",
            "--max-threads", "1", *args,  # jobs' torch threads: one, as in the test process (SNAKEMAKE_TEST_ARGS)
        ],  # fmt: skip
        env=fake_slurm_env(state, **env_extra),
        capture_output=True,
        text=True,
        timeout=HANG_SEC,
    )
    (state / "snakemake.out").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    restarts = (proc.stdout + proc.stderr).count("Trying to restart job")
    assert restarts == expect_restarts, f"{restarts} job(s) failed and were retried:\n{_failed_jobs(tmp_path, proc)}"
    assert not (state / "refused.jsonl").exists(), (state / "refused.jsonl").read_text()
    return _lines_by_rule(state)


def _user_roots(tmp_path, cfg: dict) -> dict:
    """`cfg` with the user's own roots under tmp_path (absolute, as a user's config file gives them)."""
    return {**cfg, "shards_root": str(tmp_path / "scratch"), "runs_root": str(tmp_path / "ess"),
            "summary_dir": str(tmp_path / "summary")}  # fmt: skip


@pytest.mark.slow
def test_osc_profile_submits_gpu_jobs_and_completes_and_training_survives_the_warning_signal(tmp_path):
    """The whole workflow through the profile; the training job gets Slurm's warning signal (USR1, asked for with
    --signal) from the fake scheduler once its first resume checkpoint exists, saves and fails, and Snakemake's
    retry (with a longer time limit) resumes it to the weights of an uninterrupted run."""
    profile = install_profile("PAS1234", tmp_path / "profile" / "osc", allow_cpu_torch=True)
    cfg = cluster_config(k=(4,))
    cfg["saes"]["topk"]["n_epochs"] = 60  # 180 steps: the signal comes long before the end
    cfg["train"] = {"checkpoint_every": 5}
    config_fpath = write_config(tmp_path, _user_roots(tmp_path, cfg))
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
    train.train_runs([alone.root], train.TrainSettings(device="cpu"))
    assert (run_dpath / "checkpoint" / "sae.pt").read_bytes() == alone.sae_fpath.read_bytes()

    by_rule = {rule: lines[0] for rule, lines in lines_by_rule.items()}
    # create_run and summary are local rules (CPU-only bookkeeping): they never reach Slurm, so ask for no GPU.
    assert set(by_rule) == {"extract", "train", "inference", "evaluate"}, sorted(by_rule)
    for line in by_rule.values():
        assert "-A PAS1234" in line or "--account PAS1234" in line or "--account=PAS1234" in line, line
        # Cardinal's default partition (what the plugin names for a job that names none) is CPU-only: every GPU
        # job names the GPU partition, which has GPUs (the fake sbatch refuses a GPU job anywhere else).
        assert " -p gpu " in line and fixture_gpus("cardinal")["gpu"] > 0, line
        assert "--gpus=1" in line or "--gres=gpu:1" in line or "--gpus 1" in line, line
    assert "-t 360" in by_rule["extract"] and "--mem 96000" in by_rule["extract"], by_rule["extract"]
    # Training's cores and memory come per GPU (train.gpus GPUs: 12 cores and 96 GB each on Cardinal).
    assert "-t 720" in by_rule["train"] and "--mem-per-cpu 8000" in by_rule["train"], by_rule["train"]
    assert "--cpus-per-gpu=12" in by_rule["train"] and "--cpus-per-task" not in by_rule["train"], by_rule["train"]
    assert "-t 120" in by_rule["inference"] and "--mem 48000" in by_rule["inference"], by_rule["inference"]
    assert "-t 60" in by_rule["evaluate"] and "--mem 48000" in by_rule["evaluate"], by_rule["evaluate"]

    summary_csv = tmp_path / "summary" / "summary.csv"
    assert summary_csv.is_file() and len(summary_csv.read_text().splitlines()) == 2
    # The config file's roots beat the profile's default_roots (/fs/scratch/..., /fs/ess/...), jobs included.
    assert list((tmp_path / "scratch").glob("*/shards.json")) and list((tmp_path / "ess").glob("*/checkpoint/sae.pt"))
    assert f"saeflow: runs_root: {tmp_path / 'ess'} (from config file {config_fpath})" in _snakemake_output(tmp_path)


@pytest.mark.slow
def test_install_profile_fills_in_the_account_and_refuses_to_overwrite(tmp_path, capsys):
    dest = install_profile("PAS4321", tmp_path / "osc", allow_cpu_torch=True)
    text = (dest / "config.yaml").read_text()
    assert "PAS0000" not in text and "SAEFLOW_PYTHON" not in text
    assert "slurm_account: PAS4321" in text and "/fs/scratch/PAS4321/$USER/saev/shards" in text
    # The profile's roots are defaults only (a profile's `config:` is a --config, which beats --configfile).
    assert set(yaml.safe_load(text)["config"]) == {"default_roots", "python"}
    assert f"python: {json.dumps(sys.executable)}" in text
    base = ["install-profile", "--account", "PAS4321", "--cluster", "pitzer", "--allow-cpu-torch"]
    assert cli.main([*base, "--dest", str(dest)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert cli.main([*base[:2], "PAS 1", *base[3:], "--dest", str(tmp_path / "x")]) == 1
    assert "not a Slurm account name" in capsys.readouterr().err
    capsys.readouterr()
    assert cli.main([*base, "--dest", str(dest), "--force"]) == 0
    # Issue 40: it printed `snakemake --profile osc`, which finds the default place's profile, not this one.
    assert capsys.readouterr().out.splitlines()[-1] == f"run the workflow on Slurm with:  snakemake --profile {dest}"
    assert profile_arg(DEFAULT_PROFILE_DPATH) == "osc"
    assert profile_arg(tmp_path / "a b") == f"'{tmp_path}/a b'"  # shell-quoted
    # This venv has a CPU-only torch: without --allow-cpu-torch the profile is refused, naming the problem.
    assert cli.main([*base[:-1], "--dest", str(tmp_path / "y")]) == 1
    err = capsys.readouterr().err
    assert "a CPU-only build: GPU jobs would refuse to run" in err and not (tmp_path / "y").exists()


def _dry_run_with_osc_profile(tmp_path, config_fpath, *args, profile="osc", **env_extra) -> str:
    """`snakemake --profile osc -n` as user alice, the profile installed in her ~/.config/snakemake; its output.
    profile=None: no profile."""
    home = tmp_path / "home"
    if profile and not (home / ".config" / "snakemake" / "osc").exists():
        install_profile("PAS4321", home / ".config" / "snakemake" / "osc", allow_cpu_torch=True)
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(SNAKEFILE), "--directory", str(tmp_path),
         "--configfile", str(config_fpath), *(["--profile", profile] if profile else []), "-n", *args],
        env=fake_slurm_env(tmp_path / "slurm", HOME=str(home), USER="alice", **env_extra),
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_literal_profile_osc_works_after_install_and_supplies_the_roots_a_config_lacks(tmp_path):
    """`saeflow install-profile` then the literal `snakemake --profile osc` (found in ~/.config/snakemake): a config
    without roots gets the profile's scratch and project roots, and the plan says so, even where $SAEV_SCRATCH and
    $SAEV_NFS are set; without the profile those give the roots."""
    cfg = tiny_config(k=(4,))
    del cfg["shards_root"], cfg["runs_root"]
    spec_env = {"SAEV_SCRATCH": str(tmp_path / "scratch"), "SAEV_NFS": str(tmp_path / "nfs")}
    out = _dry_run_with_osc_profile(tmp_path, write_config(tmp_path, cfg), profile=None, **spec_env)
    # No profile: the storage spec's environment gives the roots, and the plan says so.
    assert f"output: {tmp_path}/scratch/saev/shards/" in out and f"output: {tmp_path}/nfs/saev/runs/" in out
    assert f"saeflow: shards_root: {tmp_path}/scratch/saev/shards (from $SAEV_SCRATCH (the storage spec's " in out
    assert f"saeflow: runs_root: {tmp_path}/nfs/saev/runs (from $SAEV_NFS (the storage spec's environment))" in out
    out = _dry_run_with_osc_profile(tmp_path, write_config(tmp_path, cfg), **spec_env)  # the profile's beat them
    assert "output: /fs/scratch/PAS4321/alice/saev/shards/" in out and "/fs/ess/PAS4321/alice/saev/runs/" in out
    assert "saeflow: shards_root: /fs/scratch/PAS4321/alice/saev/shards (from default_roots (the profile's " in out
    assert "saeflow: runs_root: /fs/ess/PAS4321/alice/saev/runs (from default_roots (the profile's default))" in out
    assert f"saeflow: summary_dir: summary (from config file {tmp_path / 'config.yaml'})" in out


@pytest.mark.slow
def test_a_profile_installed_before_saeflows_table_is_named_in_a_warning(tmp_path):
    """A profile that keys the requests by bare rule names (as install-profile wrote them before saeflow's rules read
    their own table) still reaches the checkout's rules through Snakemake, but not renamed ones: every invocation
    says so and how to reinstall."""
    cfg = cluster_config(k=(4,))
    out = _dry_run_with_osc_profile(tmp_path, write_config(tmp_path, cfg))
    assert "set-resources name saeflow's rules" not in out and "slurm_partition=gpu" in out
    fpath = tmp_path / "home" / ".config" / "snakemake" / "osc" / "config.yaml"
    fpath.write_text(fpath.read_text().replace("  saeflow/", "  "))
    out = _dry_run_with_osc_profile(tmp_path, write_config(tmp_path, cfg))
    assert "saeflow: the profile's set-resources name saeflow's rules without `saeflow/` (evaluate, extract, " in out
    assert "Reinstall it: saeflow install-profile --force" in out and "slurm_partition=gpu" in out


@pytest.mark.slow
def test_the_users_config_file_and_config_roots_beat_the_profiles(tmp_path):
    """--profile osc --configfile my.yaml: my.yaml's roots win over the profile's defaults; --config beats both;
    the plan names where each root came from."""
    mine = write_config(tmp_path, {**tiny_config(k=(4,)), "shards_root": "$HOME/mine/shards"}, name="my.yaml")
    out = _dry_run_with_osc_profile(tmp_path, mine)
    home = tmp_path / "home"
    assert "/fs/scratch/" not in out and "/fs/ess/" not in out
    assert f"output: {home}/mine/shards/" in out and "output: runs/" in out
    assert f"saeflow: shards_root: {home}/mine/shards (from config file {mine})" in out
    assert f"saeflow: runs_root: runs (from config file {mine})" in out
    out = _dry_run_with_osc_profile(tmp_path, mine, "--config", f"runs_root={tmp_path / 'cli-runs'}")
    assert f"saeflow: runs_root: {tmp_path / 'cli-runs'} (from --config or a profile's `config:`)" in out


def test_the_default_profile_overrides_no_key_of_the_osc_profile():
    """profiles/default/ (the workflow's rerun triggers, docs/workflow.md) is applied after --profile osc, so it
    must hold no key the cluster profile sets."""
    default = yaml.safe_load((REPO_ROOT / "profiles" / "default" / "config.yaml").read_text())
    osc = yaml.safe_load((REPO_ROOT / "profiles" / "osc" / "config.yaml").read_text())
    assert default == {"rerun-triggers": ["mtime"]}
    assert not set(default) & set(osc)


@pytest.mark.slow
def test_split_extraction_submits_part_jobs_and_a_seal_and_a_crashed_part_resumes(tmp_path, monkeypatch):
    """4 part jobs + 1 seal job through the profile; the directory equals one job's, byte for byte; a part that
    crashed before the workflow ran resumes from its last complete shard (the other parts start from nothing)."""
    from builders import file_bytes
    from saeflow.extraction import adapters, extract
    from saeflow.extraction.specs import ActivationSpec

    cfg = cluster_config(k=(4,), patches_per_shard=4 * 16)  # 24 examples, 4 per shard: 6 shards -> parts of 2,2,1,1
    act = cfg["activations"]["docs"]
    act.update(parts=4, batch_size=2)
    spec = ActivationSpec.from_dict(act)
    one_job = extract.extract(spec, tmp_path / "one-job", progress=False).dpath

    real_run, calls = adapters.Adapter.run_points, []

    def crashing_run(self, batch, points):
        calls.append(1)
        if len(calls) == 3:  # part 1 is shards 2 and 3: dies in shard 3 after shard 2 is complete
            raise RuntimeError("killed")
        return real_run(self, batch, points)

    monkeypatch.setattr(adapters.Adapter, "run_points", crashing_run)
    with pytest.raises(RuntimeError, match="killed"):
        extract.extract(spec, tmp_path / "scratch", progress=False, part=(1, 4))
    monkeypatch.setattr(adapters.Adapter, "run_points", real_run)

    profile = install_profile("PAS1234", tmp_path / "profile" / "osc", allow_cpu_torch=True)
    config_fpath = write_config(tmp_path, _user_roots(tmp_path, cfg))
    target = tmp_path / "scratch" / one_job.name / "shards.json"
    by_rule = _run_through_fake_slurm(tmp_path, profile, config_fpath, str(target))
    assert sorted(by_rule) == ["extract_part", "extract_seal"], sorted(by_rule)
    assert len(by_rule["extract_part"]) == 4 and len(by_rule["extract_seal"]) == 1
    for line in by_rule["extract_part"]:
        assert "--gpus=1" in line and " -p gpu " in line, line
    (seal,) = by_rule["extract_seal"]  # verifying and renaming needs no GPU: the CPU partition
    assert "--gpus" not in seal and "gres" not in seal and " -p cpu " in seal, seal

    assert file_bytes(target.parent) == file_bytes(one_job)
    prov = json.loads((target.parent / "provenance.json").read_text())
    assert [p["resumed_from_ex"] for p in prov["parts"]] == [0, 4, 0, 0]
    assert len({p["slurm_job_id"] for p in prov["parts"]}) == 4  # each part ran in its own job
    assert not (tmp_path / "scratch" / f".{one_job.name}.parts").exists()


# What each cluster's profile asks of Slurm: GPU request, cores and memory per GPU, walltime per attempt.
CLUSTER_REQUESTS = {
    "cardinal": {"gpu_cpus": 12, "gpu_mem": {"extract": 96000, "train": 96000, "inference": 48000, "evaluate": 48000}},
    "ascend": {"gpu_cpus": 16, "gpu_mem": {"extract": 160000, "train": 160000, "inference": 80000, "evaluate": 80000}},
    "pitzer": {"gpu_cpus": 10, "gpu_mem": {"extract": 72000, "train": 72000, "inference": 36000, "evaluate": 36000}},
}
RUNTIME_MIN = {"extract": 360, "extract_part": 360, "extract_seal": 120, "train": 720, "inference": 120, "evaluate": 60}


@pytest.fixture(scope="module")
def half_built(tmp_path_factory):
    """A config whose every Slurm rule has one job ready to submit: an activation to extract in one job (`one`),
    one to extract in 2 parts (`split`), one whose 2 parts are extracted, to seal (`sealed`), a run to train (k=8)
    and a trained run to run inference with and to evaluate (k=4)."""
    from saeflow import config as config_mod
    from saeflow.planning import WorkflowPlan

    root = tmp_path_factory.mktemp("half-built")
    cfg = cluster_config(k=(4, 8), patches_per_shard=4 * 16)
    cfg.update(shards_root=str(root / "scratch"), runs_root=str(root / "ess"))
    docs = cfg["activations"]["docs"]
    # other batch sizes (not hashed): each its own job, not one extraction pass of the layers of the same inputs
    cfg["activations"]["one"] = {**docs, "layers": [2], "batch_size": 5}
    cfg["activations"]["split"] = {**docs, "layers": [3], "parts": 2, "batch_size": 6}
    cfg["activations"]["sealed"] = {**docs, "layers": [4], "parts": 2, "batch_size": 7}
    config_fpath = write_config(root, cfg)
    plan = WorkflowPlan.from_config(config_mod.load(config_fpath))
    assert cli.main(["extract", str(config_fpath), "--activation", "docs", "--no-progress"]) == 0
    for part in ("0/2", "1/2"):
        assert cli.main(["extract", str(config_fpath), "--activation", "sealed", "--part", part, "--no-progress"]) == 0
    for index in (0, 1):
        roots = ["--shards-root", cfg["shards_root"], "--runs-root", cfg["runs_root"]]
        assert cli.main(["create-run", str(config_fpath), "--sae", "topk", "--index", str(index), *roots]) == 0
    k4, k8 = (plan.run(run_id) for run_id, p in sorted(plan.runs.items(), key=lambda kv: kv[1].index))
    assert cli.main(["train", "--run", str(k4.root)]) == 0
    targets = [
        plan.shard(plan.shard_hash["one"]).shards_fpath,
        plan.shard(plan.shard_hash["split"]).shards_fpath,
        plan.shard(plan.shard_hash["sealed"]).shards_fpath,
        k8.sae_fpath,
        k4.dump(plan.shard_hash["docs"]).index_fpath,
        k4.evaluation_fpath(plan.shard_hash["docs"]),
    ]
    return config_fpath, [str(t) for t in targets]


@pytest.mark.parametrize("cluster", sorted(CLUSTER_REQUESTS))
@pytest.mark.slow
def test_each_cluster_profile_sends_gpu_jobs_to_gpu_partitions_even_when_the_default_has_none(
    tmp_path, half_built, cluster
):
    """Every Slurm rule through the installed profile and the fake Slurm of `cluster` (its sinfo and scontrol
    fixtures), with a CPU-only partition made the default: the plugin names that default for a job that names no
    partition, and Slurm refuses a GPU there. Every GPU job names a partition with GPUs, the seal asks for no GPU;
    the GPU flag, cores and memory per GPU, and a walltime that grows with each attempt. The fake sbatch records
    each job and fails it, so each is retried on Cardinal."""
    config_fpath, targets = half_built
    want = CLUSTER_REQUESTS[cluster]
    gpus = fixture_gpus(cluster)
    cpu_only = next(p for p, n in gpus.items() if n == 0)
    n_attempts = 2 if cluster == "cardinal" else 1  # the walltime per attempt once: retries are slow to simulate
    state = tmp_path / "slurm"
    slurm_env = fake_slurm_env(state, cluster, FAKE_SLURM_NO_RUN="1", FAKE_SLURM_DEFAULT_PARTITION=cpu_only)
    checked = []
    with pytest.MonkeyPatch.context() as mp:  # install-profile checks the partitions against the fake scontrol
        mp.setenv("PATH", slurm_env["PATH"])
        mp.setenv("FAKE_SLURM_CLUSTER", cluster)
        profile = install_profile("PAS1234", tmp_path / "osc", cluster=cluster, allow_cpu_torch=True,
                                  report=checked.append)  # fmt: skip
    assert checked[0].startswith(f"partitions checked against scontrol and sinfo on {cluster}"), checked
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(SNAKEFILE), "--directory", str(tmp_path),
         "--configfile", str(config_fpath), "--profile", str(profile), "--latency-wait", "0",
         "--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "1",
         "--retries", str(n_attempts - 1), "--", *targets],
        env=slurm_env, capture_output=True, text=True, timeout=HANG_SEC,
    )  # fmt: skip
    # Every job "failed": only the submissions are of interest, and Slurm refused none of them.
    assert proc.returncode != 0 and (state / "sbatch_calls.jsonl").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not (state / "refused.jsonl").exists(), (state / "refused.jsonl").read_text()
    by_rule = _lines_by_rule(state)
    n_jobs = {"extract": 1, "extract_part": 2, "extract_seal": 1, "train": 1, "inference": 1, "evaluate": 1}
    assert {r: len(lines) for r, lines in by_rule.items()} == {r: n * n_attempts for r, n in n_jobs.items()}
    for rule, lines in by_rule.items():
        minutes = sorted(int(line.split(" -t ")[1].split()[0]) for line in lines)
        assert minutes == sorted([RUNTIME_MIN[rule] * (a + 1) for a in range(n_attempts)] * n_jobs[rule]), rule
        for line in lines:
            assert "--account PAS1234" in line or "-A PAS1234" in line, line
            partition = line.split(" -p ")[1].split()[0]
            if rule not in GPU_RULES:  # the seal verifies and renames: CPU-only, in a partition without GPUs
                assert "--gpus" not in line and "gres" not in line and gpus[partition] == 0, line
                assert "--mem 8000" in line, line
                continue
            assert "--gpus=1" in line and gpus[partition] > 0, line
            assert f"--cpus-per-gpu={want['gpu_cpus']}" in line or f"--cpus-per-task={want['gpu_cpus']}" in line, line
            mem_mb = want["gpu_mem"][rule.removesuffix("_part")]
            if rule == "train":  # memory per CPU, so a job on N GPUs gets N times the memory of one
                assert f"--mem-per-cpu {mem_mb // want['gpu_cpus']}" in line, line
            else:
                assert f"--mem {mem_mb}" in line, line
            # Slurm's warning signal 3 minutes before the limit where saeflow saves its resume point on it.
            assert (" --signal=USR1@180 " in line) == (rule not in ("inference", "evaluate")), line  # one argument


def _copy_half_built(tmp_path, half_built, edit=None) -> tuple[dict, list[str], "WorkflowPlan"]:  # noqa: F821
    """A copy of the half-built tree under tmp_path/tree (its config's roots moved there, then `edit`ed), the
    fixture's targets in the copy and the copy's plan: each test submits, and may create, without touching the shared
    tree (its runs' links still name the shared tree's shard directories, which no submitted job reads here)."""
    from saeflow import config as config_mod
    from saeflow.planning import WorkflowPlan

    config_fpath, targets = half_built
    shutil.copytree(config_fpath.parent, tmp_path / "tree", symlinks=True)
    old, new = str(config_fpath.parent), str(tmp_path / "tree")
    cfg = yaml.safe_load(config_fpath.read_text())
    cfg.update(shards_root=cfg["shards_root"].replace(old, new), runs_root=cfg["runs_root"].replace(old, new))
    if edit:
        edit(cfg)
    plan = WorkflowPlan.from_config(config_mod.load(write_config(tmp_path, cfg)))
    return cfg, [target.replace(old, new) for target in targets], plan


def _submit_only(workdir, cfg_fpath, profile, targets, *args, snakefile=SNAKEFILE) -> tuple[dict, str]:
    """Snakemake through `profile` against the fake Slurm (Cardinal) that records each submission and fails it: the
    sbatch lines, by rule, and Snakemake's output. Nothing is retried."""
    state = workdir / "slurm"
    cmd = [sys.executable, "-m", "snakemake", "-s", str(snakefile), "--directory", str(workdir), "--profile",
           str(profile), "--latency-wait", "0", "--retries", "0", "--slurm-init-seconds-before-status-checks", "1",
           "--seconds-between-status-checks", "1", *(["--configfile", str(cfg_fpath)] if cfg_fpath else []), *args,
           "--", *targets]  # fmt: skip
    proc = subprocess.run(cmd, env=fake_slurm_env(state, FAKE_SLURM_NO_RUN="1"), cwd=workdir, capture_output=True,
                          text=True, timeout=HANG_SEC)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and (state / "sbatch_calls.jsonl").exists(), output[-3000:]
    assert not (state / "refused.jsonl").exists(), (state / "refused.jsonl").read_text()
    return _lines_by_rule(state), output


def _requests(line: str) -> str:
    """What a submission asks of Slurm: its sbatch line less the job's name, log, comment, directory and command."""
    return re.sub(r" (--job-name|--output|--comment|-D) \S+", "", line.split(" --wrap")[0])


@pytest.mark.slow
def test_a_paper_repository_with_renamed_rules_submits_the_checkouts_sbatch_lines(tmp_path, half_built):
    """README's module recipe renames every rule (`use rule * from saeflow as saeflow_*`). The profile's table is
    keyed by saeflow's own rule names and each rule reads its entry, so every job asks Slurm exactly what the
    checkout's asks (partition, GPU, cores, memory, time, signal), and the local rules stay local: Snakemake's own
    `set-resources` and `localrules` name rules as the workflow calls them, and matched none of the renamed ones."""
    def other_sae(cfg):  # a run not created yet: its create_run is ready, and must run here
        cfg["saes"]["other"] = {**cfg["saes"]["topk"], "k": [4], "batch_size": 64}
        for point in ("mlp_in", "mlp_out"):  # two hook points of one layer: one extraction pass, a rule of its own
            cfg["activations"][point] = {**cfg["activations"]["docs"], "layers": [5], "hook": point}

    cfg, targets, plan = _copy_half_built(tmp_path, half_built, other_sae)
    (new_run,) = [r for r, p in plan.runs.items() if p.sae_name == "other"]
    targets.append(str(plan.run(new_run).config_fpath))
    targets += [str(plan.shard(plan.shard_hash[point]).shards_fpath) for point in ("mlp_in", "mlp_out")]
    (pass_key,) = extraction_passes(plan)
    profile = install_profile("PAS1234", tmp_path / "osc", allow_cpu_torch=True)
    paper = tmp_path / "paper"
    (paper / "config").mkdir(parents=True)
    (paper / "Snakefile").write_text(PAPER_SNAKEFILE.format(snakefile=str(SNAKEFILE)))
    write_config(paper / "config", cfg, "paper.yaml")
    in_paper, output = _submit_only(paper, None, profile, targets, snakefile=paper / "Snakefile")
    assert "localrules directive" not in output and "localrule saeflow_create_run:" in output, output[-3000:]
    assert plan.run(new_run).config_fpath.is_file()  # made here, by the local rule
    rules = ("evaluate", "extract", f"extract_pass_{pass_key[:16]}", "extract_part", "extract_seal", "inference",
             "train")  # fmt: skip
    assert sorted(in_paper) == sorted(f"saeflow_{r}" for r in rules)
    assert len(in_paper[f"saeflow_extract_pass_{pass_key[:16]}"]) == 1  # one job for both directories
    (tmp_path / "checkout").mkdir()
    in_checkout, _ = _submit_only(tmp_path / "checkout", write_config(tmp_path, cfg), profile, targets)
    assert {rule: sorted(map(_requests, lines)) for rule, lines in in_checkout.items()} == {
        rule.removeprefix("saeflow_"): sorted(map(_requests, lines)) for rule, lines in in_paper.items()
    }
    by_rule = {rule.removeprefix("saeflow_"): lines[0] for rule, lines in in_paper.items()}
    by_rule["extract_pass"] = by_rule.pop(f"extract_pass_{pass_key[:16]}")  # the extract entry of the table
    for rule, flags in {
        "extract": (" -p gpu ", "--gpus=1", " -t 360 ", " --mem 96000 ", "--cpus-per-task=12"),
        "extract_pass": (" -p gpu ", "--gpus=1", " -t 360 ", " --mem 96000 ", "--cpus-per-task=12"),
        "train": (" -p gpu ", "--gpus=1", " -t 720 ", " --mem-per-cpu 8000 ", "--cpus-per-gpu=12"),
        "inference": (" -p gpu ", "--gpus=1", " -t 120 ", " --mem 48000 ", "--cpus-per-task=12"),
        "evaluate": (" -p gpu ", "--gpus=1", " -t 60 ", " --mem 48000 ", "--cpus-per-task=12"),
        "extract_seal": (" -p cpu ", " -t 120 ", " --mem 8000 "),
    }.items():
        assert all(flag in by_rule[rule] for flag in flags), (rule, by_rule[rule])


@pytest.mark.slow
def test_cpu_devices_under_the_gpu_profile_are_planned_as_cpu_jobs(tmp_path, half_built):
    """`device: cpu` under the OSC profile: the job asks for no GPU and goes to the CPU partition, with the rule's
    cores (per task) and memory, and the plan says so in one line; `auto` (the other activations) keeps the GPU."""
    def on_cpu(cfg):
        cfg["activations"]["one"]["device"] = "cpu"
        cfg.update(train={"device": "cpu"}, inference={"device": "cpu"}, evaluate={"n_tokens": 64, "device": "cpu"})

    cfg, targets, _ = _copy_half_built(tmp_path, half_built, on_cpu)
    profile = install_profile("PAS1234", tmp_path / "osc", allow_cpu_torch=True)
    (tmp_path / "work").mkdir()
    by_rule, output = _submit_only(tmp_path / "work", write_config(tmp_path, cfg), profile, targets)
    assert ("saeflow: device cpu: extract (activation one), train, inference, evaluate planned as CPU jobs (no GPU, "
            "partition cpu)") in output  # fmt: skip
    lines = {rule: lines[0] for rule, lines in by_rule.items()}
    for rule in ("extract", "train", "inference", "evaluate"):
        assert " -p cpu " in lines[rule] and "--gpus" not in lines[rule] and "gpu" not in _requests(lines[rule]), (
            rule, lines[rule])
        assert "--cpus-per-task=12" in lines[rule], lines[rule]
    assert " --mem 96000 " in lines["extract"] and " --mem-per-cpu 8000 " in lines["train"], lines
    assert all(" -p gpu " in line and "--gpus=1" in line for line in by_rule["extract_part"])  # device auto


@pytest.mark.parametrize("cluster", ["cardinal", "ascend", "pitzer"])
def test_install_profile_checks_the_partitions_against_the_clusters_scontrol(tmp_path, monkeypatch, cluster, capsys):
    """On the cluster (here its fake scontrol) install-profile refuses a partition Slurm lacks or a GPU partition
    without GPUs, in one line; a partition named with --gpu-partition reaches every GPU rule."""
    gpus = fixture_gpus(cluster)
    monkeypatch.setenv("PATH", f"{FAKE_SLURM_DPATH}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_CLUSTER", cluster)
    base = ["install-profile", "--account", "PAS1234", "--cluster", cluster, "--allow-cpu-torch"]
    cpu_only = next(p for p, n in gpus.items() if n == 0)
    assert cli.main([*base, "--dest", str(tmp_path / "a"), "--gpu-partition", cpu_only]) == 1
    err = capsys.readouterr().err
    assert f"--gpu-partition {cpu_only}: that partition has no GPUs" in err and len(err.splitlines()) == 1, err
    assert cli.main([*base, "--dest", str(tmp_path / "b"), "--cpu-partition", "nope"]) == 1
    assert "--cpu-partition nope: no such partition on" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with_gpus = next(p for p, n in gpus.items() if n)
    assert cli.main([*base, "--dest", str(tmp_path / "c"), "--gpu-partition", with_gpus]) == 0
    assert f"GPU jobs go to {with_gpus}" in capsys.readouterr().out
    installed = yaml.safe_load((tmp_path / "c" / "config.yaml").read_text())
    # saeflow's table: keyed saeflow/<rule> by saeflow's own rule names (each rule reads its entry: resources.smk).
    resources = {r.removeprefix("saeflow/"): res for r, res in installed["set-resources"].items()}
    assert set(installed["set-resources"]) == {f"saeflow/{r}" for r in resources}
    # Every GPU rule names its GPUs in the profile, but train (its GPUs come from the config: rule_resources).
    assert {r for r, res in resources.items() if res.get("gpu")} == GPU_RULES - {"train"}
    assert {resources[r]["slurm_partition"] for r in GPU_RULES} == {with_gpus}
    assert gpus[resources["extract_seal"]["slurm_partition"]] == 0 and "gpu" not in resources["extract_seal"]
    assert installed["default-resources"]["slurm_partition"] == resources["extract_seal"]["slurm_partition"]
    monkeypatch.setenv("FAKE_SLURM_CLUSTER", next(c for c in CLUSTER_REQUESTS if c != cluster))
    assert cli.main([*base, "--dest", str(tmp_path / "d"), "--gpu-partition", "elsewhere"]) == 0
    assert f"not {cluster}" in capsys.readouterr().out  # another cluster's login node: nothing to check against


def test_install_profile_finds_the_gpus_of_a_real_slurm_without_gpu_accounting(tmp_path, monkeypatch, capsys):
    """tests/fixtures/slurm/real-22.05/ is what a real slurmctld printed (Debian's slurm-wlm 22.05, no accounting;
    regenerate.sh): the GPU partition's TRES lists no gres/gpu, its node's GRES shows gpu:4. install-profile takes it
    for GPU jobs (it refused it: "that partition has no GPUs") and still refuses the CPU-only default."""
    real = SLURM_FIXTURES_DPATH / "real-22.05"
    assert "gres/gpu" not in (real / "scontrol-show-partition.txt").read_text()
    assert "gpu 1 gpu:4" in (real / "sinfo-gres.txt").read_text().splitlines()
    monkeypatch.setenv("PATH", f"{FAKE_SLURM_DPATH}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_CLUSTER", "real-22.05")  # its slurm.conf names the cluster cardinal
    base = ["install-profile", "--account", "PAS1234", "--cluster", "cardinal", "--allow-cpu-torch"]
    assert cli.main([*base, "--dest", str(tmp_path / "a"), "--gpu-partition", "gpu"]) == 0
    assert "on cardinal: GPU jobs go to gpu (4 GPUs), CPU-only jobs to cpu" in capsys.readouterr().out
    assert cli.main([*base, "--dest", str(tmp_path / "b"), "--gpu-partition", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "--gpu-partition cpu: that partition has no GPUs" in err and "with GPUs: gpu" in err, err
    assert fixture_gpus("real-22.05") == {"cpu": 0, "gpu": 4}


def test_node_gpus_reads_sinfos_gres_column():
    """A partition's GPUs from its nodes' GRES: typed GPUs with socket bindings, other GRES, several node groups."""
    from saeflow.commands.workflow import node_gpus

    sinfo = "cpu* 362 (null)\ngpu 2 gpu:h100:4(S:0-1),mps:400\ngpu 3 gpu:a100:2,gpu:v100:1\nbig 1 gpumem:8\n"
    assert node_gpus(sinfo) == {"cpu": 0, "gpu": 17, "big": 0}


class _Resources(dict):
    __getattr__ = dict.__getitem__


@pytest.mark.parametrize("cluster", sorted(CLUSTER_REQUESTS))
def test_train_jobs_ask_slurm_for_the_configs_gpus_per_node(cluster):
    """The sbatch line of a train job for train.gpus x train.nodes, built by the Slurm executor plugin from the rule's
    resources (training.ranks.launch.rule_resources) and the cluster profile's: GPUs per node, one task per GPU on
    several nodes (the plugin's multi-task job, whose shell saeflow's srun starts the ranks from), cores and memory per
    GPU."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    profile = yaml.safe_load((REPO_ROOT / "profiles" / "osc" / "clusters" / f"{cluster}.yaml").read_text())
    train_res = profile["set-resources"]["saeflow/train"]
    params = {"run_uuid": "u", "slurm_logfile": "log", "comment_str": "rule_train", "account": "-A PAS1234",
              "partition": f"-p {train_res['slurm_partition']}", "workdir": "/w"}  # fmt: skip
    lines = {}
    for gpus, nodes in [(1, 1), (4, 1), (4, 2), (1, 3)]:
        resources = _Resources({**profile["default-resources"], **launch.rule_resources({"gpus": gpus, "nodes": nodes}),
                                **train_res, "runtime": 720})  # fmt: skip
        job = type("Job", (), {"resources": resources, "threads": train_res["cpus_per_gpu"]})()
        lines[gpus, nodes] = get_submit_command(job, params) + set_gres_string(job)
    per_gpu = f"--cpus-per-gpu={train_res['cpus_per_gpu']}"
    assert all(per_gpu in line and f"--mem-per-cpu {train_res['mem_mb_per_cpu']}" in line for line in lines.values())
    assert "--gpus=1" in lines[1, 1] and "--nodes" not in lines[1, 1]
    assert "--gpus=4" in lines[4, 1] and "--nodes=1" in lines[4, 1]
    assert "--gres=gpu:4" in lines[4, 2] and "--nodes=2" in lines[4, 2] and "--ntasks-per-node=4" in lines[4, 2]
    assert "--gres=gpu:1" in lines[1, 3] and "--nodes=3" in lines[1, 3] and "--ntasks=3" in lines[1, 3]
    assert "--ntasks-per-gpu=1" in lines[1, 3] and "--gpus=" not in lines[4, 2] + lines[1, 3]


@pytest.mark.slow
def test_a_two_node_training_job_runs_its_ranks_through_srun_in_the_workflow(tmp_path):
    """train.nodes 2: the train job is submitted as 2 nodes x 1 GPU with a task per GPU; inside it, saeflow's srun
    (the fake one starts the 2 tasks here) starts 2 gloo ranks that meet through Slurm's variables and train the
    2-point sweep in sweep mode. The workflow runs until training (what follows is the osc profile test's) and each
    checkpoint is that run trained alone."""
    profile = install_profile("PAS1234", tmp_path / "profile" / "osc", allow_cpu_torch=True)
    cfg = cluster_config()
    cfg["train"] = {"nodes": 2, "parallel": "sweep"}
    config_fpath = write_config(tmp_path, _user_roots(tmp_path, cfg))
    lines_by_rule = _run_through_fake_slurm(tmp_path, profile, config_fpath, "--until", "train")
    (line,) = lines_by_rule["train"]
    for flag in ("--nodes=2", "--gres=gpu:1", "--ntasks=2", "--ntasks-per-gpu=1", "--cpus-per-gpu=12", " -p gpu "):
        assert flag in line, (flag, line)
    (train_log,) = (tmp_path / "logs" / "train").iterdir()
    assert "pass of 2 run(s) on 2 ranks: sweep mode" in train_log.read_text()
    assert sorted(lines_by_rule) == ["extract", "train"], sorted(lines_by_rule)
    for run_dpath in (p.parents[1] for p in (tmp_path / "ess").glob("*/checkpoint/sae.pt")):
        alone = runs.create_run(tmp_path / "alone", json.loads((run_dpath / "checkpoint" / "config.json").read_text()),
                                train_shards=(run_dpath / "links" / "train-shards").resolve(),
                                val_shards=(run_dpath / "links" / "val-shards").resolve())  # fmt: skip
        train.train_runs([alone.root], train.TrainSettings(device="cpu"))
        assert (run_dpath / "checkpoint" / "sae.pt").read_bytes() == alone.sae_fpath.read_bytes()
