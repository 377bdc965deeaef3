"""saeflow's directories as they are (protocol 2.0, no export) and saev's own readers of its protocol-"2.0" era
(e43e7dd..9762670, 2025-10-03..06). tests/fixtures/saev/saev20/ holds saeflow directories of tiny random vision towers
(CLIP at every hook point with a full and a short last shard, an image folder without labels.bin, DINOv2, SigLIP) and
what saev's readers did with each at each commit (make_saev20_fixtures.py, saev in a side venv): the vectors its
`shuffled.DataLoader` returned (.npz) and every reader's outcome, "read" or its exception in one line
(outcomes.json). Here saeflow's reader must give those vectors bit for bit, and the outcomes must be what
docs/interop.md ("saev's protocol-2.0 readers") says."""

import json
import pathlib

import numpy as np
import pytest

from saeflow.extraction import hooks
from saeflow.store import shards
from saeflow.store.layout import ShardLayout

FIXTURE_DPATH = pathlib.Path(__file__).resolve().parent / "fixtures" / "saev" / "saev20"
DOC = json.loads((FIXTURE_DPATH / "outcomes.json").read_text())
CASES = DOC["cases"]
READ_COMMIT = DOC["read_commit"]
ERA = ("e43e7dd", "4ab5d33", "53a5c4d", "fa31a9f", "9762670")  # Metadata with exactly protocol 2.0's keys
BEFORE, AFTER = ("d4cc39a", "7c24d25"), ("a38acda",)  # no `dataset` field yet; the keys renamed
SHUFFLED = "shuffled.DataLoader"
HOOKS = ("residual", "attn_out", "mlp_out", "mlp_in")


def outcome(commit: str, reader: str, tag: str) -> str:
    (found,) = [o for o, tags in DOC["outcomes"][commit][reader].items() if tag in tags]
    return found


def shard_dir(tag: str) -> shards.ShardDir:
    return shards.ShardDir(FIXTURE_DPATH / "saeflow" / CASES[tag]["name"])


def test_the_fixtures_hold_each_hook_point_full_and_short_and_a_directory_without_labels():
    assert set(DOC["commits"]) == {*BEFORE, *ERA, *AFTER} and READ_COMMIT in ERA
    for tag, case in CASES.items():
        sd = shard_dir(tag)
        md = sd.metadata
        assert md.protocol == "2.0" and md.family == case["arch"].removesuffix("_vision_model")
        assert hooks.stored(md.data) == case["hook"] and ("hook" in md.data) == (case["hook"] != "residual")
        assert sd.has_aux(ShardLayout.LABELS_FNAME) == case["labels_bin"] and md.n_ex == case["n_ex"]
        assert case["last_shard"] == ("full" if md.shard_sizes[-1] == md.ex_per_shard else "short")
        # in the directory as saeflow wrote it, every file listed, each acts file exactly its shards.json length
        sizes = json.loads((sd.dpath / "shards.json").read_text())
        assert [e["n_ex"] for e in sizes] == list(md.shard_sizes)
        for i, n in enumerate(md.shard_sizes):
            assert sd.shard_fpath(i).stat().st_size == n * md.bytes_per_ex
    clip = [c for c in CASES.values() if c["arch"] == "clip_vision_model" and c["labels_bin"]]
    assert {(c["hook"], c["last_shard"]) for c in clip} == {(h, last) for h in HOOKS for last in ("full", "short")}
    assert {c["arch"] for c in CASES.values() if not c["labels_bin"]} == {"clip_vision_model"}
    assert {c["arch"] for c in CASES.values()} == {"clip_vision_model", "dinov2", "siglip_vision_model"}


READ = sorted(tag for tag in CASES if outcome(READ_COMMIT, SHUFFLED, tag) == "read")


def test_saevs_shuffled_loader_read_every_directory_with_a_full_last_shard_at_each_hook_point():
    assert READ == sorted(tag for tag, case in CASES.items() if case["last_shard"] == "full")
    assert {CASES[tag]["hook"] for tag in READ} == set(HOOKS)


@pytest.mark.parametrize("tag", READ)
def test_saevs_shuffled_loader_returned_saeflows_vectors_bit_for_bit(tag):
    sd = shard_dir(tag)
    md = sd.metadata
    with np.load(FIXTURE_DPATH / f"{CASES[tag]['name']}.npz", allow_pickle=False) as npz:
        read = {key: npz[key] for key in npz.files}
    assert sorted(read) == sorted(f"shuffled_L{layer}_{f}" for layer in md.layers for f in ("act", "ex_i", "patch_i"))
    P = md.patches_per_ex
    for layer in md.layers:
        ex, patch = read[f"shuffled_L{layer}_ex_i"], read[f"shuffled_L{layer}_patch_i"]
        # every content token of every example exactly once (in the order saev's reservoir shuffled them)
        assert sorted(zip(ex.tolist(), patch.tolist())) == [(e, p) for e in range(md.n_ex) for p in range(P)]
        want = np.stack([sd.vector(e, layer, p + int(md.cls_token)) for e, p in zip(ex, patch)])
        got = read[f"shuffled_L{layer}_act"]
        assert got.dtype == want.dtype == np.float32 and got.tobytes() == want.tobytes()


def test_the_outcomes_are_the_documented_ones():
    for commit in ERA:
        for tag, case in CASES.items():
            assert outcome(commit, "Metadata.load", tag) == outcome(commit, "ShardInfo.load", tag) == "read"
            assert outcome(commit, "Metadata.load (not under saev/shards)", tag) == "AssertionError"
            # saev's own name for the metadata is not saeflow's (saev hashes pixel_agg: null); no reader checks names
            assert len(case["saev_hash"]) == 64 and case["saev_hash"] != case["name"]
            for reader in ("ordered.DataLoader", "indexed.Dataset"):
                assert outcome(commit, reader, tag) == "AttributeError: 'Metadata' object has no attribute 'n_imgs'"
            shuffled = outcome(commit, SHUFFLED, tag)
            if case["last_shard"] == "full":
                assert shuffled == "read"
            else:
                # whichever the loader notices first: its worker's error, or its manager gone (the error only logged)
                crashed = ("RuntimeError: worker0 crashed: ... ", "RuntimeError: Manager process died unexpectedly")
                assert shuffled.startswith(crashed)
                assert shuffled.removesuffix("]").endswith("ValueError: mmap length is greater than file size")
            ignore = outcome(commit, "shuffled.DataLoader(ignore_labels=[0])", tag)
            if case["labels_bin"]:
                assert ignore == "AttributeError: 'Metadata' object has no attribute 'n_patches_per_ex'"
            else:
                assert ignore.startswith("FileNotFoundError: labels.bin not found at ")
    for commit in BEFORE:
        for tag in CASES:
            want = "TypeError: Metadata.__init__() got an unexpected keyword argument 'dataset'"
            assert outcome(commit, "Metadata.load", tag) == outcome(commit, "indexed.Dataset", tag) == want
            for reader in (SHUFFLED, "ordered.DataLoader"):  # their Config's `shard_root` is a str, load wants a Path
                assert outcome(commit, reader, tag).startswith("BeartypeCallHintParamViolation: ")
    renamed = "TypeError: Metadata.__init__() got an unexpected keyword argument 'n_ex'"  # a38acda's keys
    for tag in CASES:
        assert outcome(*AFTER, SHUFFLED, tag) == outcome(*AFTER, "indexed.Dataset", tag) == renamed


def test_a_short_last_shard_is_shorter_than_the_full_shard_saevs_shuffled_loader_maps():
    """saev's shuffled loader memory-maps every shard at its full shape (ex_per_shard, L, T, D), mode "r"."""
    for tag, case in CASES.items():
        sd = shard_dir(tag)
        md = sd.metadata
        full = md.ex_per_shard * len(md.layers) * md.tokens_per_ex * md.d_model * 4
        last = sd.shard_fpath(len(md.shard_sizes) - 1).stat().st_size
        assert (last < full) == (case["last_shard"] == "short")
