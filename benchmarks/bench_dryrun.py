"""How long `snakemake -n` takes on a config: the parse-time planning cost every workflow invocation pays.

Prints the dry-run time against the 5 s target, and against Snakemake's own floor measured in the same run (a dry
run of an empty Snakefile), so the ratio isolates saeflow's planning (config validation, model configs, corpus
tokenization for text, run ids) from Snakemake's start-up.

    python benchmarks/bench_dryrun.py                       # the default config (config/config.yaml)
    python benchmarks/bench_dryrun.py --config my.yaml --repeat 1
"""

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET_S = 5.0


def timed(cmd: list[str], cwd: pathlib.Path, env: dict) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=pathlib.Path, default=REPO_ROOT / "config" / "config.yaml")
    parser.add_argument("--repeat", type=int, default=3, help="timed dry runs (the median is reported)")
    args = parser.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"}
    snakemake = [sys.executable, "-m", "snakemake", "-n", "--cores", "2"]
    with tempfile.TemporaryDirectory() as tmp:
        empty = pathlib.Path(tmp) / "Snakefile"
        empty.write_text("rule all:\n    output:\n        'x'\n    shell:\n        'touch {output}'\n")
        floor_s = statistics.median(
            timed([*snakemake, "-s", str(empty)], pathlib.Path(tmp), env) for _ in range(args.repeat)
        )
    cmd = [*snakemake, "-s", str(REPO_ROOT / "Snakefile"), "--configfile", str(args.config.resolve())]
    timed(cmd, REPO_ROOT, env)  # warm the page cache and the content-addressed config files
    dry_s = statistics.median(timed(cmd, REPO_ROOT, env) for _ in range(args.repeat))
    print(f"config                 {args.config}")
    print(f"snakemake -n (saeflow) {dry_s:.2f} s (median of {args.repeat})")
    print(f"snakemake -n (empty)   {floor_s:.2f} s  Snakemake's own start-up, same machine, same run")
    print(f"ratio to empty         {dry_s / floor_s:.2f}x")
    print(f"ratio to 5 s target    {dry_s / TARGET_S:.2f} ({'met' if dry_s < TARGET_S else 'MISSED'})")


if __name__ == "__main__":
    main()
