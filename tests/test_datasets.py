"""Datasets: patch labels, generated images, text readers, packing, clear errors on bad input."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from saeflow.errors import SaeflowError
from saeflow.extraction import datasets, tokenization


def test_patch_labels_majority_and_prefer_foreground():
    m_hw = np.zeros((4, 4), np.uint8)
    m_hw[0, 0] = 3  # one foreground pixel in the top-left 2x2 patch
    m_hw[2:, 2:] = 7  # the bottom-right patch is all 7
    m_hw[2, 0:2] = 5  # half of the bottom-left patch is 5: tie with 0 goes to the smaller label
    assert datasets.patch_labels(m_hw, 2, "majority", 0).tolist() == [0, 0, 0, 7]
    assert datasets.patch_labels(m_hw, 2, "prefer_foreground", 0).tolist() == [3, 0, 5, 7]


def test_generated_images_are_deterministic_and_seeded():
    a, b, c = (datasets.GeneratedImages(n_ex=3, seed=s, size=32) for s in (0, 0, 1))
    img_a, mask_a = a.image(2)
    img_b, mask_b = b.image(2)
    assert np.array_equal(img_a, img_b) and np.array_equal(mask_a, mask_b)
    assert not np.array_equal(img_a, c.image(2)[0])
    assert set(np.unique(mask_a)) <= {0, 1, 2} and img_a.shape == (32, 32, 3)


def test_preprocess_resizes_crops_and_normalizes():
    pre = datasets.Preprocess(resize_size=16, image_size=16, patch_size=8, mean=(0.5,) * 3, std=(0.5,) * 3)
    img = Image.fromarray(np.full((20, 40, 3), 255, np.uint8))
    x = pre.pixels(img)
    assert x.shape == (3, 16, 16) and np.allclose(x, 1.0)
    mask = Image.fromarray(np.tile(np.arange(40, dtype=np.uint8) // 20, (20, 1)))  # left half 0, right half 1
    assert pre.patch_labels(mask).tolist() == [0, 1, 0, 1]


def test_packing_is_fixed_length_with_bos_and_separators():
    packing = tokenization.packing_for(tokenization.ByteTokenizer(), "bytes", 4, encoder=False)
    ids = packing.pack(tokenization.tokenize(tokenization.ByteTokenizer(), ["ab", "cdef"]))
    # stream: a b EOS c d e f EOS -> bodies of 3: [a b EOS] [c d e]; the partial [f EOS] is dropped
    a, b, c, d, e = (ord(ch) + 3 for ch in "abcde")
    assert ids.tolist() == [[1, a, b, 2], [1, c, d, e]] and ids.dtype == np.int32
    assert packing.pack(tokenization.tokenize(tokenization.ByteTokenizer(), ["ab", "cdef"]), n_ex=1).shape == (1, 4)
    with pytest.raises(SaeflowError, match=r"^holds 6 tokens of text: 2 examples of 3 tokens \(context_length 4 "
                       r"less 1 special tokens\), fewer than n_ex=3$"):  # fmt: skip
        packing.pack(tokenization.tokenize(tokenization.ByteTokenizer(), ["ab", "cdef"]), n_ex=3)
    with pytest.raises(SaeflowError, match="^holds no text: not one example of 3 tokens"):
        packing.pack(tokenization.tokenize(tokenization.ByteTokenizer(), [""]))


def test_encoder_packing_uses_cls_and_sep():
    class Tok:  # adds [CLS] ... [SEP] like BERT's tokenizer
        cls_token_id, sep_token_id, bos_token_id, eos_token_id = 101, 102, None, None

        def __call__(self, text, add_special_tokens=True):
            ids = [7] * len(text.split())
            return {"input_ids": [101, *ids, 102] if add_special_tokens else ids}

    packing = tokenization.packing_for(Tok(), "t", 6, encoder=True)
    assert (packing.prefix, packing.suffix, packing.separator, packing.body_len) == ((101,), (102,), (102,), 4)


def test_text_readers_and_missing_field(tmp_path):
    (tmp_path / "a.txt").write_text("one document")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "row one"}) + "\n\n" + json.dumps({"text": "row two"}) + "\n")
    pq.write_table(pa.table({"text": ["p1", "p2"]}), tmp_path / "c.parquet")
    docs = list(datasets.TextCorpus(str(tmp_path)).documents())
    assert docs == ["one document", "row one", "row two", "p1", "p2"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(SaeflowError, match=r"bad.jsonl:1: no string field 'text'"):
        list(datasets.TextCorpus(str(tmp_path / "bad.jsonl")).documents())
    with pytest.raises(SaeflowError, match=r"no column 'body'"):
        list(datasets.TextCorpus(str(tmp_path / "c.parquet"), field="body").documents())
    with pytest.raises(SaeflowError, match="does not exist"):
        _ = datasets.TextCorpus(str(tmp_path / "missing.txt")).files


def test_builtin_corpus_is_python_docs_with_content_hash():
    corpus = datasets.BuiltinCorpus()
    docs = list(corpus.documents())
    assert len(docs) > 10 and any("for_stmt" in d or "for" in d for d in docs)
    assert len(corpus.data()["sha256"]) == 64


def _write_png(fpath, array):
    fpath.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(fpath)


def test_image_folder_labels_and_errors(tmp_path):
    for cls, n in (("cat", 2), ("dog", 1)):
        for i in range(n):
            _write_png(tmp_path / cls / f"{i}.png", np.full((8, 8, 3), i * 40, np.uint8))
    ds = datasets.ImageFolder(str(tmp_path))
    assert ds.classes == ["cat", "dog"] and [label for _, label in ds.items] == [0, 0, 1]
    (tmp_path / "dog" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(SaeflowError, match=r"broken.png: unreadable image"):
        datasets.ImageFolder(str(tmp_path)).check()
    (tmp_path / "empty").mkdir()
    with pytest.raises(SaeflowError, match="the dataset is empty"):
        len(datasets.ImageFolder(str(tmp_path / "empty")))


def test_segmentation_folder_pairs_images_with_masks(tmp_path):
    _write_png(tmp_path / "images" / "a.png", np.zeros((16, 16, 3), np.uint8))
    mask = np.zeros((16, 16), np.uint8)
    mask[:8, :8] = 4
    _write_png(tmp_path / "masks" / "a.png", mask)
    pre = datasets.Preprocess(16, 16, 8, (0.5,) * 3, (0.5,) * 3)
    _, labels = datasets.SegFolder(str(tmp_path)).example(0, pre)
    assert labels.tolist() == [4, 0, 0, 0]
    _write_png(tmp_path / "images" / "b.png", np.zeros((16, 16, 3), np.uint8))
    with pytest.raises(SaeflowError, match=r"b.png has no mask"):
        len(datasets.SegFolder(str(tmp_path)))


def test_from_config_rejects_unknown_kind_and_keys():
    with pytest.raises(SaeflowError, match="dataset.kind"):
        datasets.from_config({"kind": "video"})
    with pytest.raises(SaeflowError, match="unknown keys"):
        datasets.from_config({"kind": "text", "path": "x", "colour": 1})
