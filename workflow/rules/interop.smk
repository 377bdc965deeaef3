# Interop exports (config key `exports`; docs/interop.md): one job per export writes an lmprobe 2.0 dataset,
# a Zarr store root (shards + manifest.json) or gzip-pickle shards with `saeflow export`. Exports are not
# content-addressed: the output is the export's `out` (default results/exports/<name>), rebuilt when its config
# changes. One rule per export: its output path comes from the config, not from a wildcard pattern.


for _name in PLAN.cfg.exports:

    rule:
        name:
            f"export_{_name}"
        input:
            config=get_cli_config("exports", _name),
        output:
            marker=PLAN.export_marker(_name),
        log:
            f"logs/export/{_name}.log",
        conda:
            SAEFLOW_ENV
        threads: 2
        params:
            name=_name,
            out=PLAN.export_dpath(_name),
        shell:
            # Snakemake pre-creates the marker's parent directories; saeflow refuses an existing lmprobe/pickle
            # output, so empty directories are removed first (a zarr root keeps its finished shard stores).
            """
            find {params.out:q} -depth -type d -empty -delete 2>/dev/null || true
            saeflow export {input.config:q} --export {params.name:q} --out {params.out:q} --no-progress 2>{log:q}
            """
