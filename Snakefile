# saeflow: config -> content-addressed shards -> SAE sweep -> inference -> visuals (+ splice evaluation, probing) -> summary (+ interop exports).
# Every path is planned at parse time by saeflow.planning.WorkflowPlan (workflow/rules/common.smk).
from snakemake.utils import min_version, validate

min_version("9.0")


include: "workflow/rules/config.smk"


report: "workflow/report/workflow.rst"


validate(config, "workflow/schemas/config.schema.yaml")


include: "workflow/rules/common.smk"
include: "workflow/rules/resources.smk"
include: "workflow/rules/extract.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/inference.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/probe.smk"
include: "workflow/rules/stability.smk"
include: "workflow/rules/summary.smk"
include: "workflow/rules/interop.smk"


# Cheap bookkeeping (all, create_run, summary) runs where Snakemake runs (the login node under the Slurm profile):
# each says so itself (`localrule: True`), so it stays local however a paper repository renames it.
rule all:
    default_target: True
    input:
        PLAN.targets(),
    localrule: True
