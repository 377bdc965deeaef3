"""Extraction end to end: determinism, hashing, resume after a crash, errors before heavy work, CLI."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import yaml
from PIL import Image

from builders import text_spec, typed, vision_spec
from hang import HANG_SEC
from saeflow import cli
from saeflow.errors import SaeflowError
from saeflow.extraction import adapters, extract
from saeflow.store import shards
from saeflow.store.layout import ShardLayout


def _file_bytes(dpath: pathlib.Path) -> dict[str, bytes]:
    """Every file of a published directory except provenance.json (the one file that records times/hosts)."""
    return {p.name: p.read_bytes() for p in sorted(dpath.iterdir()) if p.name != "provenance.json"}


def _write_config(tmp_path, spec, name="acts") -> pathlib.Path:
    fpath = tmp_path / "config.yaml"
    fpath.write_text(yaml.safe_dump({"activations": {name: spec}, "shards_root": str(tmp_path / "cfg-shards")}))
    return fpath


def test_text_extraction_writes_tokens_and_is_reproducible(tmp_path):
    spec = text_spec("llama", dataset={"kind": "builtin_text", "n_ex": 5}, patches_per_shard=2 * 16 * 2)
    a = shards.ShardDir(extract.extract(typed(spec), tmp_path / "a", progress=False).dpath)
    b = shards.ShardDir(extract.extract(typed(spec), tmp_path / "b", progress=False).dpath)
    assert _file_bytes(a.dpath) == _file_bytes(b.dpath)
    tokens = np.array(a.aux("tokens.bin"))
    assert tokens.shape == (5, 16) and (tokens[:, 0] == 1).all()  # BOS first
    assert a.metadata.data["tokenization"]["prefix"] == [1] and len(a.shard_sizes) == 3


@pytest.mark.parametrize(
    "change",
    [
        {"layers": [1, -1]},
        {"compute_dtype": "bfloat16"},
        {"store_dtype": "float16"},
        {"context_length": 12},
        {"dataset": {"kind": "builtin_text", "n_ex": 4}},
        {"model": {"random": {"arch": "gpt2", "config": {"n_embd": 32, "n_layer": 3, "n_head": 2}, "seed": 1}}},
    ],
)
def test_anything_that_changes_bytes_changes_the_hash(change):
    base = text_spec("gpt2")
    assert extract.plan_activation(typed({**base, **change})).hash != extract.plan_activation(typed(base)).hash


def test_batch_size_and_device_are_not_hashed():
    batch_1 = extract.plan_activation(typed(vision_spec(batch_size=1)))
    assert batch_1.hash == extract.plan_activation(typed(vision_spec())).hash


def test_different_datasets_differ(tmp_path):
    seed1 = vision_spec(dataset={"kind": "generated_images", "n_ex": 10, "seed": 1, "size": 40})
    assert extract.plan_activation(typed(seed1)).hash != extract.plan_activation(typed(vision_spec())).hash
    for name in ("x", "y"):
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(_mkdir(tmp_path / name / "c") / "0.png")
    hashes = {
        extract.plan_activation(typed(vision_spec(dataset={"kind": "image_folder", "root": str(tmp_path / n)}))).hash
        for n in ("x", "y")
    }
    assert len(hashes) == 2


def test_a_shard_hash_covers_the_corpus_content_and_its_real_absolute_path(tmp_path):
    """What README and docs/contracts.md say a shard hash covers (issue 40): the corpus' content fingerprint and its
    absolute path with symlinks resolved (the saev protocol's `dataset`, repeated as `data.path`). A copy of the
    corpus elsewhere is another directory; a symlink to the corpus is the corpus; a symlink at the same place to a
    copy is the copy. So two machines share hashes when the corpus is at the same real path on both."""
    import shutil

    corpus = _mkdir(tmp_path / "laptop" / "docs")
    (corpus / "a.txt").write_text("The same words on both machines. " * 8)

    def metadata(path: pathlib.Path) -> dict:
        return extract.plan_activation(typed(text_spec(dataset={"kind": "text", "path": str(path)}))).to_dict()

    here = metadata(corpus)
    assert here["dataset"] == here["data"]["path"] == str(corpus.resolve())
    copy = pathlib.Path(shutil.copytree(corpus, tmp_path / "osc" / "docs"))
    moved = metadata(copy)
    assert shards.Metadata.from_dict(moved).hash != shards.Metadata.from_dict(here).hash
    assert moved["data"]["sha256"] == here["data"]["sha256"]  # the same content: only the path differs
    assert {**moved, "dataset": here["dataset"], "data": {**moved["data"], "path": here["dataset"]}} == here
    (tmp_path / "link").symlink_to(corpus)
    assert metadata(tmp_path / "link") == here  # resolved: the symlinked corpus is the corpus
    (tmp_path / "link-to-copy").symlink_to(copy)
    assert metadata(tmp_path / "link-to-copy") == moved


def _mkdir(dpath: pathlib.Path) -> pathlib.Path:
    dpath.mkdir(parents=True, exist_ok=True)
    return dpath


class _Crash(Exception):
    pass


def test_killed_extraction_resumes_to_identical_bytes(tmp_path, monkeypatch):
    spec = vision_spec(batch_size=2)  # 3 examples per shard, batches never cross a shard
    clean = extract.extract(typed(spec), tmp_path / "clean", progress=False)

    real_run = adapters.Adapter.run_points
    calls = []

    def crashing_run(self, batch, points):
        calls.append(1)
        if len(calls) == 5:  # mid-way through the third shard
            raise _Crash
        return real_run(self, batch, points)

    monkeypatch.setattr(adapters.Adapter, "run_points", crashing_run)
    with pytest.raises(_Crash):
        extract.extract(typed(spec), tmp_path / "crashy", progress=False)
    final = tmp_path / "crashy" / clean.dpath.name
    staging = tmp_path / "crashy" / f".{clean.dpath.name}.partial"
    assert not final.exists() and staging.exists()
    monkeypatch.setattr(adapters.Adapter, "run_points", real_run)
    resumed = extract.extract(typed(spec), tmp_path / "crashy", progress=False)
    assert resumed.resumed_from == 6 and not staging.exists()
    assert _file_bytes(resumed.dpath) == _file_bytes(clean.dpath)
    assert json.loads((resumed.dpath / "provenance.json").read_text())["resumed_from_ex"] == 6


def test_ctrl_c_says_what_was_kept_and_how_to_resume(tmp_path, monkeypatch, capsys):
    """Issue 25: Ctrl-C in `saeflow extract` ended with "interrupted" alone; it says how many complete shards were
    kept, where, and how to resume, and the same command then resumes there to the same bytes."""
    import signal

    from test_preempt import _signal_self_at

    # 3 examples per shard, 2 batches each: batch 4 would end shard 1 (one layer: the CLI's directories are per layer)
    spec = vision_spec(batch_size=2, layers=[-1], patches_per_shard=17 * 3)
    clean = extract.extract(typed(spec), tmp_path / "clean", progress=False)
    config_fpath = tmp_path / "config.yaml"
    config_fpath.write_text(yaml.safe_dump({"shards_root": str(tmp_path / "root"), "activations": {"a": spec}}))
    restore = _signal_self_at(monkeypatch, adapters.Adapter, "run_points", 4, signal.SIGINT)  # a real Ctrl-C
    # As in a terminal's foreground job: a suite started in the background by a script (no job control) inherits
    # SIGINT ignored, and Python then keeps it ignored (issue 28's side-by-side runs).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert cli.main(["extract", str(config_fpath), "--no-progress"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    staging = tmp_path / "root" / f".{clean.dpath.name}.partial"
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"saeflow extract: interrupted: 1 complete shard kept in {staging}; rerun the same command to resume"
    )
    restore()
    assert cli.main(["extract", str(config_fpath), "--no-progress"]) == 0
    assert "resumed from example 3" in capsys.readouterr().err
    assert _file_bytes(tmp_path / "root" / clean.dpath.name) == _file_bytes(clean.dpath)


def test_a_job_that_plans_another_hash_than_the_workflow_stops_before_the_model_runs(tmp_path, monkeypatch, capsys):
    """The rules pass the hash they planned (--expect-hash), so saeflow checks it, before any work, instead of the
    rule's shell script after the extraction (one command per rule: a failed job shows one line of shell)."""
    config_fpath = tmp_path / "config.yaml"
    config_fpath.write_text(yaml.safe_dump({"activations": {"a": vision_spec()}}))
    monkeypatch.setattr(adapters, "load", lambda *a, **kw: pytest.fail("the model was loaded"))
    argv = ["extract", str(config_fpath), "--shards-root", str(tmp_path / "root"), "--expect-hash", "0" * 64]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"saeflow extract: error: the workflow planned shard directory {'0' * 64}, but this job")
    assert not (tmp_path / "root").exists()


def test_batches_restart_at_every_shard():
    assert extract.batches(7, 3, 2, 0) == [(0, 2), (2, 3), (3, 5), (5, 6), (6, 7)]
    assert extract.batches(7, 3, 2, 3) == [(3, 5), (5, 6), (6, 7)]


# -- errors before heavy work -----------------------------------------------------------------------------------


def _assert_nothing_published(root: pathlib.Path):
    assert not root.exists() or not [p for p in root.iterdir() if not p.name.startswith(".")]


def test_context_length_over_model_limit(tmp_path):
    with pytest.raises(SaeflowError, match=r"context_length=65 is larger than .* allows \(64 positions\)"):
        extract.extract(typed(text_spec(context_length=65)), tmp_path / "s", progress=False)
    _assert_nothing_published(tmp_path / "s")


def test_unreadable_image_fails_before_the_model_loads(tmp_path, monkeypatch):
    root = tmp_path / "imgs"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(_mkdir(root / "a") / "ok.png")
    (root / "a" / "bad.jpg").write_bytes(b"\xff\xd8 truncated")
    monkeypatch.setattr(adapters, "load", lambda *a, **k: pytest.fail("the model must not load"))
    with pytest.raises(SaeflowError, match=r"bad.jpg: unreadable image"):
        spec = typed(vision_spec(dataset={"kind": "image_folder", "root": str(root)}))
        extract.extract(spec, tmp_path / "s", progress=False)
    _assert_nothing_published(tmp_path / "s")


@pytest.mark.parametrize(
    "spec, message",
    [
        (vision_spec(dataset={"kind": "text", "path": "/nonexistent/corpus.txt"}), "a vision model"),
        (text_spec(dataset={"kind": "generated_images"}), "is a text model"),
        (text_spec(tokenizer=None), "has no tokenizer of its own"),
        (vision_spec(model={"name": "/nonexistent/model"}), "model /nonexistent/model: no such directory"),
        (vision_spec(layers=[7]), "out of range"),
        (vision_spec(dataset={"kind": "generated_images", "n_ex": 0}), "n_ex"),
        ({"model": {"random": {"arch": "vit"}}, "dataset": {"kind": "text"}}, "'path' is a required property"),
    ],
)
def test_bad_specs_are_clear_errors(spec, message):
    with pytest.raises(SaeflowError, match=message):
        extract.plan_activation(typed(spec))


def test_text_field_missing(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"body": "hello"}\n')
    with pytest.raises(SaeflowError, match=r"c.jsonl:1: no string field 'text'"):
        extract.plan_activation(typed(text_spec(dataset={"kind": "text", "path": str(tmp_path / "c.jsonl")})))


def test_a_corpus_too_short_for_one_example_is_named_in_one_line(tmp_path):
    """Issue 25: an empty corpus said "the corpus has 1 tokens: 0 examples of 30 tokens (empty dataset)"; the line
    names the corpus file(s) and says they hold no (or too little) text for one example of N tokens."""
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(SaeflowError) as err:
        extract.plan_activation(typed(text_spec(dataset={"kind": "text", "path": str(tmp_path / "e.txt")})))
    assert str(err.value) == (f"dataset.path {tmp_path / 'e.txt'} holds no text: not one example of 15 tokens "
                              "(context_length 16 less 1 special tokens)")  # fmt: skip
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(["hi", "", "yo", " "]):
        (corpus / f"doc{i}.txt").write_text(text)
    with pytest.raises(SaeflowError) as err:
        extract.plan_activation(typed(text_spec(dataset={"kind": "text", "path": str(corpus)})))
    assert str(err.value) == (f"dataset.path {corpus} (doc0.txt, doc1.txt, doc2.txt and 1 more) holds only 5 "
                              "tokens of text: too little for one example of 15 tokens (context_length 16 less 1 "
                              "special tokens)")  # fmt: skip


def test_tokenizer_model_vocab_mismatch():
    small_vocab = {"random": {"arch": "gpt2", "config": {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 100}}}
    with pytest.raises(SaeflowError, match="vocabulary of 100"):
        extract.plan_activation(typed(text_spec(model=small_vocab)))


# -- CLI --------------------------------------------------------------------------------------------------------


def test_cli_plan_and_extract(tmp_path, capsys):
    spec = vision_spec()
    config_fpath = _write_config(tmp_path, spec)
    assert cli.main(["plan", str(config_fpath), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    # a directory per layer (issue 40), each what the spec of that layer alone plans
    assert [d["metadata"]["layers"] for d in planned["directories"]] == [[0], [2]] and "hash" not in planned
    assert [d["hash"] for d in planned["directories"]] == [
        extract.plan_activation(typed({**spec, "layers": [layer]})).hash for layer in (0, 2)]
    assert cli.main(["extract", str(config_fpath), "--no-progress"]) == 0
    out = capsys.readouterr()
    assert out.out.split() == [str(tmp_path / "cfg-shards" / d["hash"]) for d in planned["directories"]]
    assert cli.main(["extract", str(config_fpath), "--activation", "acts", "--no-progress"]) == 0
    assert "nothing to do" in capsys.readouterr().err
    assert cli.main(["plan", str(config_fpath), "--activation", "nope"]) == 1
    assert "no activation named 'nope'" in capsys.readouterr().err


def test_segmentation_labels_reach_labels_bin_and_image_folder_classes_reach_classes_bin(tmp_path):
    mask = np.zeros((32, 32), np.uint8)
    mask[:16, :16] = 3  # the top-left quadrant: patches (0,0),(0,1),(1,0),(1,1) of the 4x4 grid
    for stem in ("a", "b"):
        Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(_mkdir(tmp_path / "seg" / "images") / f"{stem}.png")
        Image.fromarray(mask).save(_mkdir(tmp_path / "seg" / "masks") / f"{stem}.png")
    spec = vision_spec(dataset={"kind": "segmentation_folder", "root": str(tmp_path / "seg")})
    sd = shards.ShardDir(extract.extract(typed(spec), tmp_path / "s", progress=False).dpath)
    expected = np.zeros((4, 4), np.uint8)
    expected[:2, :2] = 3
    assert np.array_equal(np.array(sd.aux("labels.bin")), np.stack([expected.ravel()] * 2))
    assert sd.metadata.dataset == str(tmp_path / "seg") and sd.metadata.data["label_rule"] == "majority"

    for cls in ("ant", "bee"):
        Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(_mkdir(tmp_path / "cls" / cls) / "0.png")
    spec = vision_spec(dataset={"kind": "image_folder", "root": str(tmp_path / "cls")})
    sd = shards.ShardDir(extract.extract(typed(spec), tmp_path / "s", progress=False).dpath)
    assert np.array(sd.aux(ShardLayout.CLASSES_FNAME)).tolist() == [0, 1] and not sd.has_aux("labels.bin")
    assert sd.metadata.data["classes"] == ["ant", "bee"]


SLOW_CHILD = """
import sys, time
from saeflow import cli
from saeflow.extraction import adapters
real_run = adapters.Adapter.run_points
def slow_run(self, batch, points):
    time.sleep(0.3)  # slow enough that the parent can SIGKILL us mid-extraction
    return real_run(self, batch, points)
adapters.Adapter.run_points = slow_run
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_same_config_in_two_processes_after_sigkill_is_byte_identical(tmp_path):
    """A SIGKILLed extraction resumes in another process; the result equals one uninterrupted run, byte for byte."""
    import signal
    import time

    spec = vision_spec(batch_size=2, layers=[-1], patches_per_shard=17 * 3)  # one layer: the CLI's directory
    config_fpath = _write_config(tmp_path, spec)
    md = extract.plan_activation(typed(spec))
    staging = tmp_path / "killed" / f".{md.hash}.partial"
    child = subprocess.Popen(
        [sys.executable, "-c", SLOW_CHILD, "extract", str(config_fpath), "--shards-root", str(tmp_path / "killed"),
         "--no-progress"],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + HANG_SEC
        while time.monotonic() < deadline and child.poll() is None:
            try:
                if json.loads((staging / "progress.json").read_text())["completed"]:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL and not (tmp_path / "killed" / md.hash).exists()
    resumed = extract.extract(typed(spec), tmp_path / "killed", progress=False)  # finishes the child's work
    clean = extract.extract(typed(spec), tmp_path / "clean", progress=False)
    again = extract.extract(typed(spec), tmp_path / "clean", progress=False)
    assert 3 <= resumed.resumed_from < md.n_ex and not clean.reused and again.reused
    assert resumed.dpath.name == clean.dpath.name == md.hash
    assert _file_bytes(resumed.dpath) == _file_bytes(clean.dpath)  # shards written by two processes, same bytes
    assert shards.validate(resumed.dpath, deep=True).ok
    assert str(tmp_path) not in (clean.dpath / "metadata.json").read_text()  # no output paths in the hash


def test_worker_processes_and_float16_storage(tmp_path):
    """Decoding in DataLoader workers gives the same bytes (n_workers is not hashed); float16 storage is opt-in."""
    serial = extract.extract(typed(vision_spec()), tmp_path / "serial", progress=False)
    parallel = extract.extract(typed(vision_spec(n_workers=2)), tmp_path / "parallel", progress=False)
    assert parallel.dpath.name == serial.dpath.name
    assert _file_bytes(parallel.dpath) == _file_bytes(serial.dpath)
    half_dpath = extract.extract(typed(vision_spec(store_dtype="float16")), tmp_path / "half", progress=False).dpath
    half = shards.ShardDir(half_dpath)
    full = shards.ShardDir(serial.dpath)
    assert half.acts(0).dtype == np.float16
    np.testing.assert_allclose(half.example(4, 2), full.example(4, 2), rtol=1e-3, atol=1e-3)
