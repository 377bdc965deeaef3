"""Crashes, full disks and concurrent writers: the final path holds nothing or a complete directory, always."""

import errno
import json
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import time

import pytest

from builders import file_bytes, make_md, write_all
from hang import HANG_SEC
from saeflow.errors import SaeflowError
from saeflow.store import atomic, shards

BUILDERS = os.path.join(os.path.dirname(__file__), "builders.py")


def run_in_child(fn) -> int:
    """fork, run fn() in the child, return the child's pid (it exits 0 on success, 3 on SaeflowError)."""
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            fn()
            code = 0
        except SaeflowError:
            code = 3
        finally:
            os._exit(code)
    return pid


def wait_child(pid, timeout_s=HANG_SEC) -> int:
    """waitpid with a deadline (a hung child is killed and fails the test instead of hanging the suite)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"child {pid} did not finish in {timeout_s} s")


def assert_nothing_partial(root, md):
    """Only the final directory (complete), the staging sibling and the lock may exist under root."""
    assert {p.name for p in root.iterdir()} <= {md.hash, f".{md.hash}.partial", f".{md.hash}.lock"}
    if (root / md.hash).exists():
        assert shards.validate(root / md.hash, deep=True).ok


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_is_byte_identical(tmp_path):
    md = make_md(n_ex=20, ex_per_shard=3, d_model=32)  # 7 shards, each fsynced and recorded
    reference = write_all(tmp_path / "ref", md, batch=2).dpath
    start = time.perf_counter()  # timed in a child, as the kills below: fork and start-up under this machine's load
    os.waitpid(run_in_child(lambda: write_all(tmp_path / "timed", md, batch=2)), 0)
    full_s = time.perf_counter() - start
    print(f"uninterrupted write in a child: {full_s:.3f} s")
    expected = file_bytes(reference)

    root = tmp_path / "shards"
    rng = random.Random(20261122)
    n_kills, resumed_from = 0, []
    # Tries until 20 kills: a kill counts only while the child still writes, and a child resuming a killed one's
    # staging has less left to write, so the share of tries that kill varies with the load (16 of 60 once, with
    # three test workers on two cores); 200 tries take at most about 25 s.
    for _ in range(200):
        pid = run_in_child(lambda: write_all(root, md, batch=2))
        time.sleep(rng.uniform(0, 1.2 * full_s))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            n_kills += 1
        else:
            assert os.WEXITSTATUS(status) == 0
        assert_nothing_partial(root, md)
        if (root / md.hash).exists():  # published before the kill: check it, then start over
            assert file_bytes(root / md.hash) == expected
            resumed_from.append(json.loads((root / md.hash / "provenance.json").read_text())["resumed_from_ex"])
            atomic.remove_staging(root / md.hash)
        if n_kills >= 20:
            break
    assert n_kills >= 20
    writer = write_all(root, md, batch=2)
    resumed_from.append(writer.resumed_from)
    assert file_bytes(writer.dpath) == expected
    assert any(n > 0 for n in resumed_from), resumed_from  # some runs really resumed from the staging directory
    assert {p.name for p in root.iterdir()} == {md.hash}


def test_write_error_in_background_thread_publishes_nothing(shards_root, monkeypatch):
    md = make_md(n_ex=7, ex_per_shard=3)
    real_fsync = os.fsync

    def full_disk(fd):  # only the writer's background threads see a full disk
        if threading.current_thread().name.startswith("shard-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    # issue 16: a full disk is one line naming the directory and what was kept
    with pytest.raises(SaeflowError, match=r"No space left on device writing .*nothing was published"):
        write_all(shards_root, md)
    assert not (shards_root / md.hash).exists()
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert write_all(shards_root, md).dpath.exists()


def test_write_error_while_preparing_is_a_saeflow_error(shards_root, monkeypatch):
    md = make_md()
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EROFS, "Read-only file system")))
    with pytest.raises(SaeflowError, match=r"cannot prepare .*\.partial: .*Read-only file system"):
        write_all(shards_root, md)
    assert not (shards_root / md.hash).exists()


def test_file_size_limit_in_child_then_resume(tmp_path):
    """A real write error from the kernel (EFBIG under RLIMIT_FSIZE, like a full quota), then a clean resume."""
    md = make_md(n_ex=40, ex_per_shard=3, d_model=32)
    reference = file_bytes(write_all(tmp_path / "ref", md).dpath)
    root = tmp_path / "shards"

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        shard_bytes = md.ex_per_shard * md.bytes_per_ex
        resource.setrlimit(resource.RLIMIT_FSIZE, (shard_bytes - 100, resource.RLIM_INFINITY))
        write_all(root, md)

    status = wait_child(run_in_child(limited))
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3  # SaeflowError, not a crash
    assert_nothing_partial(root, md)
    assert not (root / md.hash).exists()
    assert file_bytes(write_all(root, md).dpath) == reference


@pytest.mark.slow
def test_two_processes_publish_the_same_hash(tmp_path):
    root = tmp_path / "shards"
    n_ex = 60
    procs = [
        subprocess.Popen(
            [sys.executable, BUILDERS, str(root), str(n_ex)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=HANG_SEC)
        assert proc.returncode == 0, err.decode()
        results.append(json.loads(out))
    assert sorted(r["result"] for r in results) == ["published", "reused"]
    md = make_md(n_ex=n_ex, d_model=64)
    assert {r["hash"] for r in results} == {md.hash}
    assert {p.name for p in root.iterdir()} == {md.hash}
    assert shards.validate(root / md.hash, deep=True).ok
    assert file_bytes(root / md.hash) == file_bytes(write_all(tmp_path / "ref", md).dpath)


def test_killed_while_publishing_is_finished_by_the_next_run(shards_root, monkeypatch):
    """A run killed after sealing the staging directory (before the rename) is published as is, not rebuilt."""
    md = make_md()
    monkeypatch.setattr(atomic, "publish_dir", lambda staging, final: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        write_all(shards_root, md)
    monkeypatch.undo()
    staging = shards_root / f".{md.hash}.partial"
    assert not (staging / "progress.json").exists() and (staging / "checksums.json").exists()
    (staging / f".junk.tmp-{os.getpid()}").write_text("left by a crash")
    sealed = file_bytes(staging, skip=(f".junk.tmp-{os.getpid()}",))
    writer = write_all(shards_root, md)
    assert writer.reused and file_bytes(writer.dpath, skip=()) == sealed
    assert shards.validate(writer.dpath).warnings == []


def test_unwritable_root_is_a_saeflow_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(SaeflowError, match="cannot prepare"):
        write_all(blocker / "shards", make_md())
