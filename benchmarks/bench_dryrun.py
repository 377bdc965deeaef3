"""How long `snakemake -n` takes on a config: the parse-time planning cost every workflow invocation pays.

Default: the default config (config/config.yaml) against the 5 s target, and against Snakemake's own floor measured
in the same run (a dry run of an empty Snakefile).

`--big`: the real-scale specs of bench_plan.py (an ImageNet-size image folder of 1,281,167 files and a 1 GiB JSONL
corpus, one SAE each; generated under a temporary directory the same way, deleted afterwards). After one untimed
first plan (it hashes every byte), it times, median of `--repeat`, in this order each round:

- `snakemake -n` of the saeflow workflow (a re-plan: the fingerprint cache is warm; by default the image folder,
  over 100,000 files, is re-planned by its directories, see saeflow.extraction.fingerprints);
- `snakemake -n` of a bare Snakefile with the same number of jobs (Snakemake's own cost for that DAG);
- a Slurm job's parse: `snakemake -n --mode remote --target-jobs summary:` (what every job runs first);
- `snakemake -n` of the saeflow workflow with SAEFLOW_FINGERPRINT_RECHECK=files (every file stat'ed on every
  re-plan; shown, not held to the limit: 1.28M stat calls are its floor).

and prints each figure as a ratio to the bare Snakefile's, the first two against the 1.5 limit, with CPU seconds (the
process and its children, e.g. the `find` processes that stat the image folder) and the load average.

    python benchmarks/bench_dryrun.py                       # the default config (config/config.yaml)
    python benchmarks/bench_dryrun.py --config my.yaml --repeat 1
    python benchmarks/bench_dryrun.py --big                 # ~1.3 GB under /tmp, a few minutes
    python benchmarks/bench_dryrun.py --big --n-files 100000 --corpus-mb 100 --dir /tmp/bp --keep
"""

import argparse
import os
import pathlib
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import bench_plan

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET_S = 5.0
RATIO_LIMIT = 1.5  # saeflow's `snakemake -n` / a bare Snakefile's with the same jobs


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str], cwd: pathlib.Path, env: dict) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the process and its children, stdout + stderr)."""
    start, cpu0 = time.perf_counter(), _children_cpu_s()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return elapsed, _children_cpu_s() - cpu0, proc.stdout + proc.stderr


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=pathlib.Path, default=REPO_ROOT / "config" / "config.yaml")
    p.add_argument("--repeat", type=int, default=3, help="timed dry runs (the median is reported)")
    p.add_argument("--big", action="store_true", help="the 1.28M-file folder and 1 GiB corpus of bench_plan.py")
    p.add_argument("--n-files", type=int, default=1_281_167, help="--big: images in the folder")
    p.add_argument("--n-classes", type=int, default=1000, help="--big: class folders")
    p.add_argument("--corpus-mb", type=int, default=1024, help="--big: size of the JSONL corpus in MiB")
    p.add_argument("--dir", default=None, help="--big: where to generate the data (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="--big: keep the generated data")
    p.add_argument("--reuse", action="store_true", help="--big: use the data already in --dir (cache kept)")
    return p.parse_args(argv)


def default_config(args, env: dict) -> None:
    snakemake = [sys.executable, "-m", "snakemake", "-n", "--cores", "2"]
    with tempfile.TemporaryDirectory() as tmp:
        empty = pathlib.Path(tmp) / "Snakefile"
        empty.write_text("rule all:\n    output:\n        'x'\n    shell:\n        'touch {output}'\n")
        floor_s = statistics.median(
            timed([*snakemake, "-s", str(empty)], pathlib.Path(tmp), env)[0] for _ in range(args.repeat)
        )
    cmd = [*snakemake, "-s", str(REPO_ROOT / "Snakefile"), "--configfile", str(args.config.resolve())]
    timed(cmd, REPO_ROOT, env)  # warm the page cache and the content-addressed config files
    dry_s = statistics.median(timed(cmd, REPO_ROOT, env)[0] for _ in range(args.repeat))
    print(f"config                 {args.config}")
    print(f"snakemake -n (saeflow) {dry_s:.2f} s (median of {args.repeat})")
    print(f"snakemake -n (empty)   {floor_s:.2f} s  Snakemake's own start-up, same machine, same run")
    print(f"ratio to empty         {dry_s / floor_s:.2f}x")
    print(f"ratio to 5 s target    {dry_s / TARGET_S:.2f} ({'met' if dry_s < TARGET_S else 'MISSED'})")


def big_specs(args, env: dict) -> int:
    import yaml

    work = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="saeflow-bench-dryrun-"))
    env = {**env, "SAEFLOW_FINGERPRINT_CACHE": str(work / "fingerprint-cache"),
           "PYTHONPATH": str(REPO_ROOT / "workflow")}  # fmt: skip
    try:
        if not args.reuse:
            bench_plan.make_folder(work / "imagenet", args.n_files, args.n_classes)
            bench_plan.make_corpus(work / "corpus.jsonl", args.corpus_mb)
        config_fpath = work / "config.yaml"
        config_fpath.write_text(yaml.safe_dump(bench_plan.config(work / "imagenet", work / "corpus.jsonl")))
        snakemake = [sys.executable, "-m", "snakemake", "-n", "--cores", "2"]
        saeflow = [*snakemake, "-s", str(REPO_ROOT / "Snakefile"), "--configfile", str(config_fpath)]
        first_s, _, out = timed(saeflow, work, env)  # the first plan: every byte hashed (unless --reuse)
        n_jobs = int(re.search(r"^total\s+(\d+)", out, re.M).group(1))
        bare_dpath = work / "bare"
        bare_dpath.mkdir(exist_ok=True)
        bare = [*snakemake, "-s", str(bench_plan.bare_snakefile(bare_dpath, n_jobs))]
        job = [*saeflow, "--mode", "remote", "--target-jobs", "summary:"]
        files_env = {**env, "SAEFLOW_FINGERPRINT_RECHECK": "files"}
        timed(saeflow, work, env)  # directories modified < 5 s before the first plan are listed once more (racy)
        rounds = [(timed(saeflow, work, env), timed(bare, bare_dpath, env), timed(job, work, env),
                   timed(saeflow, work, files_env)) for _ in range(args.repeat)]  # fmt: skip
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    names = ("saeflow", "bare", "job", "files")
    figures = {name: [(r[i][0], r[i][1]) for r in rounds] for i, name in enumerate(names)}
    return report(args, n_jobs, first_s, figures)


def report(args, n_jobs: int, first_s: float, figures: dict[str, list[tuple[float, float]]]) -> int:
    wall = {name: statistics.median(w for w, _ in runs) for name, runs in figures.items()}
    cpu = {name: statistics.median(c for _, c in runs) for name, runs in figures.items()}
    print(f"data: {args.n_files:,} files in {args.n_classes} classes, {args.corpus_mb} MiB JSONL corpus; "
          f"{n_jobs} jobs; first plan {first_s:.1f} s; load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'median of ' + str(args.repeat):44} {'wall (s)':>9} {'CPU (s)':>8} {'/ bare wall':>12}")
    labels = {"saeflow": "snakemake -n, saeflow workflow (re-plan)", "bare": "snakemake -n, bare Snakefile",
              "job": "a Slurm job's parse (--mode remote)",
              "files": "snakemake -n, RECHECK=files"}  # fmt: skip
    for name, label in labels.items():
        print(f"{label:44} {wall[name]:9.2f} {cpu[name]:8.2f} {wall[name] / wall['bare']:11.2f}x")
    ok = True
    for name in ("saeflow", "job"):
        ratio = wall[name] / wall["bare"]
        ok &= ratio <= RATIO_LIMIT
        verdict = "met" if ratio <= RATIO_LIMIT else "MISSED"
        print(f"{labels[name]} / bare: {ratio:.2f}x, limit {RATIO_LIMIT}x ({verdict})")
    return 0 if ok else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"}
    if args.big:
        return big_specs(args, env)
    default_config(args, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
