"""Damaged shard directories: each damage is named with its file, all at once, and nothing is ever changed."""

import json
import os
import re

import pytest

from builders import make_md, snapshot, write_all
from saeflow import cli
from saeflow.errors import ShardDirError
from saeflow.store import atomic, shards


@pytest.fixture
def published(shards_root):
    md = make_md(n_ex=7, ex_per_shard=3)  # 3 shards: 3, 3, 1
    return write_all(shards_root, md, aux=("labels.bin",)).dpath


def damage(dpath, fn):
    """Apply `fn` to a published (read-only) directory as a user or a purge would, then restore read-only."""
    atomic.make_tree_writable(dpath)
    fn(dpath)
    atomic.make_tree_readonly(dpath)


def truncate(dpath):
    os.truncate(dpath / "acts000001.bin", (dpath / "acts000001.bin").stat().st_size - 4)


def purge(dpath):
    for name in ("acts000000.bin", "acts000002.bin", "labels.bin"):
        (dpath / name).unlink()


def edit_metadata(dpath):
    obj = json.loads((dpath / "metadata.json").read_text())
    obj["ckpt"] = "hf-hub:test/other"
    (dpath / "metadata.json").write_text(json.dumps(obj))


def wrong_counts(dpath):
    (dpath / "shards.json").write_text(json.dumps([{"name": "acts000000.bin", "n_ex": 7}]))


def purge_metadata(dpath):
    (dpath / "metadata.json").unlink()
    (dpath / "acts000002.bin").unlink()


CASES = {
    "truncated": (truncate, [r"acts000001.bin: 956 bytes, expected 960 \(truncated"]),
    "purged": (purge, ["acts000000.bin: missing", "acts000002.bin: missing", "labels.bin: missing"]),
    "metadata_edited": (edit_metadata, [r"metadata.json: its sha256 is [0-9a-f]{64}, but the directory must be named"]),
    "shards_json_counts": (wrong_counts, [r"shards.json: lists 1 shards with n_ex \[7\] but metadata.json implies 3"]),
    "metadata_purged": (purge_metadata, ["metadata.json: missing", "acts000002.bin: missing"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_damage_is_reported_and_nothing_is_touched(published, capsys, case):
    fn, patterns = CASES[case]
    damage(published, fn)
    root = published.parent
    before = snapshot(root)

    report = shards.validate(published)
    assert not report.ok and len(report.problems) == len(patterns)
    for pattern in patterns:  # each problem names its file by full path
        assert any(re.search(pattern, p) and p.startswith(str(published)) for p in report.problems), (pattern, report)

    with pytest.raises(ShardDirError) as err:
        shards.ShardDir(published)
    assert err.value.problems == report.problems
    with pytest.raises(ShardDirError, match="never rewrites or deletes"):
        write_all(root, make_md(n_ex=7, ex_per_shard=3))
    assert cli.main(["validate", str(published)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"invalid: {published}") and all(p in out for p in report.problems)
    assert cli.main(["info", str(published)]) == 1

    assert snapshot(root) == before  # bytes, mtimes and modes of every file, and no new files


def test_stray_file_is_a_warning_only(published, capsys):
    damage(published, lambda d: (d / "notes.txt").write_text("mine"))
    before = snapshot(published.parent)
    report = shards.validate(published)
    assert report.ok and report.warnings == [
        f"{published / 'notes.txt'}: stray file, not part of the shard directory (ignored)"
    ]
    assert shards.ShardDir(published).n_ex == 7
    assert write_all(published.parent, make_md(n_ex=7, ex_per_shard=3)).reused
    assert cli.main(["validate", str(published)]) == 0
    assert "warning:" in capsys.readouterr().out
    assert snapshot(published.parent) == before


def test_flipped_byte_is_found_by_deep_only(published, capsys):
    def flip(dpath):
        data = bytearray((dpath / "acts000002.bin").read_bytes())
        data[17] ^= 0xFF
        (dpath / "acts000002.bin").write_bytes(bytes(data))

    damage(published, flip)
    assert shards.validate(published).ok
    report = shards.validate(published, deep=True)
    assert report.problems == [
        f"{published / 'acts000002.bin'}: sha256 differs from checksums.json (the bytes changed)"
    ]
    assert cli.main(["validate", "--deep", str(published)]) == 1
    assert "sha256 differs" in capsys.readouterr().out


def test_broken_checksums_json(published):
    damage(published, lambda d: (d / "checksums.json").write_text('{"files": [1, 2]}'))
    report = shards.validate(published)
    assert len(report.problems) == 1 and report.problems[0].startswith(f"{published / 'checksums.json'}: unreadable")


def test_directory_without_checksums_is_valid_but_not_deep(published):
    """Directories written by other saev tools have no checksums.json: the protocol files alone decide."""
    damage(published, lambda d: (d / "checksums.json").unlink())
    report = shards.validate(published)
    assert report.ok and "checksums.json: missing" in report.warnings[0]
    assert "cannot be verified" in shards.validate(published, deep=True).problems[0]


def test_not_a_directory(tmp_path, capsys):
    assert cli.main(["validate", str(tmp_path / "nope")]) == 1
    assert "does not exist or is not a directory" in capsys.readouterr().out


def test_empty_directory_at_the_final_path_counts_as_nothing(shards_root):
    """Snakemake creates an output's parent directory before the job: the writer publishes over it."""
    md = make_md(n_ex=7, ex_per_shard=3)
    (shards_root / md.hash).mkdir()
    writer = write_all(shards_root, md)
    assert not writer.reused and shards.validate(writer.dpath).ok
    assert shards.open_existing(writer.dpath) is not None
