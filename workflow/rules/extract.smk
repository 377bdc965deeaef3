# Extraction: one job per distinct shard hash publishes <shards_root>/<hash>/ in one rename (saeflow extract).
# Each job passes the hash the workflow planned (--expect-hash): saeflow refuses, before the model runs, an
# activation that plans another one in the job's environment. One command per rule, so a failed (or Ctrl-C'd) job
# shows one line of shell; what saeflow says (what was kept, how to resume) is the last line of its log.
# shards.json stands for the directory (a directory() output would make Snakemake write a timestamp file into
# the published, read-only directory). It is protected: Snakemake aborts rather than rewrite it, and consumers
# read it through ancient(), so neither a new mtime nor a saeflow code change re-extracts. New config, new hash.
#
# Split extraction (an activation's `parts` > 1, docs/extraction.md): extract_part jobs each write a contiguous
# range of whole shards into <shards_root>/.<hash>.parts/ (resumable shard by shard), then extract_seal verifies
# every part and publishes the same directory, byte for byte, in one rename. A part's part.json stands for it; it is
# temp() because the seal removes the parts area once the directory is published.
#
# Hook points (docs/extraction.md): activation specs that differ only in `hook` form one extraction pass, and one job
# runs the model once for them and publishes a directory per hook point (saeflow extract on the pass's config). A
# rule's outputs are fixed and a pass's directories share no wildcard, so each pass with unpublished directories gets
# a rule of its own, extract_pass_<pass key>, whose outputs are exactly those directories: a hook point added later is
# extracted alone, and a published one is no output (saeflow reuses it and never rewrites it), as a trained run's
# sae.pt is none. rule extract takes every other hash. A split pass (its activations' `parts` > 1) gets a rule
# extract_pass_part_<pass key> instead, one job per part writing that part of each unpublished directory; each
# directory's own extract_seal then publishes it.


rule extract:
    output:
        protected(SHARDS.shards_fpath),
    log:
        "logs/extract/{shard_hash}.log",
    wildcard_constraints:
        shard_hash=split_hash_regex(split=False),
    conda:
        SAEFLOW_ENV
    threads: job_threads("extract", 2)
    resources:
        **job_resources("extract", extraction_on_gpu),
    params:
        config=lambda wc: get_cli_config("shards", wc.shard_hash),
    shell:
        # Snakemake creates the (empty) output directory first; saeflow publishes the whole directory over it.
        "saeflow extract {params.config:q} --expect-hash {wildcards.shard_hash} >{log:q} 2>&1"


rule extract_part:
    output:
        temp(SHARDS.part("{part_idx}", "{n_parts}").part_done_fpath),
    log:
        "logs/extract/{shard_hash}.part-{part_idx}-of-{n_parts}.log",
    wildcard_constraints:
        shard_hash=part_hash_regex(),
    conda:
        SAEFLOW_ENV
    threads: job_threads("extract_part", 2)
    resources:
        **job_resources("extract_part", extraction_on_gpu),
    params:
        config=lambda wc: get_cli_config("shards", wc.shard_hash),
    shell:
        "saeflow extract {params.config:q} --expect-hash {wildcards.shard_hash} "
        "--part {wildcards.part_idx}/{wildcards.n_parts} >{log:q} 2>&1"


rule extract_seal:
    input:
        get_part_markers,
    output:
        protected(SHARDS.shards_fpath),
    log:
        "logs/extract/{shard_hash}.seal.log",
    wildcard_constraints:
        shard_hash=split_hash_regex(split=True),
    conda:
        SAEFLOW_ENV
    threads: job_threads("extract_seal", 1)
    resources:
        **job_resources("extract_seal"),
    params:
        config=lambda wc: get_cli_config("shards", wc.shard_hash),
        n_parts=lambda wc: PLAN.shard_parts[wc.shard_hash],
    shell:
        "saeflow extract {params.config:q} --expect-hash {wildcards.shard_hash} --seal {params.n_parts} >{log:q} 2>&1"


for _pass_key, _pass_hashes in pending_passes(PLAN).items():
    # A split extraction: a job per part, a part of each directory.
    if _pass_hashes[0] in PLAN.shard_parts:

        rule:
            name:
                f"extract_pass_part_{_pass_key[:16]}"
            output:
                [
                    temp(
                        PLAN.shard(h)
                        .part("{part_idx}", PLAN.shard_parts[h])
                        .part_done_fpath
                    )
                    for h in _pass_hashes
                ],
            log:
                f"logs/extract/pass-{_pass_key[:16]}.part-{{part_idx}}.log",
            conda:
                SAEFLOW_ENV
            threads: job_threads("extract_part", 2)
            resources:
                **job_resources("extract_part", pass_on_gpu(_pass_key)),
            params:
                config=get_cli_config("passes", _pass_key),
                expect=pass_expect_flags(_pass_key),
                n_parts=PLAN.shard_parts[_pass_hashes[0]],
            shell:
                "saeflow extract {params.config:q} {params.expect} "
                "--part {wildcards.part_idx}/{params.n_parts} >{log:q} 2>&1"

    else:

        rule:
            name:
                f"extract_pass_{_pass_key[:16]}"
            output:
                [protected(PLAN.shard(h).shards_fpath) for h in _pass_hashes],
            log:
                f"logs/extract/pass-{_pass_key[:16]}.log",
            conda:
                SAEFLOW_ENV
            threads: job_threads("extract", 2)
            resources:
                **job_resources("extract", pass_on_gpu(_pass_key)),
            params:
                config=get_cli_config("passes", _pass_key),
                expect=pass_expect_flags(_pass_key),
            shell:
                "saeflow extract {params.config:q} {params.expect} >{log:q} 2>&1"
