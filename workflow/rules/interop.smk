# Interop exports (config key `exports`; docs/interop.md): one job per export writes an lmprobe 2.0 dataset,
# a Zarr store root (shards + manifest.json) or gzip-pickle shards with `saeflow export`. Exports are not
# content-addressed: the output is <out> (or results/exports/<name>), rebuilt when the export's config changes.

# The paths come from common.smk (export_dpath, export_marker, export_config_fpath).


# One rule per export (its output path comes from the config, not from a wildcard pattern).
for _name in config["exports"]:

    rule:
        name:
            f"export_{_name}"
        input:
            config=export_config_fpath(_name),
        output:
            marker=export_marker(_name),
        log:
            f"logs/export/{_name}.log",
        conda:
            SAEFLOW_ENV
        threads: 2
        params:
            name=_name,
            out=export_dpath(_name),
        shell:
            # Snakemake pre-creates the marker's parent directories; saeflow refuses an existing lmprobe/pickle
            # output, so empty directories are removed first (a zarr root keeps its finished shard stores).
            """
            find {params.out:q} -depth -type d -empty -delete 2>/dev/null || true
            saeflow export {input.config:q} --export {params.name:q} --out {params.out:q} --no-progress 2>{log:q}
            """
