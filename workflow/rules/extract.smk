# Extraction: one job per distinct shard hash publishes <shards_root>/<hash>/ in one rename (saeflow extract).
# shards.json stands for the directory (a directory() output would make Snakemake write a timestamp file into
# the published, read-only directory). It is protected: Snakemake aborts rather than rewrite it, and consumers
# read it through ancient(), so neither a new mtime nor a saeflow code change re-extracts. New config, new hash.


rule extract:
    output:
        protected(SHARDS.shards_fpath),
    log:
        "logs/extract/{shard_hash}.log",
    wildcard_constraints:
        shard_hash="[0-9a-f]{64}",
    conda:
        SAEFLOW_ENV
    threads: 2
    params:
        config=lambda wc: get_cli_config("shards", wc.shard_hash),
        shards_root=PLAN.cfg.shards_root,
    shell:
        # Snakemake creates the (empty) output directory first; saeflow publishes the whole directory over it.
        """
        published=$(saeflow extract {params.config:q} --shards-root {params.shards_root:q} 2>{log:q})
        if [ "$(basename "$published")" != {wildcards.shard_hash} ]; then
            echo "saeflow extract published '$published'; the workflow planned {output}" >>{log:q}
            exit 1
        fi
        """
