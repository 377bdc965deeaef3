# Seed stability: runs whose training configs differ only in seed and/or data_seed form a group (saeflow.analysis.stability;
# named by the content hash of the config without its seeds); each group's runs are matched pairwise by decoder
# direction (saeflow stability) into <summary_dir>/stability/<group>.json, which the summary's grouped table and
# stability page read. The job waits for every member's sae.pt (its pass representative's while untrained), for every
# member's dump on its validation shards (only the latents that fired there are matched), and for
# .snakemake/saeflow/analysis/stability/<group>.json, the member list, rewritten only when the group changes. Groups:
# common.smk's STABILITY_GROUPS.


rule stability:
    input:
        saes=get_group_saes,
        dumps=get_group_dumps,
        members=lambda wc: get_cli_config("stability", wc.group),
    output:
        saeflow_stability.result_fpath(PLAN.cfg.summary_dir, STABILITY_GROUP_WILDCARD),
    log:
        "logs/stability/{group}.log",
    wildcard_constraints:
        group="[0-9a-f]{64}",
    conda:
        SAEFLOW_ENV
    threads: 2
    params:
        runs=lambda wc: [
            f"--run={PLAN.run(r).root}" for r in STABILITY_GROUPS[wc.group]
        ],
    shell:
        "saeflow stability {params.runs:q} --out {output:q} >{log:q} 2>&1"
