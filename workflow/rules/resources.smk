# What each job asks of a cluster (docs/workflow.md, "On OSC"). A cluster profile hands saeflow a table of requests
# as Snakemake `set-resources` entries keyed `saeflow/<rule>` (profiles/osc/clusters/<cluster>.yaml), and every saeflow
# rule takes its own entry here, looked up by the name saeflow gives it (`job_resources("extract", ...)`). So the
# requests follow the rule however a paper repository renamed it (`use rule * from saeflow as saeflow_*` renames
# every rule, and Snakemake's own per-rule `set-resources`, `set-threads` and `localrules` name rules as the workflow
# calls them, so they matched none of them: extraction went out without a GPU). Local rules say so themselves
# (`localrule: True`). A key that names a rule as the workflow calls it is Snakemake's own override, applied on top.
# A job whose device is the CPU (`device: cpu`) is planned as a CPU job: no GPU, the profile's CPU partition (its
# default-resources' slurm_partition), its cores per task.
from snakemake.resources import Resource, Resources

from saeflow import devices as saeflow_devices

CLUSTER_TABLE_PREFIX = "saeflow/"
# The rules that take a table entry (describe_old_table names them when a profile keys them by bare rule names).
SAEFLOW_CLUSTER_RULES = (
    "extract",
    "extract_part",
    "extract_seal",
    "train",
    "inference",
    "evaluate",
    "probe",
)
# Resources that exist only for a GPU job: a CPU job of a GPU rule leaves them out (and a `gres` that names a GPU).
GPU_RESOURCES = ("gpu", "cpus_per_gpu", "tasks_per_gpu")


def read_cluster_table():
    """saeflow's rule name -> its requests (snakemake Resources) from the `saeflow/<rule>` set-resources entries."""
    return {
        name.removeprefix(CLUSTER_TABLE_PREFIX): Resources.from_mapping(entry)
        for name, entry in workflow.resource_settings.overwrite_resources.items()
        if name.startswith(CLUSTER_TABLE_PREFIX)
    }


CLUSTER_TABLE = read_cluster_table()
_DEFAULTS = Resources.from_mapping(workflow.resource_settings.default_resources or {})
CPU_PARTITION = _DEFAULTS["slurm_partition"] if "slurm_partition" in _DEFAULTS else None


def _as_cpu_job(entry):
    """A GPU rule's requests for a job on the CPU: no GPU resource, the CPU partition, the cores per GPU per task."""
    cpu = {
        key: res
        for key, res in entry.items()
        if key not in GPU_RESOURCES and not (key == "gres" and "gpu" in str(res.raw))
    }
    cpu.pop("slurm_partition", None)
    if CPU_PARTITION is not None:
        cpu["slurm_partition"] = CPU_PARTITION
    per_task = cpu.get("cpus_per_task")
    if "cpus_per_gpu" in entry and (per_task is None or per_task.raw in (0, "0")):
        cpu["cpus_per_task"] = Resource("cpus_per_task", entry["cpus_per_gpu"].value)
    return cpu


def _evaluated(res):
    """The value of a table resource for a job, evaluated as Snakemake evaluates its own set-resources (an expression
    such as `min(360 * attempt, 10080)` per attempt); None for none."""
    if res is None or not res.is_evaluable():
        return None if res is None else res.value

    def value(wildcards, input, attempt, threads, rulename, async_run):
        aux = dict(input=input, attempt=attempt, threads=threads, rulename=rulename)
        return res.evaluate(wildcards, async_run=async_run, **aux).value

    return value


def _either(on_gpu, on_cpu, gpu_job):
    """A rule resource that takes the GPU job's table resource or the CPU job's, as `gpu_job(wildcards)` says."""

    def value(wildcards, input, attempt, threads, rulename, async_run):
        res = on_gpu if gpu_job(wildcards) else on_cpu
        evaluated = _evaluated(res)
        if callable(evaluated):
            return evaluated(wildcards, input, attempt, threads, rulename, async_run)
        return evaluated

    return value


def job_resources(rule, gpu_job=True, extra=None):
    """The resources of a job of saeflow's rule named `rule` (its cluster table entry), then `extra` (the GPUs
    and nodes from the config). `gpu_job` is False, or a function of the wildcards that is False, for a job on the
    CPU device: it is then planned as a CPU job (no GPU resource, the CPU partition)."""
    entry = dict(CLUSTER_TABLE.get(rule, {}))
    entry.update({key: Resource(key, value) for key, value in (extra or {}).items()})
    on_cpu = _as_cpu_job(entry) if entry else {}
    if not callable(gpu_job):
        return {
            key: _evaluated(res) for key, res in (entry if gpu_job else on_cpu).items()
        }
    keys = dict.fromkeys([*entry, *on_cpu])
    return {key: _either(entry.get(key), on_cpu.get(key), gpu_job) for key in keys}


def job_threads(rule, default):
    """A job's threads: its table entry's cores (cpus_per_task, else cpus_per_gpu), else `default`."""
    entry = CLUSTER_TABLE.get(rule, {})
    for key in ("cpus_per_task", "cpus_per_gpu"):
        if key in entry and not entry[key].is_evaluable() and entry[key].value > 0:
            return entry[key].value
    return default


def extraction_on_gpu(wildcards):
    """Whether a shard hash's extraction job wants a GPU (its activation's device is not the CPU's)."""
    spec = PLAN.cfg.activations[PLAN.hash_activation[wildcards.shard_hash]]
    return not saeflow_devices.is_cpu(spec.device)


def pass_on_gpu(pass_key):
    """Whether an extraction pass's job wants a GPU (its activations share one device)."""
    first = extraction_passes(PLAN)[pass_key][0]
    return not saeflow_devices.is_cpu(
        PLAN.cfg.activations[PLAN.hash_activation[first]].device
    )


def stage_on_gpu(section):
    """Whether the jobs of a settings section (train, inference, evaluate) want a GPU."""
    return not saeflow_devices.is_cpu(PLAN.cfg.settings[section]["device"])


def describe_cpu_jobs():
    """A line for `snakemake -n` when a GPU profile plans jobs of GPU rules on the CPU (`device: cpu`), else None."""
    if not any("gpu" in entry for entry in CLUSTER_TABLE.values()):
        return None
    on_cpu = [f"extract (activation {name})" for name, spec in PLAN.cfg.activations.items()
              if saeflow_devices.is_cpu(spec.device)]  # fmt: skip
    on_cpu += [
        section
        for section in ("train", "inference", "evaluate")
        if not stage_on_gpu(section)
    ]
    if not on_cpu:
        return None
    partition = (
        f"partition {CPU_PARTITION.raw}"
        if CPU_PARTITION is not None
        else "the default partition"
    )
    return (f"device cpu: {', '.join(on_cpu)} planned as CPU jobs (no GPU, {partition}); set device: auto or cuda "
            "for a GPU")  # fmt: skip


def describe_old_table():
    """A warning when the profile keys saeflow's requests by bare rule names (installed before the table), else None."""
    bare = sorted(
        set(workflow.resource_settings.overwrite_resources) & set(SAEFLOW_CLUSTER_RULES)
    )
    if CLUSTER_TABLE or not bare:
        return None
    return (f"the profile's set-resources name saeflow's rules without `{CLUSTER_TABLE_PREFIX}` ({', '.join(bare)}): "
            "a profile installed before saeflow read its own table; rules a paper repository renamed get none of it "
            "and device: cpu jobs still ask for a GPU. Reinstall it: saeflow install-profile --force ...")  # fmt: skip


CPU_JOBS_LINE = describe_cpu_jobs()
if CPU_JOBS_LINE:
    logger.info(f"saeflow: {CPU_JOBS_LINE}")
OLD_TABLE_LINE = describe_old_table()
if OLD_TABLE_LINE:
    logger.warning(f"saeflow: {OLD_TABLE_LINE}")
