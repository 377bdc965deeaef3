"""Real-scale inputs (issue 10): ImageNet-style folders of any class count, dataset fingerprints and their cache."""

import json

import numpy as np
from PIL import Image

from builders import ARCH_CONFIGS, typed
from saeflow import shards
from saeflow.extract import plan_activation
from saeflow.layout import ShardLayout
from workflow_helpers import snakemake, write_config

N_CLASSES = 1000


def _image_folder(root, n_classes: int, per_class: int = 1, size: int = 8):
    rng = np.random.default_rng(0)
    for c in range(n_classes):
        (root / f"n{c:08d}").mkdir(parents=True)
        for j in range(per_class):
            pixels = rng.integers(0, 256, (size, size + 3 * j, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"n{c:08d}" / f"{j}.png")
    return root


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
