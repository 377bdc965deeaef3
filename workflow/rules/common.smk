# The workflow's Python helpers: one saeflow.planning.WorkflowPlan built from the config at parse time (also inside
# every Slurm job, where it takes the submitting Snakemake's shard metadata: no model weights, no data pass), and
# the get_* helpers the rules call.
# Every path comes from saeflow.store.layout (the rules use its Snakemake patterns); nothing here spells one.
# Included after config.smk (which resolves the roots before validation fills the schema's defaults: ROOT_SOURCES,
# stop_workflow).
import os
import pathlib
import sys

from snakemake.logging import logger
from snakemake_interface_executor_plugins.settings import ExecMode
from snakemake.settings.types import DeploymentMethod

from saeflow import config as saeflow_config
from saeflow.analysis import report as saeflow_report
from saeflow.analysis import stability as saeflow_stability
from saeflow.errors import SaeflowError
from saeflow.planning import (
    WorkflowPlan,
    describe_run,
    evaluations,
    extraction_passes,
    pending_passes,
    read_planned,
    seed_group_configs,
    summarized_runs,
)
from saeflow.store.layout import (
    HASH_REGEX,
    RUN_ID_WILDCARD,
    SHARD_HASH_WILDCARD,
    CliConfigLayout,
)
from saeflow.training.ranks.launch import rule_resources

# The rules call `saeflow`: here a shell function for the interpreter running Snakemake (its venv need not be on
# PATH), or, with --software-deployment-method conda, for the env's python with this checkout's package on
# PYTHONPATH (envs/saeflow.yaml), or for the config's `python` (same PYTHONPATH). Being a shell prefix, it is no
# part of any rule's code or params. The job's shell ignores USR1 (Slurm's warning signal before the time limit,
# sent to every process of the job step): saeflow itself catches it to save its resume point (saeflow.preempt).
if DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method:
    shell.prefix(
        f"set -euo pipefail; trap '' USR1; export PYTHONPATH={workflow.basedir}/workflow${{{{PYTHONPATH:+:$PYTHONPATH}}}}; "
        'saeflow() {{ python -m saeflow "$@"; }}; '
    )
elif config.get("python"):  # the jobs' own environment (a CUDA torch on a cluster)
    shell.prefix(
        f"set -euo pipefail; trap '' USR1; export PYTHONPATH={workflow.basedir}/workflow${{{{PYTHONPATH:+:$PYTHONPATH}}}}; "
        f'saeflow() {{{{ "{os.path.expandvars(config["python"])}" -m saeflow "$@"; }}}}; '
    )
else:
    shell.prefix(
        f'set -euo pipefail; trap "" USR1; saeflow() {{{{ "{sys.executable}" -m saeflow "$@"; }}}}; '
    )
SAEFLOW_ENV = "../../envs/saeflow.yaml"
# Where the workflow keeps the config files it hands to the `saeflow` CLI (content-addressed, never edited).
CLI_CONFIGS = CliConfigLayout()


def plan_workflow(config):
    # Planning also makes the link to the packaged MiniLM a config names (models.link_packaged_model).
    # A job's own parse (Slurm) takes the shard metadata the Snakemake that submitted it planned and wrote under
    # CLI_CONFIGS: no dataset listed, no model file read again in every job (saeflow.planning.read_planned).
    planned = {}
    if workflow.exec_mode != ExecMode.DEFAULT:
        planned = read_planned(config["activations"], CLI_CONFIGS.dpath)
    try:
        plan = WorkflowPlan.from_config(config, planned)
    except SaeflowError as err:
        stop_workflow(f"could not plan the workflow: {err}")
    # Before any job runs, once (not again in every job's own parse): no job may start on a damaged published
    # directory. A stat per shard file of the directories jobs still read (about 15 us each on a local disk).
    if workflow.exec_mode == ExecMode.DEFAULT:
        try:
            plan.check_published_shards()
        except SaeflowError as err:
            stop_workflow(err)
    return plan


PLAN = plan_workflow(config)
for _line in saeflow_config.describe_roots(config, ROOT_SOURCES):
    logger.info(f"saeflow: {_line}")
PLAN.write_cli_configs(CLI_CONFIGS.dpath)
for _warning in PLAN.purged_shard_warnings():
    logger.warning(_warning)
# The runs still to train by name beside their id (a dry run lists jobs by run id), once: not in every job's parse.
if workflow.exec_mode == ExecMode.DEFAULT:
    for _run_id in PLAN.runs:
        if not PLAN.run(_run_id).sae_fpath.exists():
            logger.info(f"saeflow: to train: {describe_run(PLAN, _run_id)}")

SHARDS = PLAN.shard(SHARD_HASH_WILDCARD)  # the layouts with wildcards: {shard_hash}
RUNS = PLAN.run(RUN_ID_WILDCARD)  # {run_id}
DUMPS = RUNS.dump(SHARD_HASH_WILDCARD)  # {run_id}, {shard_hash}


# The one block of wildcard constraints: a hash is a full sha256, part numbers are numbers. A rule narrows a
# wildcard further only where the plan decides which job makes a file (split extraction, training passes).
wildcard_constraints:
    shard_hash=HASH_REGEX,
    run_id=HASH_REGEX,
    part_idx="[0-9]+",
    n_parts="[0-9]+",


def get_cli_config(kind, key):
    """The per-job config file of a shard hash, run id or export name (kind: shards, runs, exports), or what decides
    a stage's rerun (kind: stages; key: inference, summary)."""
    return CLI_CONFIGS.fpath(kind, key)


def get_shards_if_missing(output_fpath, *shard_hashes):
    """The shards.json (ancient) of the shard directories while `output_fpath` is missing, else nothing: a job reads
    shard bytes only when it runs, so a complete output never asks for a purged or moved shard directory to be
    extracted.
    """
    if pathlib.Path(output_fpath).exists():
        return []
    return [ancient(PLAN.shard(h).shards_fpath) for h in dict.fromkeys(shard_hashes)]


def get_pass(run_id):
    """The runs trained in `run_id`'s job (one pass over the data), the representative last; itself once trained."""
    return PLAN.train_passes.get(run_id, (run_id,))


def pass_representative_regex():
    """Run ids whose sae.pt the train job makes: the representatives of the passes of untrained runs. Another
    member's checkpoint comes from its representative's job, so no second job may make, delete or redo it; a trained
    run's sae.pt is no job's output but a source file, like any input: a pass member's was published by another job,
    so Snakemake holds no metadata for it and a no-op dry run said "jobs have missing provenance/metadata". A missing
    sae.pt makes its run untrained again, and a new one reruns what reads it (mtime), as before.
    """
    representatives = "|".join(
        r for r, run_ids in PLAN.train_passes.items() if run_ids[-1] == r
    )
    return f"(?:{representatives})" if representatives else "(?!x)x"


def get_pass_configs(run_id):
    return [ancient(PLAN.run(member).config_fpath) for member in get_pass(run_id)]


def get_pass_shards(run_id):
    """Every member's train and val shards.json (a transcoder's targets too) while its sae.pt is missing
    (get_shards_if_missing)."""
    shards = []
    for member in get_pass(run_id):
        plan = PLAN.runs[member]
        member_shards = get_shards_if_missing(
            PLAN.run(member).sae_fpath, *plan.read_shards
        )
        shards += [f for f in member_shards if f not in shards]
    return shards


def get_trained_sae(wildcards):
    """The sae.pt a job reading run `wildcards.run_id`'s checkpoint waits for: its pass's representative's while
    it is untrained (that job trains it too), its own once trained."""
    return PLAN.run(PLAN.trained_by(wildcards.run_id)).sae_fpath


def get_settings_flags(section):
    """A settings section of the config (train, inference, visuals) as CLI flags (defaults left out)."""
    return saeflow_config.section_flags(section, PLAN.cfg.settings[section])


def get_dump_metrics():
    return [
        PLAN.run(run_id).dump(shard_hash).metrics_fpath
        for run_id, shard_hash in PLAN.dumps()
    ]


def split_hash_regex(split):
    """The shard hashes extracted in parts (split=True) or alone in one job (split=False: neither in parts nor in a
    pending extraction pass, whose rule extract_pass_<key> makes them), as a wildcard regex.
    """
    hashes = "|".join(PLAN.shard_parts)
    if split:
        return f"(?:{hashes})" if hashes else "(?!x)x"
    hashes = "|".join(
        [*PLAN.shard_parts, *(h for p in pending_passes(PLAN).values() for h in p)]
    )
    return f"(?!{hashes}){HASH_REGEX}" if hashes else HASH_REGEX


def part_hash_regex():
    """The shard hashes whose parts extract_part makes: extracted in parts, in no pending extraction pass (the
    pass's own extract_pass_part_<key> makes a part of each of its directories in one job), as a wildcard regex.
    """
    in_passes = {h for p in pending_passes(PLAN).values() for h in p}
    hashes = "|".join(h for h in PLAN.shard_parts if h not in in_passes)
    return f"(?:{hashes})" if hashes else "(?!x)x"


def pass_expect_flags(pass_key):
    """`--expect-hash H` for every directory of an extraction pass (its config holds every member; the published
    ones are reused)."""
    return " ".join(f"--expect-hash {h}" for h in extraction_passes(PLAN)[pass_key])


def get_part_markers(wildcards):
    """The part jobs' markers while the directory is unpublished; a published one needs no part again."""
    n_parts = PLAN.shard_parts[wildcards.shard_hash]
    shards = PLAN.shard(wildcards.shard_hash)
    if shards.shards_fpath.exists():
        return []
    return [shards.part(i, n_parts).part_done_fpath for i in range(n_parts)]


def get_evaluations():
    """Every run's splice evaluation on its validation activations (saeflow evaluate; WorkflowPlan.evaluations)."""
    return [
        PLAN.run(run_id).evaluation_fpath(shard_hash)
        for run_id, shard_hash in evaluations(PLAN)
    ]


def get_probes():
    """Every labelled dump's probe result (saeflow probe; WorkflowPlan.probes)."""
    return [
        PLAN.run(run_id).probe_fpath(shard_hash) for run_id, shard_hash in PLAN.probes()
    ]


# Seed groups: runs whose training configs differ only in seed/data_seed (group id -> run ids; saeflow.analysis.stability).
STABILITY_GROUPS = saeflow_stability.seed_groups(seed_group_configs(PLAN))
SUMMARIZED = summarized_runs(PLAN)  # the runs with dumps (a CLT has none)
STABILITY_GROUP_WILDCARD = "{group}"


def get_stability_results():
    """Every seed group's stability result."""
    return [
        saeflow_stability.result_fpath(PLAN.cfg.summary_dir, group)
        for group in STABILITY_GROUPS
    ]


def get_group_dumps(wildcards):
    """The dump (its metrics file) of each member of a seed group on its validation shards: stability counts only
    the latents that fired there (saeflow.analysis.stability.live_latents)."""
    val = dict(PLAN.dumps())
    return [
        PLAN.run(r).dump(val[r]).metrics_fpath
        for r in STABILITY_GROUPS[wildcards.group]
    ]


def get_group_saes(wildcards):
    """The sae.pt of each member of a seed group (its pass representative's while untrained)."""
    members = STABILITY_GROUPS[wildcards.group]
    return list(dict.fromkeys(PLAN.run(PLAN.trained_by(r)).sae_fpath for r in members))
