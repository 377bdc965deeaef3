# Every Python helper of the workflow: config -> activation specs -> shard hashes -> run plans -> paths.
# Runs at parse time (also inside every Slurm job), so it only plans: no model weights, no data pass.
import getpass
import os
import pathlib
import sys

from snakemake.logging import logger
from snakemake.settings.types import DeploymentMethod

from saeflow import atomic, hashing
from saeflow.errors import SaeflowError
from saeflow.extract import plan_activation
from saeflow.train import plan_runs


def expand_path(value, key=None):
    """Config paths may use $USER, $SAEV_SCRATCH or ~ (the OSC profile does); an unset variable is an error."""
    # USER is unset in some batch and container shells.
    os.environ.setdefault("USER", getpass.getuser())
    expanded = os.path.expanduser(os.path.expandvars(value))
    if "$" in expanded:
        raise WorkflowError(
            f"config key {key or value}: {value!r} names an environment variable that is not set"
        )
    return pathlib.Path(expanded)


# The rules call `saeflow`: here a shell function for the interpreter running Snakemake (its venv need not be on
# PATH), or, with --software-deployment-method conda, for the env's python with this checkout's package on
# PYTHONPATH (envs/saeflow.yaml). Being a shell prefix, it is no part of any rule's code or params.
if DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method:
    shell.prefix(
        f"set -euo pipefail; export PYTHONPATH={workflow.basedir}/workflow${{{{PYTHONPATH:+:$PYTHONPATH}}}}; "
        'saeflow() {{ python -m saeflow "$@"; }}; '
    )
else:
    shell.prefix(
        f'set -euo pipefail; saeflow() {{{{ "{sys.executable}" -m saeflow "$@"; }}}}; '
    )
SAEFLOW_ENV = "../../envs/saeflow.yaml"

SHARDS_ROOT = expand_path(config["shards_root"], "shards_root")
RUNS_ROOT = expand_path(config["runs_root"], "runs_root")
SUMMARY_DIR = expand_path(config["summary_dir"], "summary_dir")
# Where the workflow keeps the config files it hands to the `saeflow` CLI (content-addressed, never edited).
CONFIG_CACHE_DIR = pathlib.Path(".snakemake", "saeflow")


# The default config reads MiniLM through this link, which `make run` creates (see Makefile).
DEFAULT_MODEL_LINK = "results/models/all-MiniLM-L6-v2"


def planning_error(what, err):
    hint = ""
    if DEFAULT_MODEL_LINK in str(err):
        hint = f"\n(the default config reads all-MiniLM-L6-v2 through {DEFAULT_MODEL_LINK}: run `make run` once)"
    raise WorkflowError(f"saeflow could not plan {what}: {err}{hint}") from None


try:
    ACTIVATION_HASHES = {
        name: plan_activation(spec).hash for name, spec in config["activations"].items()
    }
except SaeflowError as err:
    planning_error("the activations (config key `activations`)", err)

# Two activation specs with identical content share one shard directory; the first name speaks for it.
HASH_ACTIVATION = {}
for _name, _hash in ACTIVATION_HASHES.items():
    HASH_ACTIVATION.setdefault(_hash, _name)

try:
    RUN_PLANS = {plan.run_id: plan for plan in plan_runs(config, ACTIVATION_HASHES)}
except SaeflowError as err:
    planning_error("the SAE runs (config key `saes`)", err)


def write_cli_config(fpath, cfg):
    """Write the config a CLI job reads (atomically, and only when its content changed)."""
    text = hashing.canonical_json(cfg) + "\n"
    if not fpath.exists() or fpath.read_text(encoding="utf-8") != text:
        fpath.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_file_atomic(fpath, text.encode("utf-8"))
    return fpath


def shard_config_fpath(shard_hash):
    """A config holding only the activation behind `shard_hash`, at a path named by that hash alone.

    Extraction's command line and params then depend on the hash only, so renaming an activation or editing an SAE
    never looks like a change to a protected shard directory.
    """
    return CONFIG_CACHE_DIR / "shards" / f"{shard_hash}.json"


def run_config_fpath(run_id):
    """A config holding only the SAE spec (and activations) of one run, at a path named by the run id alone."""
    return CONFIG_CACHE_DIR / "runs" / f"{run_id}.json"


ROOTS = {"shards_root": str(SHARDS_ROOT), "runs_root": str(RUNS_ROOT)}
for _hash, _name in HASH_ACTIVATION.items():
    write_cli_config(
        shard_config_fpath(_hash),
        {**ROOTS, "activations": {_name: config["activations"][_name]}},
    )
for _run_id, _plan in RUN_PLANS.items():
    _names = (_plan.train_activation, _plan.val_activation)
    write_cli_config(
        run_config_fpath(_run_id),
        {
            **ROOTS,
            "activations": {name: config["activations"][name] for name in _names},
            "saes": {_plan.sae_name: config["saes"][_plan.sae_name]},
        },
    )


def shard_dpath(shard_hash):
    return SHARDS_ROOT / shard_hash


def shards_json(activation):
    """The file that stands for an activation's published shard directory."""
    return shard_dpath(ACTIVATION_HASHES[activation]) / "shards.json"


def run_dpath(run_id):
    return RUNS_ROOT / run_id


def checkpoint_config_fpath(run_id):
    return run_dpath(run_id) / "checkpoint" / "config.json"


def sae_fpath(run_id):
    return run_dpath(run_id) / "checkpoint" / "sae.pt"


def inference_dpath(run_id, shard_hash):
    return run_dpath(run_id) / "inference" / shard_hash


def inference_targets():
    """(run_id, shard_hash) of every inference dump: each run on its validation activations."""
    return [
        (run_id, ACTIVATION_HASHES[plan.val_activation])
        for run_id, plan in RUN_PLANS.items()
    ]


def report_purged_shards():
    """Say clearly which shard directories are gone (e.g. purged from scratch) while runs built on them exist.

    Nothing is rebuilt for runs that are complete: their jobs consume shards through ancient() inputs behind the
    run's own checkpoint/config.json; a shard directory is extracted again only when a job still needs it.
    """
    for shard_hash, name in HASH_ACTIVATION.items():
        if (shard_dpath(shard_hash) / "shards.json").exists():
            continue
        users = [
            run_id
            for run_id, plan in RUN_PLANS.items()
            if name in (plan.train_activation, plan.val_activation)
            and checkpoint_config_fpath(run_id).exists()
        ]
        if users:
            logger.warning(
                f"saeflow: shard directory {shard_dpath(shard_hash)} (activation {name!r}) is missing, "
                f"purged from scratch? {len(users)} existing run(s) were built on it: "
                f"{', '.join(u[:12] for u in users)}. Complete runs are kept as they are; the directory is "
                "extracted again only if a job still needs it."
            )


report_purged_shards()


# Interop exports (config key `exports`, rules in interop.smk): not content-addressed, one directory each.
EXPORT_MARKERS = {
    "lmprobe": "index/train-00000-of-00001.parquet",
    "zarr": "manifest.json",
    "pickle": "metadata.json",
}


def export_dpath(name):
    spec = config["exports"][name]
    return expand_path(
        spec.get("out") or f"results/exports/{name}", f"exports.{name}.out"
    )


def export_config_fpath(name):
    return CONFIG_CACHE_DIR / "exports" / f"{name}.json"


def export_marker(name):
    return export_dpath(name) / EXPORT_MARKERS[config["exports"][name]["format"]]


def export_targets():
    return [export_marker(name) for name in config["exports"]]


for _name, _spec in config["exports"].items():
    write_cli_config(
        export_config_fpath(_name), {"activations": {}, "exports": {_name: _spec}}
    )


def all_targets():
    return [
        *(
            inference_dpath(run_id, shard_hash) / "visuals" / "index.html"
            for run_id, shard_hash in inference_targets()
        ),
        SUMMARY_DIR / "summary.csv",
        SUMMARY_DIR / "pareto.png",
    ]
