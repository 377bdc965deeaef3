"""Atomic publishing primitives: staging names, read-only trees, one rename, exclusive locks."""

import fcntl
import os
import stat

import pytest

from saeflow.store import atomic


def make_tree(dpath):
    (dpath / "sub").mkdir(parents=True)
    (dpath / "a.bin").write_bytes(b"abc")
    (dpath / "sub" / "b.json").write_text("{}")


def test_staging_is_a_hidden_sibling(tmp_path):
    assert atomic.staging_dpath(tmp_path / "abc") == tmp_path / ".abc.partial"
    assert atomic.staging_dpath(tmp_path / "abc", tag="tmp") == tmp_path / ".abc.tmp"


def test_publish_dir_renames_and_makes_read_only(tmp_path):
    staging, final = tmp_path / ".x.partial", tmp_path / "x"
    make_tree(staging)
    assert atomic.publish_dir(staging, final)
    assert not staging.exists() and (final / "a.bin").read_bytes() == b"abc"
    for path in (final, final / "sub", final / "a.bin", final / "sub" / "b.json"):
        assert stat.S_IMODE(path.stat().st_mode) & 0o222 == 0
    atomic.make_tree_writable(final)
    assert stat.S_IMODE((final / "a.bin").stat().st_mode) == 0o644


def test_publish_dir_loses_a_race_without_touching_the_winner(tmp_path):
    final = tmp_path / "x"
    make_tree(final)
    before = {p: p.read_bytes() for p in final.rglob("*") if p.is_file()}
    staging = tmp_path / ".x.partial"
    make_tree(staging)
    (staging / "a.bin").write_bytes(b"other")
    assert atomic.publish_dir(staging, final) is False
    assert not staging.exists()
    assert {p: p.read_bytes() for p in final.rglob("*") if p.is_file()} == before


def test_publish_dir_reports_other_rename_errors(tmp_path):
    staging = tmp_path / ".x.partial"
    make_tree(staging)
    with pytest.raises(FileNotFoundError):
        atomic.publish_dir(staging, tmp_path / "missing-parent" / "x")


def test_write_file_atomic_leaves_no_temporary(tmp_path):
    fpath = tmp_path / "f.json"
    atomic.write_file_atomic(fpath, b"one")
    atomic.write_file_atomic(fpath, b"two", readonly=True)
    assert fpath.read_bytes() == b"two" and stat.S_IMODE(fpath.stat().st_mode) == 0o444
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_write_json_is_deterministic(tmp_path):
    atomic.write_json(tmp_path / "a.json", {"b": 1, "a": [1, 2]})
    atomic.write_json(tmp_path / "b.json", {"a": [1, 2], "b": 1})
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert (tmp_path / "a.json").read_text().endswith("}\n")


def test_exclusive_lock_excludes_another_process(tmp_path):
    lock_fpath = tmp_path / "deep" / ".x.lock"
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            with atomic.exclusive_lock(lock_fpath):
                os.write(ready_w, b"1")
                os.read(done_r, 1)  # hold the lock until the parent has probed it
        finally:
            os._exit(0)
    os.read(ready_r, 1)
    fd = os.open(lock_fpath, os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(done_w, b"1")
        os.waitpid(pid, 0)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the holder left the block
    finally:
        os.close(fd)
    for fd in (ready_r, ready_w, done_r, done_w):
        os.close(fd)


def test_remove_staging_handles_read_only_trees(tmp_path):
    make_tree(tmp_path / "s")
    atomic.make_tree_readonly(tmp_path / "s")
    atomic.remove_staging(tmp_path / "s")
    atomic.remove_staging(tmp_path / "never-existed")
    assert list(tmp_path.iterdir()) == []


def test_building_dir_publishes_on_success_and_leaves_nothing_on_failure(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic.building_dir(final) as staging:
            (staging / "half.bin").write_bytes(b"x")
            raise RuntimeError("killed half-way")
    assert not final.exists() and not atomic.staging_dpath(final).exists()
    with atomic.building_dir(final) as staging:
        (staging / "whole.bin").write_bytes(b"xy")
    assert (final / "whole.bin").read_bytes() == b"xy" and not atomic.staging_dpath(final).exists()
    assert not (final / "whole.bin").stat().st_mode & 0o222  # published read-only
