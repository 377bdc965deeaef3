"""Real-scale inputs (issue 10): ImageNet-style folders of any class count, dataset fingerprints and their cache."""

import json
import os
import shutil

import numpy as np
import pytest
import yaml
from PIL import Image

from builders import ARCH_CONFIGS, MINILM, TINY_TEXT, text_spec, typed, vision_spec
from saeflow import cli
from saeflow.errors import SaeflowError
from saeflow.extraction import adapters, extract, fingerprints, models, tokenization
from saeflow.extraction.extract import plan_activation
from saeflow.store import shards
from saeflow.store.layout import ShardLayout
from workflow_helpers import snakemake, write_config

N_CLASSES = 1000


def _mkdir(dpath):
    dpath.mkdir(parents=True, exist_ok=True)
    return dpath


def _image_folder(root, n_classes: int, per_class: int = 1, size: int = 8):
    rng = np.random.default_rng(0)
    for c in range(n_classes):
        (root / f"n{c:08d}").mkdir(parents=True)
        for j in range(per_class):
            pixels = rng.integers(0, 256, (size, size + 3 * j, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"n{c:08d}" / f"{j}.png")
    return root


@pytest.mark.slow
def test_a_1000_class_folder_plans_and_extracts_through_the_workflow(tmp_path):
    root = _image_folder(tmp_path / "imagenet", N_CLASSES)
    vit = dict(ARCH_CONFIGS["vit"], image_size=16, patch_size=8)
    cfg = {
        "shards_root": "shards",
        "runs_root": "runs",
        "summary_dir": "summary",
        "activations": {
            "in1k": {
                "model": {"random": {"arch": "vit", "config": vit, "seed": 0}},
                "layers": [-1],
                "dataset": {"kind": "image_folder", "root": str(root)},
                "batch_size": 250,
                "device": "cpu",
            }
        },
        "saes": {},
    }
    config_fpath = write_config(tmp_path, cfg)
    md = plan_activation(typed(cfg["activations"]["in1k"]))  # what the Snakefile plans at parse time
    assert md.n_ex == N_CLASSES and md.data["classes"][-1] == f"n{N_CLASSES - 1:08d}"
    target = ShardLayout.at(tmp_path / "shards", md.hash).shards_fpath
    snakemake(tmp_path, config_fpath, str(target.relative_to(tmp_path)))
    sd = shards.ShardDir(target.parent)
    assert sd.hash == md.hash and not sd.has_aux(ShardLayout.LABELS_FNAME)  # labels.bin stays per-patch labels
    assert np.array(sd.aux(ShardLayout.CLASSES_FNAME)).tolist() == list(range(N_CLASSES))
    assert shards.validate(target.parent, deep=True).problems == []
    checksums = json.loads(ShardLayout.at(tmp_path / "shards", md.hash).checksums_fpath.read_text())
    assert ShardLayout.CLASSES_FNAME in checksums["files"]


# ---------------------------------------------------------------------------------------------------------------
# Dataset identity: content fingerprints and their cache
# ---------------------------------------------------------------------------------------------------------------


def _plan_hash(dataset: dict, text: bool = False) -> str:
    spec = text_spec(dataset=dataset) if text else vision_spec(dataset=dataset)
    return plan_activation(typed(spec)).hash


def _same_size_edit(fpath, offset: int) -> None:
    data = bytearray(fpath.read_bytes())
    data[offset] ^= 0x01
    fpath.write_bytes(bytes(data))


def _touch_later(fpath) -> None:
    st = fpath.stat()
    os.utime(fpath, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


def _cases(tmp_path):
    """(dataset, text?, file to edit, byte offset of the edit) for an image folder and a JSONL corpus."""
    root = _image_folder(tmp_path / "imgs", n_classes=3, per_class=2)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i} of the corpus " * 8}) + "\n" for i in range(40)))
    line_3 = len("".join(corpus.read_text().splitlines(keepends=True)[:3])) + 12  # a letter inside line 4
    for fpath in [*root.rglob("*.png"), corpus]:  # settled files (not modified in the last seconds)
        os.utime(fpath, ns=(fpath.stat().st_atime_ns, fpath.stat().st_mtime_ns - 3600 * 10**9))
    return [
        ({"kind": "image_folder", "root": str(root)}, False, root / "n00000001" / "1.png", -20),
        ({"kind": "text", "path": str(corpus)}, True, corpus, line_3),
    ]


def test_same_size_edit_changes_the_hash_touch_does_not_and_the_cache_is_not_part_of_it(tmp_path, monkeypatch):
    for dataset, text, fpath, offset in _cases(tmp_path):
        first = _plan_hash(dataset, text)
        _touch_later(fpath)
        assert _plan_hash(dataset, text) == first  # mtime alone: re-hashed, same content, same hash
        shutil.rmtree(fingerprints.cache_dpath())
        assert _plan_hash(dataset, text) == first  # a machine without the cache computes the same hash
        size = fpath.stat().st_size
        _same_size_edit(fpath, offset)
        assert fpath.stat().st_size == size
        edited = _plan_hash(dataset, text)
        assert edited != first  # the stat changed, so the file was read again
        _same_size_edit(fpath, offset)  # undo: the content, and so the hash, is the first one again
        assert _plan_hash(dataset, text) == first


def test_a_replan_stats_files_and_reads_none(tmp_path, monkeypatch):
    cases = _cases(tmp_path)
    for dataset, text, _, _ in cases:
        _plan_hash(dataset, text)
    monkeypatch.setattr(fingerprints, "_hash_files", lambda *a, **k: pytest.fail("a file was read again"))
    monkeypatch.setattr(tokenization, "tokenize", lambda *a, **k: pytest.fail("the corpus was tokenized again"))
    for dataset, text, _, _ in cases:
        _plan_hash(dataset, text)


def test_an_edit_that_keeps_size_mtime_and_inode_is_seen_while_the_file_is_recent(tmp_path):
    """Git's racy-clean rule: a second same-size write within the file system's timestamp granularity leaves the
    stat as it was; a file that recent is read again at every plan until it settles."""
    fpath = tmp_path / "d" / "a.txt"
    fpath.parent.mkdir()
    fpath.write_bytes(b"abcd")
    first = fingerprints.of_files(tmp_path, [fpath.parent], (".txt",))
    st = fpath.stat()
    fpath.write_bytes(b"abce")
    os.utime(fpath, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, mtime and inode as when it was hashed
    assert fpath.stat().st_ino == st.st_ino
    assert fingerprints.of_files(tmp_path, [fpath.parent], (".txt",)).sha256 != first.sha256


# ---------------------------------------------------------------------------------------------------------------
# Faithful preprocessing: the checkpoint's own image processor
# ---------------------------------------------------------------------------------------------------------------

PROCESSORS = {  # arch -> (processor class, its settings for a 32 px model with 8 px patches)
    "vit": ("ViTImageProcessor", {"size": {"height": 32, "width": 32}}),
    "clip_vision_model": (
        "CLIPImageProcessor", {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}}
    ),
    "siglip_vision_model": ("SiglipImageProcessor", {"size": {"height": 32, "width": 32}}),
    "dinov2": ("BitImageProcessor", {"size": {"shortest_edge": 40}, "crop_size": {"height": 32, "width": 32}}),
}
SIZES = [(37, 61), (61, 23), (90, 44), (33, 33)]  # (width, height): non-square, up- and down-scaled


def _checkpoint_with_processor(dpath, arch: str):
    import transformers

    spec = models.ModelSpec(random_arch=arch, random_config=ARCH_CONFIGS[arch])
    model = adapters.build(models.describe(spec), spec).eval()
    model.save_pretrained(dpath)
    cls_name, settings = PROCESSORS[arch]
    getattr(transformers, cls_name)(**settings).save_pretrained(dpath)
    return model


@pytest.mark.parametrize("arch", sorted(PROCESSORS))
def test_stored_activations_equal_the_model_under_its_own_processor(arch, tmp_path):
    import torch
    import transformers

    model = _checkpoint_with_processor(tmp_path / "ckpt", arch)
    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in SIZES]
    for i, img in enumerate(images):
        img.save(_mkdir(tmp_path / "imgs" / "c") / f"{i}.png")
    spec = vision_spec(arch, model={"name": str(tmp_path / "ckpt")}, dataset={"kind": "image_folder",
                       "root": str(tmp_path / "imgs")})  # fmt: skip
    sd = shards.ShardDir(extract.extract(typed(spec), tmp_path / "s", progress=False).dpath)
    assert sd.metadata.data["preprocess"]["settings"]["image_processor_type"] == PROCESSORS[arch][0]
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "ckpt")  # the reference, as HF runs it
    with torch.no_grad():
        hidden = model(**processor(images=images, return_tensors="pt"), output_hidden_states=True).hidden_states
    assert len(sd.metadata.layers) == 2
    for layer in sd.metadata.layers:
        stored = torch.from_numpy(np.stack([sd.example(i, layer) for i in range(len(images))]))
        assert (stored - hidden[layer + 1]).abs().max() < 1e-5, (arch, layer)

    resize_crop = dict(spec, dataset={**spec["dataset"], "preprocess": "resize_crop"})  # the old rule, explicitly
    md = plan_activation(typed(resize_crop))
    assert md.hash != sd.hash and md.data["preprocess"].get("mode") is None


# ---------------------------------------------------------------------------------------------------------------
# Faithful tokenization: the checkpoint's own tokenizer, one rule for extract and export
# ---------------------------------------------------------------------------------------------------------------

DOC = "def mean(xs):\n    return sum(xs) / len(xs)  # the cat sat on the mat, Déjà vu! " * 6
TOKENIZER_ARCHS = ("gpt2", "llama", "qwen2", "bert")
TEXT_CONFIGS = {"qwen2": dict(TINY_TEXT, num_key_value_heads=1, max_position_embeddings=64)}


def _bpe(corpus: list[str]):
    import tokenizers

    bpe = tokenizers.ByteLevelBPETokenizer()
    special = ["<|endoftext|>", "<s>", "</s>"]
    bpe.train_from_iterator(corpus, vocab_size=280, special_tokens=special, show_progress=False)
    return bpe._tokenizer


def _tokenizer_for(arch: str):
    """A tiny tokenizer of each family, built offline, as its transformers class saves it."""
    import tokenizers
    import transformers

    if arch == "bert":
        return transformers.AutoTokenizer.from_pretrained(MINILM)  # a real WordPiece [CLS] ... [SEP] tokenizer
    tk = _bpe([DOC, "hello world " * 50])
    if arch == "gpt2":
        return transformers.GPT2Tokenizer(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    if arch == "qwen2":
        return transformers.Qwen2Tokenizer(tokenizer_object=tk, eos_token="<|endoftext|>")
    tk.post_processor = tokenizers.processors.TemplateProcessing(  # Llama: BOS before every sequence
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tk.token_to_id("<s>"))]
    )
    return transformers.LlamaTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("arch", TOKENIZER_ARCHS)
def test_stored_and_exported_ids_equal_autotokenizer(arch, tmp_path):
    import transformers

    from saeflow.interop import engine

    config = dict(TEXT_CONFIGS.get(arch, ARCH_CONFIGS.get(arch, {})), vocab_size=31_000 if arch == "bert" else 300)
    spec = models.ModelSpec(random_arch=arch, random_config=config)
    adapters.build(models.describe(spec), spec).save_pretrained(tmp_path / "ckpt")
    _tokenizer_for(arch).save_pretrained(tmp_path / "ckpt")
    (tmp_path / "doc.txt").write_text(DOC)
    context_length = 24
    act = text_spec(model={"name": str(tmp_path / "ckpt")}, tokenizer=None, context_length=context_length,
                    dataset={"kind": "text", "path": str(tmp_path / "doc.txt"), "n_ex": 2})  # fmt: skip
    sd = shards.ShardDir(extract.extract(typed(act), tmp_path / "s", progress=False).dpath)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    expected = reference(DOC, truncation=True, max_length=context_length)["input_ids"]
    assert np.array(sd.aux(ShardLayout.TOKENS_FNAME))[0].tolist() == expected  # the first example: one document
    cfg = engine.EngineConfig.defaults(model=str(tmp_path / "ckpt"), layers=(0,), max_tokens=context_length)
    assert engine.TextEngine(cfg).tokenize(DOC) == expected  # export encodes by the same rule


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face `datasets` as an input
# ---------------------------------------------------------------------------------------------------------------


def _extract_through_config(tmp_path, name: str, spec: dict):
    config_fpath = tmp_path / f"{name}.yaml"
    config_fpath.write_text(yaml.safe_dump({"shards_root": str(tmp_path / "shards"), "activations": {name: spec}}))
    assert cli.main(["extract", str(config_fpath), "--activation", name, "--no-progress"]) == 0
    last = extract.plan_units(typed(spec))[-1]  # a directory per layer: the last one's
    return shards.ShardDir(tmp_path / "shards" / plan_activation(last).hash)


def test_hf_datasets_saved_to_disk_extract_through_a_config_and_are_hashed_by_content(tmp_path):
    import datasets as hf

    docs = [f"document {i}: " + "the cat sat on the mat. " * 5 for i in range(12)]
    hf.Dataset.from_dict({"body": docs, "id": list(range(12))}).save_to_disk(tmp_path / "text-ds")
    text = text_spec(dataset={"kind": "hf_dataset", "path": str(tmp_path / "text-ds"), "text_column": "body"})
    sd = _extract_through_config(tmp_path, "text", text)
    packing = extract.plan(typed(text)).packing
    ids_nt = packing.pack(tokenization.tokenize(tokenization.ByteTokenizer(), docs))
    assert np.array_equal(np.array(sd.aux(ShardLayout.TOKENS_FNAME)), ids_nt[: sd.n_ex])

    rng = np.random.default_rng(2)
    pictures = [Image.fromarray(rng.integers(0, 256, (20 + 3 * i, 30, 3), dtype=np.uint8)) for i in range(5)]
    features = hf.Features({"img": hf.Image(), "label": hf.ClassLabel(names=["ant", "bee", "cat"])})
    table = {"img": pictures, "label": [2, 0, 1, 1, 0]}
    hf.Dataset.from_dict(table, features=features).save_to_disk(tmp_path / "image-ds")
    images = vision_spec(dataset={"kind": "hf_dataset", "path": str(tmp_path / "image-ds"), "image_column": "img",
                                  "label_column": "label"})  # fmt: skip
    sd = _extract_through_config(tmp_path, "images", images)
    assert sd.n_ex == 5 and np.array(sd.aux(ShardLayout.CLASSES_FNAME)).tolist() == [2, 0, 1, 1, 0]

    for spec, dpath, write in (
        (text, tmp_path / "text-ds", lambda d: hf.Dataset.from_dict({"body": [*docs[:-1], docs[-1].upper()],
                                                                     "id": list(range(12))}).save_to_disk(d)),
        (images, tmp_path / "image-ds", lambda d: hf.Dataset.from_dict({**table, "label": [2, 0, 1, 1, 1]},
                                                                       features=features).save_to_disk(d)),
    ):  # fmt: skip
        before = plan_activation(typed(spec)).hash
        write(tmp_path / "rewritten")
        shutil.rmtree(dpath)
        (tmp_path / "rewritten").rename(dpath)
        assert plan_activation(typed(spec)).hash != before  # one changed row: another shard directory


def _settle(root) -> None:
    """Every file and directory below `root` (and itself) last modified an hour ago: old enough to be trusted."""
    for path in [root, *root.rglob("*")]:
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - 3600 * 10**9))


def test_auto_rechecks_a_big_folder_by_directory_and_extract_refuses_an_in_place_rewrite(tmp_path, monkeypatch, capsys):
    """The default recheck (auto): a dataset of AUTO_DIRECTORIES_FILES files or more (the limit lowered to 6 here: 3
    classes of 2 images) is re-planned by its directories, so an in-place rewrite keeps the planned hash; `saeflow
    extract`, about to read the files, stats every one and refuses that plan in one line, before the model runs,
    publishing nothing. Below the limit a re-plan stats every file and sees the rewrite."""
    monkeypatch.setenv(fingerprints.RECHECK_ENV, "auto")
    monkeypatch.setattr(fingerprints, "AUTO_DIRECTORIES_FILES", 6)
    root = _image_folder(tmp_path / "imgs", n_classes=3, per_class=2)
    spec = vision_spec(dataset={"kind": "image_folder", "root": str(root)})
    _settle(root)
    first = _plan_hash(spec["dataset"])
    with monkeypatch.context() as patched:
        patched.setattr(fingerprints, "listing", lambda *a, **k: pytest.fail("the folder was listed again"))
        assert _plan_hash(spec["dataset"]) == first
    Image.fromarray(np.zeros((8, 11, 3), np.uint8)).save(root / "n00000001" / "1.png")  # same name, same inode
    assert _plan_hash(spec["dataset"]) == first  # the directories are unchanged
    config_fpath = write_config(tmp_path, {"shards_root": str(tmp_path / "shards"), "activations": {"imgs": spec}})
    monkeypatch.setattr(adapters, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert cli.main(["extract", str(config_fpath), "--expect-hash", first, "--no-progress"]) != 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"planned shard directory {first}, but this job plans " in line and "RECHECK=files once" in line, line
    assert not (tmp_path / "shards").exists() or not any((tmp_path / "shards").iterdir())
    monkeypatch.setenv(fingerprints.RECHECK_ENV, "auto")
    monkeypatch.setattr(fingerprints, "AUTO_DIRECTORIES_FILES", 7)  # a small dataset now: every file is stat'ed
    assert _plan_hash(spec["dataset"]) != first


def test_the_directories_recheck_sees_files_added_removed_or_renamed_but_not_rewritten_in_place(tmp_path, monkeypatch):
    """SAEFLOW_FINGERPRINT_RECHECK=directories (datasets whose files are never rewritten in place): a re-plan stats
    the directories, not the files, so it lists nothing while they are unchanged; an added, removed or renamed file
    changes its directory and the folder is listed again. An in-place rewrite is the price: seen only by the
    `files` recheck."""
    monkeypatch.setenv(fingerprints.RECHECK_ENV, "directories")
    root = _image_folder(tmp_path / "imgs", n_classes=3, per_class=2)
    dataset = {"kind": "image_folder", "root": str(root)}
    _settle(root)
    first = _plan_hash(dataset)
    with monkeypatch.context() as patched:
        patched.setattr(fingerprints, "listing", lambda *a, **k: pytest.fail("the folder was listed again"))
        assert _plan_hash(dataset) == first
    extra = root / "n00000001" / "9.png"
    shutil.copyfile(root / "n00000000" / "0.png", extra)
    assert _plan_hash(dataset) != first
    extra.unlink()
    assert _plan_hash(dataset) == first
    (root / "n00000001" / "1.png").rename(root / "n00000001" / "2.png")
    assert _plan_hash(dataset) != first
    (root / "n00000001" / "2.png").rename(root / "n00000001" / "1.png")
    _settle(root)
    assert _plan_hash(dataset) == first
    _same_size_edit(root / "n00000001" / "1.png", -20)
    assert _plan_hash(dataset) == first  # not seen: the directories are unchanged
    monkeypatch.setenv(fingerprints.RECHECK_ENV, "files")
    assert _plan_hash(dataset) != first
    monkeypatch.setenv(fingerprints.RECHECK_ENV, "stat")
    with pytest.raises(SaeflowError, match="SAEFLOW_FINGERPRINT_RECHECK='stat': not a recheck mode; choose one of"):
        _plan_hash(dataset)
