"""The Snakemake workflow, run for real on a tiny config: what reruns, what never does, and what survives a kill.

One prepared run (extract -> 2 SAE runs -> inference + visuals -> summary) is shared by the assertions; tests that
change the config either dry-run against it or write into their own roots, and leave it as they found it.
"""

import csv
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import time

import pytest
import yaml

from builders import typed
from hang import HANG_SEC
from saeflow import cli, config
from saeflow.analysis import report
from saeflow.extraction.extract import plan_activation
from saeflow.planning import WorkflowPlan
from saeflow.store import shards
from saeflow.store.layout import RunLayout, ShardLayout
from saeflow.training.sweeps import SAESpec, plan_runs
from workflow_helpers import (
    REPO_ROOT,
    env,
    job_counts,
    snakemake,
    snakemake_cmd,
    tiny_config,
    tree_state,
    write_config,
)


def run_plans(cfg: dict, shard_hash: str):
    """What the workflow plans: runs of the config with the schema's defaults filled in (`tokens: auto` is
    no_special for the MiniLM text shards)."""
    saes = config.validate(json.loads(json.dumps(cfg)))["saes"]
    specs = {name: SAESpec.from_dict(name, obj) for name, obj in saes.items()}
    return plan_runs(specs, {"docs": shard_hash}, {"docs": "no_special"})


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("workflow")
    cfg = tiny_config()
    config_fpath = write_config(workdir, cfg)
    snakemake(workdir, config_fpath)
    shard_hash = plan_activation(typed(cfg["activations"]["docs"])).hash
    run_ids = [plan.run_id for plan in run_plans(cfg, shard_hash)]
    return {"workdir": workdir, "cfg": cfg, "config": config_fpath, "hash": shard_hash, "run_ids": run_ids}


@pytest.mark.slow
def test_default_run_publishes_every_stage(prepared):
    workdir, published = prepared["workdir"], ShardLayout.at(prepared["workdir"] / "shards", prepared["hash"])
    shard_dpath = published.dpath
    assert shards.validate(shard_dpath).ok
    assert not os.access(published.shard_fpath(0), os.W_OK) or os.geteuid() == 0
    assert not published.shard_fpath(0).stat().st_mode & 0o222, "published shards must be read-only"
    assert len(prepared["run_ids"]) == 2
    for run_id in prepared["run_ids"]:
        run = RunLayout.at(workdir / "runs", run_id)
        assert run.sae_fpath.is_file()
        assert run.link(run.TRAIN_SHARDS).resolve() == shard_dpath.resolve()
        dump = run.dump(prepared["hash"])
        assert json.loads(dump.metrics_fpath.read_text())["l0"] > 0
        assert dump.index_fpath.is_file() and dump.plot_fpath("l0_hist").is_file()
    summary_csv = (workdir / "summary" / "summary.csv").read_text().splitlines()
    assert len(summary_csv) == 1 + 2 and summary_csv[0].startswith("name,run_id,shard_hash,")
    # Every run is spliced into MiniLM on its validation activations, and the summary carries the score.
    rows = list(csv.DictReader(summary_csv))
    assert all(0 < float(row["eval.pooled_cos_recovered"]) <= 1 for row in rows), rows
    assert (workdir / "summary" / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Nothing stray in the published directories: no Snakemake timestamp files, no staging leftovers.
    assert not list((workdir / "shards").glob(".*.partial")) and not list(workdir.rglob(".snakemake_timestamp"))


@pytest.mark.slow
def test_unchanged_config_has_nothing_to_do(prepared):
    proc = snakemake(prepared["workdir"], prepared["config"], "-n")
    assert "Nothing to be done" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_report_embeds_the_summary_and_visuals(prepared):
    report_fpath = prepared["workdir"] / "report.html"
    snakemake(prepared["workdir"], prepared["config"], "--report", str(report_fpath))
    html = report_fpath.read_text(encoding="utf-8", errors="replace")
    pages = [report.page_fname(page) for page in report.PAGES]  # a page per metric, each with its caption
    for name in ("summary.csv", "pareto.png", "l0_hist.png", "freq_vs_mean.png", report.GROUPED_FNAME, *pages):
        assert name in html, name
    for caption in ("Normalized MSE", "splice score", "k-sparse probes", "decoder directions"):
        assert caption in html, caption


@pytest.mark.slow
def test_code_edit_and_fresh_mtimes_rerun_nothing(prepared, tmp_path):
    """An edited saeflow package (first on PYTHONPATH) and freshly touched shard files change no decision."""
    pkg_copy = tmp_path / "pkg" / "saeflow"
    shutil.copytree(REPO_ROOT / "workflow" / "saeflow", pkg_copy)
    for module in ("extraction/extract.py", "training/train.py", "store/shards/writer.py"):
        with open(pkg_copy / module, "a", encoding="utf-8") as fd:
            fd.write("\n# an edit to saeflow's code\n")
    shard_dpath = prepared["workdir"] / "shards" / prepared["hash"]
    for fpath in shard_dpath.iterdir():
        os.utime(fpath)  # newer than every run output
    proc = snakemake(prepared["workdir"], prepared["config"], "-n", PYTHONPATH=str(pkg_copy.parent))
    assert "Nothing to be done" in proc.stdout + proc.stderr, proc.stdout


@pytest.mark.slow
def test_changing_one_hyperparameter_reruns_only_that_run(prepared, tmp_path):
    cfg = tiny_config(k=(4, 12))  # the second point of the sweep changes
    proc = snakemake(prepared["workdir"], write_config(tmp_path, cfg), "-n")
    counts = job_counts(proc.stdout)
    assert counts == {"create_run": 1, "train": 1, "inference": 1, "evaluate": 1, "summary": 1, "all": 1}, proc.stdout
    new_run = run_plans(cfg, prepared["hash"])[1].run_id
    assert new_run not in prepared["run_ids"] and new_run in proc.stdout
    kept_run = prepared["run_ids"][0]
    assert f"runs/{kept_run}/checkpoint/sae.pt" not in proc.stdout.split("rule all:")[0].replace("input: ", "")


@pytest.mark.slow
def test_layer_change_makes_a_new_shard_dir_and_keeps_the_old(prepared, tmp_path):
    workdir, old_dpath = prepared["workdir"], prepared["workdir"] / "shards" / prepared["hash"]
    before = tree_state(old_dpath)
    cfg = tiny_config(layer=2)
    new_hash = plan_activation(typed(cfg["activations"]["docs"])).hash
    assert new_hash != prepared["hash"]
    snakemake(workdir, write_config(tmp_path, cfg), f"shards/{new_hash}/shards.json")  # the target, relative
    assert shards.validate(workdir / "shards" / new_hash).ok
    assert tree_state(old_dpath) == before, "the old shard directory was touched"
    assert all(not mode & 0o222 for mode, _, _ in before.values()), "the old shard directory must stay read-only"


@pytest.mark.slow
def test_adding_a_layer_extracts_only_that_layer_and_retrains_nothing(prepared, tmp_path):
    """Issue 40: `layers: [1]` -> `[1, 3]` (and then back) on the finished default-workflow tree. A directory per
    layer: layer 1's is the published one, every run id stays, the dry run plans nothing; asking for every
    directory of the spec plans the new layer's extraction alone. Removing the layer again plans nothing."""
    workdir = prepared["workdir"]
    cfg = tiny_config()
    cfg["activations"]["docs"]["layers"] = [1, 3]
    plan = WorkflowPlan.from_config(config.validate(json.loads(json.dumps(cfg))))
    assert plan.layer_hash["docs"][1] == prepared["hash"] and sorted(plan.runs) == sorted(prepared["run_ids"])
    config_fpath = write_config(tmp_path, cfg)
    assert "Nothing to be done" in snakemake(workdir, config_fpath, "-n").stdout
    targets = [f"shards/{shard_hash}/shards.json" for shard_hash in plan.layer_hash["docs"].values()]
    proc = snakemake(workdir, config_fpath, "-n", *targets)
    ((rule, n_jobs),) = job_counts(proc.stdout).items()  # one job: the pass of the spec's layers, layer 1 reused
    outputs = re.findall(r"output: (.*)", proc.stdout)
    assert rule.startswith("extract_pass_") and n_jobs == 1, proc.stdout
    assert outputs == [str(plan.shard(plan.layer_hash["docs"][3]).shards_fpath)], proc.stdout
    assert "Nothing to be done" in snakemake(workdir, write_config(tmp_path, tiny_config(), "back.yaml"), "-n").stdout


@pytest.mark.slow
def test_identical_activation_specs_share_one_shard_dir(prepared, tmp_path):
    cfg = tiny_config()
    cfg["activations"]["docs-copy"] = json.loads(json.dumps(cfg["activations"]["docs"]))
    cfg["saes"]["copy"] = {**cfg["saes"]["topk"], "train": "docs-copy", "k": 6}
    cfg["shards_root"] = str(tmp_path / "fresh-shards")
    proc = snakemake(prepared["workdir"], write_config(tmp_path, cfg), "-n")
    counts = job_counts(proc.stdout)
    assert counts["extract"] == 1, proc.stdout
    # Run ids name shard hashes, not roots: only the new `copy` run is made; the two complete runs are not touched.
    assert counts["train"] == 1 and counts["create_run"] == 1, proc.stdout


@pytest.mark.slow
def test_purged_shard_dir_is_reported_and_not_rebuilt(prepared):
    workdir, published = prepared["workdir"], ShardLayout.at(prepared["workdir"] / "shards", prepared["hash"])
    shard_dpath = published.dpath
    aside = workdir / "purged"
    shard_dpath.rename(aside)
    try:
        proc = snakemake(workdir, prepared["config"], "-n")
        out = proc.stdout + proc.stderr
        assert f"shard directory shards/{prepared['hash']} (activation 'docs') is missing" in out
        assert "Nothing to be done" in out
        # A new run that needs the shards rebuilds them; finished runs are left alone.
        cfg = tiny_config(k=(4, 8, 16))
        counts = job_counts(snakemake(workdir, write_config(workdir, cfg, "more.yaml"), "-n").stdout)
        assert counts["extract"] == 1 and counts["train"] == 1 and counts["inference"] == 1
    finally:
        aside.rename(shard_dpath)


@pytest.mark.slow
def test_a_damaged_published_shard_dir_a_job_needs_stops_snakemake_before_any_job_runs(tmp_path):
    """An acts file of a published shard directory deleted (a scratch purge removes files one by one) while runs
    still have to read it: `snakemake` stops at once with one line naming the directory, the file and what to do,
    and runs no job."""
    from saeflow.extraction import extract

    cfg = tiny_config(k=(4,))
    config_fpath = write_config(tmp_path, cfg)
    published = extract.extract(typed(cfg["activations"]["docs"]), tmp_path / "shards", progress=False).dpath
    published.chmod(0o755)  # published directories are read-only: the purge is as good as root
    ShardLayout(published).shard_fpath(0).unlink()
    before = tree_state(published)
    proc = snakemake(tmp_path, config_fpath, check=False)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    acts = f"shards/{published.name}/acts000000.bin"
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("Using workflow specific profile")]
    assert lines == [
        f"saeflow: shard directory shards/{published.name} (activation 'docs') is damaged and a job needs it: {acts}: "
        f"missing. Remove it to extract it again (chmod -R u+w shards/{published.name} && rm -rf "
        f"shards/{published.name}; runs trained on it are kept), or see every problem with `saeflow validate --deep "
        f"shards/{published.name}`"
    ], proc.stderr
    assert not (tmp_path / "logs").exists() and not (tmp_path / "runs").exists(), "a job ran"
    assert tree_state(published) == before


def completed_shards(staging: pathlib.Path) -> int:
    """Shards the extraction has made durable in its staging directory (0 while there is none)."""
    try:
        return len(json.loads((staging / "progress.json").read_text())["completed"])
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.slow
def test_killed_extraction_publishes_nothing_and_the_next_run_completes(tmp_path):
    cfg = tiny_config(n_ex=320, patches_per_shard=16 * 32)  # 10 small shards: a slow enough, resumable job
    cfg["saes"] = {}
    config_fpath = write_config(tmp_path, cfg)
    shard_hash = plan_activation(typed(cfg["activations"]["docs"])).hash
    final_dpath, staging = tmp_path / "shards" / shard_hash, tmp_path / "shards" / f".{shard_hash}.partial"
    target = f"shards/{shard_hash}/shards.json"
    proc = subprocess.Popen(
        snakemake_cmd(tmp_path, config_fpath, target), env=env(), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + HANG_SEC
        while not completed_shards(staging):
            assert proc.poll() is None, "the extraction finished before it could be killed"
            assert time.monotonic() < deadline, "no shard was ever written"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not final_dpath.exists() or not any(final_dpath.iterdir()), "a partial directory was published"
    snakemake(tmp_path, config_fpath, "--unlock")  # the killed Snakemake left its lock, as after any SIGKILL
    snakemake(tmp_path, config_fpath, target)
    assert shards.validate(final_dpath, deep=True).ok
    assert json.loads(ShardLayout(final_dpath).provenance_fpath.read_text())["resumed_from_ex"] > 0


@pytest.mark.slow
def test_malformed_config_fails_validation_naming_the_key(prepared, tmp_path):
    cfg = tiny_config()
    cfg["saes"]["topk"]["expansion"] = "wide"
    proc = snakemake(prepared["workdir"], write_config(tmp_path, cfg), "-n", check=False)
    assert proc.returncode != 0
    err = proc.stdout + proc.stderr
    assert "expansion" in err and "'wide'" in err, err


def test_a_mistyped_config_key_stops_snakemake_with_one_line_naming_the_file_and_key(tmp_path):
    """Issue 25: Snakemake's own `validate` printed the whole schema (~435 lines) for one typo, the key's place only
    near the end; saeflow's validator runs first and says it in one line, as `saeflow plan` does, with the key it
    nearly spells (issue 33)."""
    cfg = tiny_config()
    cfg["saes"]["topk"]["expanson"] = cfg["saes"]["topk"].pop("expansion")
    config_fpath = write_config(tmp_path, cfg)
    proc = snakemake(tmp_path, config_fpath, "-n", check=False)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("Using workflow specific profile")]
    assert lines == [
        f"saeflow: config file {config_fpath}: config does not match the schema: saes.topk.expanson: unknown key "
        "'expanson'; did you mean 'expansion'?"
    ], proc.stderr
    assert "Failed validating" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_unknown_activation_name_is_a_clear_error(prepared, tmp_path):
    cfg = tiny_config()
    cfg["saes"]["topk"]["train"] = "nope"
    proc = snakemake(prepared["workdir"], write_config(tmp_path, cfg), "-n", check=False)
    assert proc.returncode != 0
    assert "saes.topk: activation 'nope' is not defined" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_lint_and_format_are_clean():
    lint = subprocess.run(
        [os.path.join(os.path.dirname(os.sys.executable), "snakemake"), "--lint", "-s", str(REPO_ROOT / "Snakefile")],
        cwd=REPO_ROOT, env=env(), capture_output=True, text=True,
    )  # fmt: skip
    assert lint.returncode == 0 and "Lints for" not in lint.stdout + lint.stderr, lint.stdout + lint.stderr
    smk_files = [str(REPO_ROOT / "Snakefile"), *map(str, sorted((REPO_ROOT / "workflow" / "rules").glob("*.smk")))]
    fmt = subprocess.run(
        [os.path.join(os.path.dirname(os.sys.executable), "snakefmt"), "--check", "--no-format-shell", *smk_files],
        env=env(), capture_output=True, text=True,
    )  # fmt: skip
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_default_and_example_configs_validate():
    for example in sorted((REPO_ROOT / "config" / "examples").glob("*.yaml")):
        config.validate(yaml.safe_load(example.read_text()))
    cfg = config.validate(yaml.safe_load((REPO_ROOT / "config" / "config.yaml").read_text()))
    assert len(cfg["saes"]) >= 1 and any(
        isinstance(v, list) for spec in cfg["saes"].values() for v in spec.values()
    ), "the default config must hold a sweep"


def test_the_example_configs_headers_give_commands_saeflow_accepts():
    """Issue 33: clip-imagenet-osc.yaml's header gave `install-profile` without its required --cluster."""
    parser = cli.build_parser()
    commands = [line.split("saeflow ", 1)[1].split()
                for fpath in sorted((REPO_ROOT / "config" / "examples").glob("*.yaml"))
                for line in fpath.read_text().splitlines() if line.startswith("#   saeflow ")]  # fmt: skip
    assert ["install-profile", "--account", "PAS1234", "--cluster", "cardinal"] == commands[0][:5], commands
    for argv in commands:
        parser.parse_args(argv)  # argparse exits on a missing required option


@pytest.mark.slow
def test_moving_the_shards_root_reextracts_and_retrains_nothing(prepared, tmp_path):
    """A new shards_root (e.g. a new scratch): complete runs need no shard bytes, so nothing is extracted there
    and no run is touched (issue 12); a new run would extract its shard directory under the same hash name."""
    workdir = prepared["workdir"]
    runs = {r: RunLayout.at(workdir / "runs", r) for r in prepared["run_ids"]}
    before = tree_state(workdir / "runs")
    new_root = tmp_path / "new-scratch"
    proc = snakemake(workdir, prepared["config"], "--config", f"shards_root={new_root}")
    assert "Nothing to be done" in proc.stdout + proc.stderr
    assert not (new_root / prepared["hash"]).exists()
    assert tree_state(workdir / "runs") == before and all(run.sae_fpath.exists() for run in runs.values())
