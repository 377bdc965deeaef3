"""A full disk in every writing stage: one line that says so (with the path), nothing half-written, and a rerun
after freeing space gives the same bytes as a run on a roomy disk (provenance.json aside).

Each stage writes onto a small tmpfs sized so that it runs out of space midway (half of what the stage writes on
a normal disk, on top of what it reads from there); then the tmpfs is remounted bigger and the stage rerun.
Needs `mount -t tmpfs` (root in the container); skipped with the reason otherwise.
"""

import json
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from builders import PROMPTS
from saeflow.interop import lmprobe
from workflow_helpers import REPO_ROOT, env

pytestmark = pytest.mark.slow  # every test here runs Snakemake or the CLI end to end

TEST_CONFIG = yaml.safe_load((REPO_ROOT / ".test" / "config" / "config.yaml").read_text())
PAGE_BYTES = 4096


def saeflow(*argv) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "saeflow", *map(str, argv)]
    return subprocess.run(cmd, env=env(PYTHONPATH=str(REPO_ROOT / "workflow")), capture_output=True, text=True)


def ok(*argv) -> str:
    proc = saeflow(*argv)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""


def tree_bytes(dpath: pathlib.Path) -> int:
    return sum(p.lstat().st_size for p in dpath.rglob("*") if p.is_file() and not p.is_symlink())


TIME_KEYS = ("created_at", "started_at", "finished_at", "provenance")  # provenance inside exported metadata


def _without_times(obj):
    if isinstance(obj, dict):
        return {k: _without_times(v) for k, v in obj.items() if k not in TIME_KEYS}
    return [_without_times(v) for v in obj] if isinstance(obj, list) else obj


def files_of(dpath: pathlib.Path, skip=("provenance.json",)) -> dict[str, bytes]:
    """Every file under dpath (relative name -> bytes; JSON without time stamps), symlinks and lock files aside."""
    out = {}
    for p in sorted(dpath.rglob("*")):
        if p.is_file() and not p.is_symlink() and p.name not in skip and not p.name.endswith(".lock"):
            data = p.read_bytes()
            is_json = p.suffix == ".json" or p.name in (".zattrs", ".zmetadata")
            if is_json and any(key.encode() in data for key in TIME_KEYS):
                data = json.dumps(_without_times(json.loads(data))).encode()
            out[str(p.relative_to(dpath))] = data
    return out


SKIP_DUMP = ("provenance.json", "config.json", "patch_acts.npz", "latents.npz")


def npz_arrays(fpath: pathlib.Path) -> dict[str, bytes]:
    with np.load(fpath) as npz:
        return {name: npz[name].tobytes() + str(npz[name].dtype).encode() for name in npz.files}


class Tmpfs:
    def __init__(self, dpath: pathlib.Path):
        self.dpath = dpath

    def mount(self, size_bytes: int) -> pathlib.Path:
        size_bytes = -(-size_bytes // PAGE_BYTES) * PAGE_BYTES
        self.dpath.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(self.dpath)],
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode})")
        return self.dpath

    def grow(self, size_bytes: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size_bytes}", str(self.dpath)], check=True)

    def umount(self) -> None:
        subprocess.run(["umount", str(self.dpath)], capture_output=True)


@pytest.fixture
def tmpfs(tmp_path):
    mounted = Tmpfs(tmp_path / "tmpfs")
    yield mounted
    mounted.umount()


def assert_disk_full(proc: subprocess.CompletedProcess, command: str, path: pathlib.Path) -> None:
    """Exit 1, no traceback, exactly one line that says 'No space left on device' and names the path."""
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in re.split("[\r\n]", proc.stderr) if "No space left on device" in line]  # \r: tqdm
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"saeflow {command}: error: No space left on device writing ") and str(path) in lines[0]


def assert_no_leftovers(root: pathlib.Path) -> None:
    leftovers = [p for p in root.rglob("*") if ".tmp-" in p.name or p.name.endswith(".partial")]
    assert not leftovers, leftovers


# -- shared inputs on a normal disk ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def normal(tmp_path_factory):
    """Extraction, a run, its dump and an export on a normal disk: the reference bytes and the inputs."""
    base = tmp_path_factory.mktemp("normal")
    text = {**TEST_CONFIG["activations"]["text"], "dataset": {"kind": "builtin_text", "n_ex": 512},
            "patches_per_shard": 2048}  # fmt: skip
    sae = {**TEST_CONFIG["saes"]["text-topk"], "k": 4, "expansion": 8}
    cfg_fpath = base / "config.yaml"
    cfg_fpath.write_text(yaml.safe_dump({"activations": {"text": text}, "saes": {"topk": sae}}))
    shards = pathlib.Path(ok("extract", cfg_fpath, "--shards-root", base / "shards"))
    run = pathlib.Path(ok("create-run", cfg_fpath, "--sae", "topk", "--index", 0,
                          "--shards-root", base / "shards", "--runs-root", base / "runs"))  # fmt: skip
    ok("train", "--run", run, "--device", "cpu", "--checkpoint-every", 40)
    dump = pathlib.Path(ok("inference", "--run", run, "--shards", shards, "--device", "cpu"))
    prompts_fpath = base / "prompts.jsonl"
    prompts_fpath.write_text("".join(json.dumps({**p, "text": f"{p['text']} ({i})"}) + "\n"
                                     for i in range(8) for p in PROMPTS))  # fmt: skip
    return {"base": base, "cfg": cfg_fpath, "shards": shards, "run": run, "dump": dump, "prompts": prompts_fpath}


def test_extract_on_a_full_disk(normal, tmpfs):
    root = tmpfs.mount(tree_bytes(normal["shards"]) // 2)
    proc = saeflow("extract", normal["cfg"], "--shards-root", root)
    final = root / normal["shards"].name
    assert_disk_full(proc, "extract", final)
    assert not final.exists()
    assert not [p for p in root.rglob("*") if ".tmp-" in p.name]
    tmpfs.grow(64 << 20)
    assert ok("extract", normal["cfg"], "--shards-root", root) == str(final)
    assert files_of(final) == files_of(normal["shards"])
    assert_no_leftovers(root)


def test_train_on_a_full_disk(normal, tmpfs):
    run_bytes = tree_bytes(normal["run"] / "checkpoint")
    root = tmpfs.mount(3 * run_bytes)  # resume.pt holds ~3x the weights: the second checkpoint cannot be written
    run = pathlib.Path(ok("create-run", normal["cfg"], "--sae", "topk", "--index", 0,
                          "--shards-root", normal["base"] / "shards", "--runs-root", root))  # fmt: skip
    proc = saeflow("train", "--run", run, "--device", "cpu", "--checkpoint-every", 40)
    assert_disk_full(proc, "train", run)
    sae_fpath = run / "checkpoint" / "sae.pt"
    assert not sae_fpath.exists() and not (run / "checkpoint" / "metrics.json").exists()
    assert_no_leftovers(root)
    tmpfs.grow(64 << 20)
    ok("train", "--run", run, "--device", "cpu", "--checkpoint-every", 40)
    assert files_of(run / "checkpoint") == files_of(normal["run"] / "checkpoint")
    assert_no_leftovers(root)


def test_inference_on_a_full_disk(normal, tmpfs):
    run_bytes = tree_bytes(normal["run"] / "checkpoint")
    root = tmpfs.mount(run_bytes + tree_bytes(normal["dump"]) // 2)
    run = root / normal["run"].name
    shutil.copytree(normal["run"] / "checkpoint", run / "checkpoint")
    shutil.copytree(normal["run"] / "links", run / "links", symlinks=True)
    proc = saeflow("inference", "--run", run, "--shards", normal["shards"], "--device", "cpu")
    final = run / "inference" / normal["dump"].name
    assert_disk_full(proc, "inference", final)
    assert not final.exists()
    assert_no_leftovers(root)
    tmpfs.grow(64 << 20)
    assert ok("inference", "--run", run, "--shards", normal["shards"], "--device", "cpu") == str(final)
    # config.json names the run's path; the .npz members' zip headers carry their write time (numpy's zipfile):
    # both compare by content.
    assert files_of(final, skip=SKIP_DUMP) == files_of(normal["dump"], skip=SKIP_DUMP)
    for fname in ("patch_acts.npz", "latents.npz"):
        assert npz_arrays(final / fname) == npz_arrays(normal["dump"] / fname)
    config, ref_config = (json.loads((d / "config.json").read_text()) for d in (final, normal["dump"]))
    assert {**config, "run": None} == {**ref_config, "run": None}
    assert_no_leftovers(root)


@pytest.mark.parametrize("fmt", ["lmprobe", "pickle", "zarr"])
def test_export_on_a_full_disk(normal, tmpfs, tiny_lm_dpath, fmt):
    args = ("export", "--format", fmt, "--model", tiny_lm_dpath, "--prompts", normal["prompts"], "--layers", 0, 1,
            "--no-progress")  # fmt: skip
    ref = normal["base"] / f"export-{fmt}"
    ok(*args, "--out", ref)
    skip = ("provenance.json", *(p.name for p in ref.rglob("*.parquet")))  # lmprobe: provenance in its metadata
    root = tmpfs.mount(tree_bytes(ref) // 2)
    out = root / "out"
    proc = saeflow(*args, "--out", out)
    assert_disk_full(proc, "export", root)
    if fmt == "zarr":  # a root of shard stores, each published whole; manifest.json (written last) stands for it
        assert not (out / "manifest.json").exists()
    else:
        assert not out.exists()
    assert_no_leftovers(root)
    tmpfs.grow(64 << 20)
    assert ok(*args, "--out", out) == str(out)
    assert files_of(out, skip=skip) == files_of(ref, skip=skip)
    for name in (str(p.relative_to(ref)) for p in ref.rglob("*.parquet")):
        (info, table), (ref_info, ref_table) = (lmprobe.read_info(d / name) for d in (out, ref))
        assert table == ref_table and {**info, "provenance": None} == {**ref_info, "provenance": None}
    assert_no_leftovers(root)
