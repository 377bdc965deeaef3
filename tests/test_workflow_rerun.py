"""The change matrix: one complete run tree, then one change at a time, each asserting the exact set of jobs
`snakemake -n` plans (docs/workflow.md, "What reruns, and what never does"); a few changes are also run for real,
as root and as an unprivileged user, and leave the expected files.

The tree is built once per module, by a paper repository that uses saeflow as a Snakemake module (a random-init
GPT-2, 16 examples, a 2-point TopK sweep: 8 jobs); config-only
changes dry-run against it in place (a dry run writes only the per-job configs under .snakemake/saeflow/), changes
to files or to the workflow's own text work on copies.
"""

import copy
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from saeflow import config
from saeflow.planning import WorkflowPlan, extraction_passes
from saeflow.store.layout import RunLayout, ShardLayout
from saeflow.training import sweeps
from test_faults_cli import _drop_dac_capabilities
from test_identity import RANDOM_GPT2
from workflow_helpers import PAPER_SNAKEFILE, REPO_ROOT, SNAKEMAKE_TEST_ARGS, env, tree_state, write_config

pytestmark = pytest.mark.slow  # every test here runs Snakemake or the CLI end to end

BASE = {
    "shards_root": "shards",
    "runs_root": "runs",
    "summary_dir": "summary",
    "activations": {"text": copy.deepcopy(RANDOM_GPT2)},  # the pinned tiny GPT-2 (test_identity)
    "saes": {"topk": {"train": "text", "layer": 1, "arch": "topk", "expansion": 2, "k": [4, 8], "aux_k": 8,
                      "batch_size": 64}},
    "visuals": {"n_latents": 2, "top_k": 2},
    "evaluate": {"n_tokens": 32},
}  # fmt: skip


def variant(edit) -> dict:
    cfg = copy.deepcopy(BASE)
    edit(cfg)
    return cfg


def plan_of(cfg: dict) -> WorkflowPlan:
    return WorkflowPlan.from_config(config.validate(copy.deepcopy(cfg)))


def snakemake(workdir, config_fpath, *args, snakefile=REPO_ROOT / "Snakefile", preexec=None, pythonpath=None):
    cmd = [sys.executable, "-m", "snakemake", "-s", str(snakefile), "--directory", str(workdir),
           "--configfile", str(config_fpath), *SNAKEMAKE_TEST_ARGS, *args]  # fmt: skip
    extra = {"PYTHONPATH": str(pythonpath)} if pythonpath else {}
    # cwd: the Snakefile's checkout, as a user runs it (Snakemake finds profiles/default there)
    proc = subprocess.run(cmd, env=env(**extra), capture_output=True, text=True, cwd=snakefile.parent,
                          preexec_fn=preexec)  # fmt: skip
    assert proc.returncode == 0, f"snakemake {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def planned_jobs(output: str) -> set[str]:
    """Every job of a dry run as `rule` or `rule:wildcard values` (sorted by wildcard name, joined by /)."""
    jobs, rule = set(), None
    for line in output.splitlines():
        match = re.fullmatch(r"(?:local)?rule (\w+):", line.strip())
        if match:
            if rule is not None:
                jobs.add(rule)
            rule = match.group(1)
        elif rule is not None and line.strip().startswith("wildcards:"):
            pairs = sorted(p.split("=", 1) for p in line.split(":", 1)[1].strip().split(", "))
            jobs.add(f"{rule}:" + "/".join(value for _, value in pairs))
            rule = None
    if rule is not None:
        jobs.add(rule)
    return jobs


def dry_run(workdir, cfg: dict, *args, **kwargs) -> set[str]:
    fpath = write_config(workdir, cfg, f"case-{hashlib.sha256(repr(cfg).encode()).hexdigest()[:8]}.yaml")
    return planned_jobs(snakemake(workdir, fpath, "-n", *args, **kwargs).stdout)


def new_run_jobs(plan: WorkflowPlan, run_ids) -> set[str]:
    """The jobs of runs not made yet: create_run, inference, evaluate (and the summary, and `all`), and one train
    job per pass: new runs that read identical batches train together, in the job of the smallest run id."""
    jobs, passes = {"summary", "all"}, {}
    for run_id in sorted(run_ids):
        passes.setdefault(plan.runs[run_id].train_config.loader_key(), run_id)
        jobs |= {f"create_run:{run_id}"} | checkpoint_jobs(plan, run_id)
    return jobs | {f"train:{run_id}" for run_id in passes.values()}


def checkpoint_jobs(plan: WorkflowPlan, run_id: str) -> set[str]:
    """What follows a run's sae.pt: its dump (inference + visuals) and its splice evaluation."""
    shard_hash = plan.shard_hash[plan.runs[run_id].val_activation]
    return {f"inference:{run_id}/{shard_hash}", f"evaluate:{run_id}/{shard_hash}"}


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """The complete run tree, built by a paper repository that uses saeflow as a Snakemake module (README, "Use
    saeflow in your paper repository"): its own Snakefile, config, roots and working directory. The change
    matrix then runs saeflow's own Snakefile on the same tree (the rules and paths are the same)."""
    paper = tmp_path_factory.mktemp("paper")
    os.chmod(paper, 0o755)
    (paper / "config").mkdir()
    (paper / "Snakefile").write_text(PAPER_SNAKEFILE.format(snakefile=str(REPO_ROOT / "Snakefile")))
    shutil.copytree(REPO_ROOT / "profiles" / "default", paper / "profiles" / "default")  # saeflow's rerun triggers
    config_fpath = write_config(paper / "config", BASE, "paper.yaml")
    cmd = [sys.executable, "-m", "snakemake", *SNAKEMAKE_TEST_ARGS]
    proc = subprocess.run(cmd, cwd=paper, env=env(PYTHONPATH=str(REPO_ROOT / "workflow")), capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"workdir": paper, "config": config_fpath, "plan": plan_of(BASE), "module_cmd": cmd}


def test_paper_repository_runs_saeflow_as_a_module_end_to_end(tree):
    paper, plan = tree["workdir"], tree["plan"]
    for shard_hash in plan.hash_activation:
        assert ShardLayout.at(paper / "shards", shard_hash).shards_fpath.exists()
    for run_id, shard_hash in plan.dumps():
        run = RunLayout.at(paper / "runs", run_id)
        assert run.sae_fpath.exists() and run.dump(shard_hash).index_fpath.exists()
    assert (paper / "summary" / "summary.csv").exists()
    again = subprocess.run([*tree["module_cmd"], "-n"], cwd=paper, env=env(PYTHONPATH=str(REPO_ROOT / "workflow")),
                           capture_output=True, text=True)  # fmt: skip
    assert "Nothing to be done" in again.stdout + again.stderr


def test_a_no_op_run_is_quiet_about_provenance(tree):
    """Issue 25: every no-op `snakemake -n` said "1 jobs have missing provenance/metadata" (one per sweep point
    trained in another point's job: Snakemake records metadata only for a job's own outputs). A trained run's sae.pt
    is no job's output (the change matrix above shows the reruns still follow it)."""
    paper = tree["workdir"]
    for proc in [snakemake(paper, tree["config"], "-n"),
                 subprocess.run([*tree["module_cmd"], "-n"], cwd=paper, env=env(PYTHONPATH=str(REPO_ROOT / "workflow")),
                                capture_output=True, text=True)]:  # fmt: skip
        output = proc.stdout + proc.stderr
        assert "Nothing to be done" in output and "provenance/metadata" not in output, output[-2000:]


def copy_tree(tree, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(tree["workdir"], dst, symlinks=True)
    return dst


def copy_workflow(dst: pathlib.Path) -> pathlib.Path:
    """A copy of the checkout's workflow (Snakefile, rules, package, profiles) whose text a test may edit."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO_ROOT / "Snakefile", dst / "Snakefile")
    for name in ("workflow", "profiles", "envs"):
        if (REPO_ROOT / name).exists():
            shutil.copytree(REPO_ROOT / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def edit_every_rule(workflow_dpath: pathlib.Path) -> int:
    """Prefix the shell command of every rule with a no-op `: edited;`; returns how many rules were edited."""
    n_edited = 0
    for fpath in sorted((workflow_dpath / "workflow" / "rules").glob("*.smk")):
        text, n = re.subn(r'(\n\s+shell:\s*\n(?:\s*#.*\n)*\s+(?:"""|"))', r"\1: edited; ", fpath.read_text())
        fpath.write_text(text)
        n_edited += n
    return n_edited


# -- dry runs: the exact set of planned jobs -------------------------------------------------------------------


def _k(values):
    return lambda cfg: cfg["saes"]["topk"].__setitem__("k", values)


def _rename_sae(cfg):
    cfg["saes"] = {"renamed": cfg["saes"].pop("topk")}


def _rename_activation(cfg):
    cfg["activations"] = {"words": cfg["activations"].pop("text")}
    cfg["saes"]["topk"]["train"] = "words"


def _extraction(key, value):
    return lambda cfg: cfg["activations"]["text"].__setitem__(key, value)


NAMES_ONLY = {"summary", "all"}  # what a change of names or of the set of runs reruns: the summary shows them


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        pytest.param(lambda cfg: None, set(), id="unchanged"),
        # A config after an upgrade that added keys, spelling them at the values they were introduced at: the tree
        # made before the upgrade is still complete (tests/test_identity.py pins the ids and per-job configs).
        pytest.param(lambda cfg: cfg["saes"]["topk"].update(sweeps.INTRODUCED), set(), id="upgrade-added-keys"),
        pytest.param(_k([8, 4]), set(), id="reorder-sweep"),  # points are named by their values, not their order
        # A key topk does not read, given or swept: the same runs (docs/contracts.md), so nothing reruns
        pytest.param(lambda cfg: cfg["saes"]["topk"].update(l1_coeff=[5.0, 6.0]), set(), id="unread-key"),
        pytest.param(_k([4]), NAMES_ONLY, id="remove-sweep-value"),
        pytest.param(_rename_sae, NAMES_ONLY, id="rename-sae"),
        pytest.param(_rename_activation, set(), id="rename-activation"),
        pytest.param(_extraction("batch_size", 5), set(), id="neutral-extraction-key"),
        pytest.param(lambda cfg: cfg.update(train={"checkpoint_every": 7}), set(), id="train-settings"),
        pytest.param(lambda cfg: cfg["visuals"].update(n_latents=3), "inference", id="visuals-settings"),
        pytest.param(lambda cfg: cfg["evaluate"].update(batch_size=3), "evaluate", id="evaluate-settings"),
        pytest.param(lambda cfg: cfg.update(summary_dir="elsewhere"), {"summary", "all"}, id="moved-summary-dir"),
    ],
)  # fmt: skip
def test_change_reruns_exactly(tree, edit, expected):
    cfg = variant(edit)
    plan = plan_of(cfg)
    if expected in ("inference", "evaluate"):  # a stage's settings: that stage of every run, then the summary
        expected = {"summary", "all"} | {f"{expected}:{r}/{plan.shard_hash['text']}" for r in plan.runs}
    assert dry_run(tree["workdir"], cfg) == expected


@pytest.mark.parametrize("k", [[4, 16], [4, 8, 16]], ids=["change-hyperparameter", "add-sweep-value"])
def test_new_sweep_point_makes_one_new_run(tree, k):
    cfg = variant(_k(k))
    plan = plan_of(cfg)
    (new_run,) = set(plan.runs) - set(tree["plan"].runs)
    assert dry_run(tree["workdir"], cfg) == new_run_jobs(plan, [new_run])


def test_bytes_changing_extraction_key_makes_a_new_shard_dir_and_new_runs(tree):
    cfg = variant(_extraction("context_length", 12))
    plan = plan_of(cfg)
    (shard_hash,) = plan.shard_hash.values()
    assert shard_hash not in tree["plan"].hash_activation
    assert dry_run(tree["workdir"], cfg) == {f"extract:{shard_hash}"} | new_run_jobs(plan, plan.runs)


def test_new_hyperparameter_key_is_a_new_run(tree):
    cfg = variant(lambda c: c["saes"]["topk"].update(lr=0.002))
    plan = plan_of(cfg)
    assert not set(plan.runs) & set(tree["plan"].runs)
    assert dry_run(tree["workdir"], cfg) == new_run_jobs(plan, plan.runs)


def _add_hooks(*points):
    """Activations that differ from `text` only in their hook point (extraction/hooks.py), each with an SAE on it."""

    def edit(cfg):
        for point in points:
            cfg["activations"][f"text_{point}"] = {**cfg["activations"]["text"], "hook": point}
            cfg["saes"][f"on_{point}"] = {**cfg["saes"]["topk"], "train": f"text_{point}", "k": 4}

    return edit


def pass_outputs(output: str) -> dict[str, set[str]]:
    """Each extraction pass job of a dry run -> the shard hashes it outputs."""
    jobs = re.findall(r"rule (extract_pass_\w+):\n(?:\s+\w+: .*\n)*?\s+output: (.*)\n", output)
    return {rule: set(re.findall(r"([0-9a-f]{64})/shards\.json", outputs)) for rule, outputs in jobs}


def hook_jobs(plan: WorkflowPlan, before: WorkflowPlan, points) -> tuple[str, set[str]]:
    """The extraction pass's rule and the jobs adding these hook points plans: the pass, then the new runs (each
    evaluated at its hook point, as a run on the residual stream is)."""
    (key,) = extraction_passes(plan)
    new_runs = set(plan.runs) - set(before.runs)
    return f"extract_pass_{key[:16]}", {f"extract_pass_{key[:16]}"} | new_run_jobs(plan, new_runs)


@pytest.mark.parametrize("points", [("mlp_out",), ("mlp_out", "mlp_in")], ids=["one", "two"])
def test_adding_a_hook_extracts_only_that_hook(tree, points):
    """One job extracts the new hook points from one forward pass; the published residual directory of the same
    model, dataset and layers is no output of it (saeflow reuses it, never rewrites it)."""
    cfg = variant(_add_hooks(*points))
    plan = plan_of(cfg)
    rule, expected = hook_jobs(plan, tree["plan"], points)
    fpath = write_config(tree["workdir"], cfg, f"hooks-{len(points)}.yaml")
    output = snakemake(tree["workdir"], fpath, "-n").stdout
    assert planned_jobs(output) == expected
    assert pass_outputs(output) == {rule: {plan.shard_hash[f"text_{p}"] for p in points}}


def test_a_pass_job_publishes_its_new_directories_and_leaves_the_published_one_alone(tree, tmp_path):
    workdir, points = copy_tree(tree, tmp_path / "w"), ("mlp_out", "mlp_in")
    cfg = variant(_add_hooks(*points))
    plan = plan_of(cfg)
    published = ShardLayout.at(workdir / "shards", tree["plan"].shard_hash["text"]).dpath
    before = tree_state(published)
    new = [ShardLayout.at(pathlib.Path("shards"), plan.shard_hash[f"text_{p}"]).shards_fpath for p in points]
    fpath = write_config(workdir, cfg, "hooks.yaml")
    proc = snakemake(workdir, fpath, *map(str, new), preexec=_as("unprivileged"))  # as the config names them
    assert "1 of 1 steps (100%) done" in proc.stdout + proc.stderr  # one job for both
    assert all((workdir / f).exists() for f in new) and tree_state(published) == before
    assert "Nothing to be done" in snakemake(workdir, fpath, *map(str, new), "-n").stdout


def test_the_workflow_evaluates_a_run_on_mlp_out_spliced_at_the_mlp_output(tree, tmp_path):
    """The evaluate rule of a run trained on mlp_out: extraction pass, create_run, train, evaluate, and the
    evaluation says it spliced the MLP output of the run's layer (the splice itself: tests/test_splice.py)."""
    workdir = copy_tree(tree, tmp_path / "w")
    cfg = variant(_add_hooks("mlp_out"))
    plan = plan_of(cfg)
    shard_hash = plan.shard_hash["text_mlp_out"]
    (run_id,) = [r for r in plan.runs if plan.runs[r].sae_name == "on_mlp_out"]
    target = RunLayout.at(pathlib.Path("runs"), run_id).evaluation_fpath(shard_hash)
    fpath = write_config(workdir, cfg, "mlp.yaml")
    (key,) = extraction_passes(plan)
    assert planned_jobs(snakemake(workdir, fpath, str(target), "-n").stdout) == {
        f"extract_pass_{key[:16]}", f"create_run:{run_id}", f"train:{run_id}", f"evaluate:{run_id}/{shard_hash}"}
    snakemake(workdir, fpath, str(target), preexec=_as("unprivileged"))
    result = json.loads((workdir / target).read_text())
    layer = plan.runs[run_id].train_config.layer
    assert result["config"]["hook"] == "mlp_out" and result["config"]["layer"] == layer == 1
    assert result["config"]["splice"]["write"] == {"hook": "mlp_out", "layer": layer}
    assert result["metrics"]["n_scored_spliced"] > 0 and result["metrics"]["ce_clean"] > 0


def test_a_split_activation_with_two_hook_points_extracts_each_part_of_both_in_one_job(tmp_path):
    """`parts: 2`: a job per part writes that part of both directories from one forward pass; each directory's own
    seal publishes it."""

    def split(cfg):
        cfg["activations"]["text"].update(parts=2, patches_per_shard=64)  # 4 examples a shard: 4 shards, 2 parts
        _add_hooks("mlp_out")(cfg)

    cfg = variant(split)
    plan = plan_of(cfg)
    (key,) = extraction_passes(plan)
    hashes = [plan.shard_hash["text"], plan.shard_hash["text_mlp_out"]]
    extraction = {f"extract_pass_part_{key[:16]}:{i}" for i in (0, 1)} | {f"extract_seal:{h}" for h in hashes}
    jobs = dry_run(tmp_path, cfg)
    assert {j for j in jobs if j.startswith("extract")} == extraction
    targets = [str(ShardLayout.at(pathlib.Path("shards"), h).shards_fpath) for h in hashes]
    snakemake(tmp_path, write_config(tmp_path, cfg, "split.yaml"), *targets)
    for shard_hash in hashes:
        assert ShardLayout.at(tmp_path / "shards", shard_hash).shards_fpath.exists()
        assert not (tmp_path / "shards" / f".{shard_hash}.parts").exists()


def test_moved_shards_root_reextracts_nothing_for_complete_runs(tree, tmp_path):
    assert dry_run(tree["workdir"], variant(lambda c: c.update(shards_root=str(tmp_path / "new-scratch")))) == set()


def test_moved_runs_root_reruns_every_run_but_extracts_nothing(tree, tmp_path):
    cfg = variant(lambda c: c.update(runs_root=str(tmp_path / "new-runs")))
    plan = plan_of(cfg)
    assert dry_run(tree["workdir"], cfg) == new_run_jobs(plan, plan.runs)


def test_purged_shard_dir_is_extracted_only_for_a_job_that_needs_it(tree, tmp_path):
    workdir, plan = copy_tree(tree, tmp_path / "w"), tree["plan"]
    (shard_hash,) = plan.hash_activation
    shutil.rmtree(ShardLayout.at(workdir / "shards", shard_hash).dpath)  # root: a read-only tree is no obstacle
    assert dry_run(workdir, BASE) == set(), "complete runs were touched"
    run_id = sorted(plan.runs)[0]
    dump = RunLayout.at(workdir / "runs", run_id).dump(shard_hash)
    shutil.rmtree(dump.dpath)  # a job that reads the shard bytes again
    assert dry_run(workdir, BASE) == {f"extract:{shard_hash}", f"inference:{run_id}/{shard_hash}", "summary", "all"}


def test_purged_file_reruns_its_job_and_what_follows(tree, tmp_path):
    workdir, plan = copy_tree(tree, tmp_path / "w"), tree["plan"]
    (shard_hash,) = plan.hash_activation
    run_id = sorted(plan.runs)[0]
    (workdir / "summary" / "pareto.png").unlink()
    assert dry_run(workdir, BASE) == {"summary", "all"}
    sae_fpath = RunLayout.at(workdir / "runs", run_id).sae_fpath
    sae_fpath.unlink()
    assert dry_run(workdir, BASE) == {f"train:{run_id}", "summary", "all"} | checkpoint_jobs(plan, run_id)


# -- real runs, as root and as an unprivileged user --------------------------------------------------------------


def _as(user: str):
    """Unprivileged: root without the capabilities that bypass file permissions (which then bind it like any
    user: a read-only published directory stays read-only), so the root-owned tree needs no chown."""
    if user == "root":
        if os.geteuid() != 0:
            pytest.skip("not root")
        return None
    return _drop_dac_capabilities if os.geteuid() == 0 else None


@pytest.mark.parametrize("user", ["root", "unprivileged"])
def test_rule_text_and_code_edits_rerun_nothing_and_delete_nothing(tree, tmp_path, user):
    """Issue 12: an edited `extract` command made Snakemake (as root) delete a published shards.json."""
    preexec = _as(user)
    workdir = copy_tree(tree, tmp_path / "w")
    wf = copy_workflow(tmp_path / "wf")
    assert edit_every_rule(wf) >= 5
    (wf / "workflow" / "saeflow" / "training" / "sae.py").open("a").write("\n# an edit of saeflow's code\n")
    before = tree_state(workdir / "shards") | tree_state(workdir / "runs")
    proc = snakemake(workdir, tree["config"], snakefile=wf / "Snakefile", preexec=preexec, pythonpath=wf / "workflow")
    assert "Nothing to be done" in proc.stdout + proc.stderr
    assert tree_state(workdir / "shards") | tree_state(workdir / "runs") == before


@pytest.mark.parametrize("user", ["unprivileged"])  # the stricter case; root passes the same test
def test_changed_checkpoint_rebuilds_its_dump_in_one_call(tree, tmp_path, user):
    """A dump records the sha256 of its sae.pt; a new sae.pt reruns the dump, its visuals and the summary."""
    preexec = _as(user)
    workdir, plan = copy_tree(tree, tmp_path / "w"), tree["plan"]
    (shard_hash,) = plan.hash_activation
    run_a, run_b = (RunLayout.at(workdir / "runs", r) for r in sorted(plan.runs))
    run_a.sae_fpath.chmod(0o644)
    shutil.copyfile(run_b.sae_fpath, run_a.sae_fpath)  # a retrained checkpoint, as far as the dump can tell
    new_sha256 = hashlib.sha256(run_a.sae_fpath.read_bytes()).hexdigest()
    assert dry_run(workdir, BASE) == {"summary", "all"} | checkpoint_jobs(plan, run_a.root.name)
    summary_mtime = (workdir / "summary" / "summary.csv").stat().st_mtime
    snakemake(workdir, tree["config"], preexec=preexec)
    dump = run_a.dump(shard_hash)
    assert json.loads(dump.config_fpath.read_text())["sae_sha256"] == new_sha256
    assert dump.index_fpath.exists() and (workdir / "summary" / "summary.csv").stat().st_mtime > summary_mtime
    assert not [p.name for p in dump.dpath.parent.iterdir() if p.name.startswith(f".{shard_hash}.old")]
    assert "Nothing to be done" in snakemake(workdir, tree["config"], "-n").stdout



# -- which config runs ---------------------------------------------------------------------------------------------


def test_configfile_is_the_whole_config_and_a_bad_one_is_named_on_one_line(tmp_path):
    """The default config/config.yaml never leaks into a --configfile run; a repeated key names the file."""
    plan = plan_of(BASE)
    (shard_hash,) = plan.hash_activation
    expected = {f"extract:{shard_hash}"} | new_run_jobs(plan, plan.runs)
    assert dry_run(tmp_path, BASE) == expected
    bad = tmp_path / "bad.yaml"
    bad.write_text("shards_root: a\nruns_root: b\nshards_root: c\nactivations: {}\nsaes: {}\n")
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO_ROOT / "Snakefile"), "--directory",
                           str(tmp_path), "--configfile", str(bad), "-n"], env=env(), capture_output=True, text=True,
                          cwd=REPO_ROOT)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"saeflow: config file {bad}: not valid YAML: line 3, column 1: found duplicate key 'shards_root' "
        "(first given on line 1)"
    )


def test_plain_snakemake_in_a_fresh_clone_links_the_default_model(tmp_path):
    clone = copy_workflow(tmp_path / "clone")
    shutil.copytree(REPO_ROOT / "config", clone / "config")
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--quiet"], cwd=clone, env=env(),
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    link = clone / "results" / "models" / "all-MiniLM-L6-v2"
    assert link.is_symlink() and (link / "config.json").exists()


# --- a transcoder's row: a tree with a transcoder (mlp_in -> mlp_out of the same pass) beside the TopK sweep ---------

def _with_transcoder(target: str):
    def edit(cfg):
        for point in ("mlp_in", "mlp_out"):
            cfg["activations"][f"text_{point}"] = {**cfg["activations"]["text"], "hook": point}
        cfg["saes"]["tc"] = {"train": "text_mlp_in", "target": target, "layer": 1, "arch": "topk", "expansion": 2,
                             "k": 4, "aux_k": 8, "batch_size": 64}  # fmt: skip

    return edit


@pytest.fixture(scope="module")
def tc_tree(tmp_path_factory):
    """The complete tree of BASE plus a transcoder, built by saeflow's own Snakefile."""
    workdir = tmp_path_factory.mktemp("tc")
    cfg = variant(_with_transcoder("text_mlp_out"))
    snakemake(workdir, write_config(workdir, cfg, "tc.yaml"))
    return {"workdir": workdir, "plan": plan_of(cfg)}


def test_adding_a_layer_to_three_hook_specs_extracts_only_that_layer_in_one_pass(tc_tree):
    """Issue 40: the three hook specs of one model and dataset (residual, mlp_in, mlp_out) get layer 0 besides 1:
    nothing is planned for the finished tree (no run id moves), and asking for every directory plans one pass job
    whose outputs are the three new layer-0 directories alone."""
    before = tc_tree["plan"]

    def add_layer(cfg):
        _with_transcoder("text_mlp_out")(cfg)
        for spec in cfg["activations"].values():
            spec["layers"] = [0, 1]

    cfg = variant(add_layer)
    plan = plan_of(cfg)
    assert sorted(plan.runs) == sorted(before.runs)
    assert dry_run(tc_tree["workdir"], cfg) == set()
    new = {plan.layer_hash[name][0] for name in cfg["activations"]}
    targets = [str(plan.shard(h).shards_fpath) for hashes in plan.layer_hash.values() for h in hashes.values()]
    fpath = write_config(tc_tree["workdir"], cfg, "layers.yaml")
    output = snakemake(tc_tree["workdir"], fpath, "-n", *targets).stdout
    ((rule, outputs),) = pass_outputs(output).items()
    assert outputs == new and planned_jobs(output) == {rule}


def test_changing_a_transcoders_target_retrains_only_that_transcoder(tc_tree):
    """The target's shard hash is in the transcoder's run config: another target is a new run (create_run, train,
    inference, evaluate: spliced in place of what it predicts), nothing is extracted (the residual directory is
    published), and the TopK runs are untouched."""
    before = tc_tree["plan"]
    (old_tc,) = [r for r, p in before.runs.items() if p.sae_name == "tc"]
    assert dry_run(tc_tree["workdir"], variant(_with_transcoder("text_mlp_out"))) == set()
    cfg = variant(_with_transcoder("text"))
    plan = plan_of(cfg)
    (new_tc,) = set(plan.runs) - set(before.runs)
    assert plan.runs[new_tc].sae_name == "tc" and old_tc not in plan.runs
    assert set(plan.runs) - {new_tc} == set(before.runs) - {old_tc}
    shard_hash = plan.shard_hash["text_mlp_in"]
    assert dry_run(tc_tree["workdir"], cfg) == {f"create_run:{new_tc}", f"train:{new_tc}",
                                                f"inference:{new_tc}/{shard_hash}", f"evaluate:{new_tc}/{shard_hash}",
                                                "summary", "all"}  # fmt: skip
