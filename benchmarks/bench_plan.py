"""Planning cost at real scale: an ImageNet-size image folder and a 1 GB text corpus, first plan and re-plan.

Generates (under a temporary directory, deleted afterwards) an image folder of `--n-files` tiny PNG files in
`--n-classes` class folders (ImageNet-1k: 1,281,167 files, 1000 classes) and a `--corpus-mb` JSONL corpus, then
measures, in one run with an empty fingerprint cache:

- first plan of each activation spec (`plan_activation` in a fresh process: content fingerprint of every file, and
  for the corpus the streaming example count with the byte tokenizer);
- re-plan of each (a fresh process again, as Snakemake's parse inside a Slurm job): stats only, target < 3 s each;
- `snakemake -n` of the saeflow workflow on a config holding both specs (one SAE each), beside `snakemake -n` of
  a bare Snakefile with the same number of jobs (Snakemake's own cost for that DAG).

    python benchmarks/bench_plan.py                                  # full size: ~1.3 GB under /tmp, some minutes
    python benchmarks/bench_plan.py --n-files 100000 --corpus-mb 100 # a quick look
"""

import argparse
import io
import json
import os
import pathlib
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET_REPLAN_S = 3.0
VIT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
       "image_size": 32, "patch_size": 8}  # fmt: skip
GPT2 = {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 300, "n_positions": 256}
PLAN_ONE = """
import sys, time, yaml
t0 = time.perf_counter()
from saeflow.extraction import extract, specs
entry = yaml.safe_load(open(sys.argv[1]))["activations"][sys.argv[2]]
md = extract.plan_activation(specs.ActivationSpec.from_dict(entry))
print(f"{time.perf_counter() - t0:.3f} {md.n_ex} {md.hash}")
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-files", type=int, default=1_281_167, help="images in the folder (default: ImageNet-1k train)")
    p.add_argument("--n-classes", type=int, default=1000, help="class folders (default 1000)")
    p.add_argument("--corpus-mb", type=int, default=1024, help="size of the JSONL corpus in MiB (default 1024)")
    p.add_argument("--dir", default=None, help="where to generate the data (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the generated data")
    p.add_argument("--reuse", action="store_true", help="use the data already in --dir (its cache is emptied)")
    return p.parse_args(argv)


def tiny_png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def make_folder(root: pathlib.Path, n_files: int, n_classes: int) -> None:
    from tqdm import tqdm

    png = tiny_png()
    for c in tqdm(range(n_classes), desc="generate images", unit="class"):
        dpath = root / f"n{c:08d}"
        dpath.mkdir(parents=True)
        for j in range(c * n_files // n_classes, (c + 1) * n_files // n_classes):
            (dpath / f"n{c:08d}_{j}.JPEG.png").write_bytes(png + j.to_bytes(4, "little"))  # distinct contents


def make_corpus(fpath: pathlib.Path, n_mb: int) -> None:
    from tqdm import tqdm

    rng = np.random.default_rng(0)
    words = np.array("the of and to in a is that for it as was with be by on not he this are or his from at which "
                     "but have an had they you were their one all we can her has there been if more when will would "
                     "who so no".split())  # fmt: skip
    blocks = []  # 64 distinct blocks of 1000 lines, written in a seeded order (generating each line costs too much)
    for _ in range(64):
        lines = [json.dumps({"text": " ".join(words[rng.integers(0, len(words), 180)])}) for _ in range(1000)]
        blocks.append("\n".join(lines) + "\n")
    with open(fpath, "w", encoding="utf-8") as fd, tqdm(total=n_mb, desc="generate corpus", unit="MiB") as bar:
        written = 0
        while written < n_mb << 20:
            block = blocks[int(rng.integers(0, len(blocks)))]
            fd.write(block)
            written += len(block)
            bar.update(min(len(block) / (1 << 20), n_mb - bar.n))


def config(image_root: pathlib.Path, corpus: pathlib.Path) -> dict:
    def sae(activation: str) -> dict:
        return {"train": activation, "layer": 1, "arch": "topk", "expansion": 2, "k": 4, "batch_size": 64}

    return {
        "shards_root": "shards", "runs_root": "runs", "summary_dir": "summary",
        "activations": {
            "images": {"model": {"random": {"arch": "vit", "config": VIT}}, "layers": [1], "device": "cpu",
                       "dataset": {"kind": "image_folder", "root": str(image_root)}},
            "corpus": {"model": {"random": {"arch": "gpt2", "config": GPT2}}, "layers": [1], "device": "cpu",
                       "tokenizer": "bytes", "context_length": 128, "dataset": {"kind": "text", "path": str(corpus)}},
        },
        "saes": {"images-topk": sae("images"), "corpus-topk": sae("corpus")},
    }  # fmt: skip


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(cmd: list[str], cwd: pathlib.Path, env: dict) -> tuple[float, float, str, str]:
    """(wall seconds, CPU seconds of the process and its children, e.g. find, stdout, stderr)."""
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[:6])} ... failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0, _children_cpu_s() - cpu0, proc.stdout, proc.stderr


def bare_snakefile(dpath: pathlib.Path, n_jobs: int) -> pathlib.Path:
    fpath = dpath / "Snakefile"
    fpath.write_text(
        f"rule all:\n    input: expand('out/{{i}}.txt', i=range({n_jobs - 1}))\n\n"
        "rule job:\n    output: 'out/{i}.txt'\n    shell: 'touch {output}'\n"
    )
    return fpath


def main(argv=None) -> int:
    import yaml

    args = parse_args(argv)
    work = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="saeflow-bench-plan-"))
    path = f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SAEFLOW_FINGERPRINT_CACHE": str(work / "fingerprint-cache"),
           "PYTHONPATH": str(REPO_ROOT / "workflow"), "PATH": path}  # fmt: skip
    try:
        gen_images_s = gen_corpus_s = 0.0
        shutil.rmtree(work / "fingerprint-cache", ignore_errors=True)  # a first plan is a first plan
        if not args.reuse:
            t0 = time.perf_counter()
            make_folder(work / "imagenet", args.n_files, args.n_classes)
            gen_images_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            make_corpus(work / "corpus.jsonl", args.corpus_mb)
            gen_corpus_s = time.perf_counter() - t0
        config_fpath = work / "config.yaml"
        config_fpath.write_text(yaml.safe_dump(config(work / "imagenet", work / "corpus.jsonl")))
        figures = {}
        for name in ("images", "corpus"):
            for phase in ("first", "re"):
                wall_s, cpu_s, out, _ = run([sys.executable, "-c", PLAN_ONE, str(config_fpath), name], work, env)
                plan_s, n_ex, _ = out.strip().splitlines()[-1].split()
                print(f"{name} {phase}-plan: {plan_s} s wall, {cpu_s:.2f} s CPU", flush=True)
                figures[name, phase] = (float(plan_s), wall_s, cpu_s, int(n_ex))
        snakemake = [sys.executable, "-m", "snakemake", "-n", "--cores", "2"]
        dry = [*snakemake, "-s", str(REPO_ROOT / "Snakefile"), "--configfile", str(config_fpath)]
        dry_s, dry_cpu_s, out, err = run(dry, work, env)
        out += err
        n_jobs = int(re.search(r"^total\s+(\d+)", out, re.M).group(1))
        bare_dpath = work / "bare"
        bare_dpath.mkdir(exist_ok=True)
        bare_s, bare_cpu_s, _, _ = run([*snakemake, "-s", str(bare_snakefile(bare_dpath, n_jobs))], bare_dpath, env)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()[0]
    print(f"data: {args.n_files:,} files in {args.n_classes} classes (generated in {gen_images_s:.0f} s), "
          f"{args.corpus_mb} MiB JSONL corpus ({gen_corpus_s:.0f} s); load average {load:.1f}")  # fmt: skip
    print(f"{'':28} {'plan (s)':>9} {'process (s)':>12} {'CPU (s)':>8} {'examples':>10}")
    for (name, phase), (plan_s, wall_s, cpu_s, n_ex) in figures.items():
        print(f"{name + ' ' + phase + '-plan':28} {plan_s:9.2f} {wall_s:12.2f} {cpu_s:8.2f} {n_ex:10,}")
    print(f"snakemake -n, saeflow workflow ({n_jobs} jobs, re-plan)   {dry_s:.2f} s wall, {dry_cpu_s:.2f} s CPU")
    print(f"snakemake -n, bare Snakefile ({n_jobs} jobs)              {bare_s:.2f} s wall, {bare_cpu_s:.2f} s CPU")
    ok = True
    for name in ("images", "corpus"):
        ratio = figures[name, "re"][0] / TARGET_REPLAN_S
        ok &= ratio < 1
        print(f"re-plan {name} / {TARGET_REPLAN_S:.0f} s limit: {ratio:.2f} ({'met' if ratio < 1 else 'MISSED'})")
    print(f"snakemake -n saeflow / bare: {dry_s / bare_s:.2f}x")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
