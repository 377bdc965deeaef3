"""A run publishes metrics.jsonl, metrics.json, provenance.json and sae.pt together: a crash between them never
shows a run with metrics but no weights as done, the rerun finishes it, and the published files are read-only."""

import os
import stat
import threading

import pytest

from builders import planted_data, run_from_sae_spec, write_shards
from hang import HANG_SEC
from saeflow.store import atomic
from saeflow.training import train

SPEC = dict(arch="topk", k=2, expansion=4, batch_size=32, n_epochs=1)
PUBLISHED = ("config.json", "metrics.json", "metrics.jsonl", "provenance.json", "sae.pt")
CPU = train.TrainSettings(device="cpu")


@pytest.fixture
def shard_dir(tmp_path):
    x_nd, _ = planted_data(1024, d_model=16, n_atoms=32, k=2, seed=1)
    return write_shards(tmp_path / "shards", x_nd.reshape(-1, 1, 8, 16), layers=(0,), ex_per_shard=64, tag="pub")


def checkpoint_files(run) -> dict[str, bytes]:
    """Every checkpoint file's bytes; provenance.json (times, host, argv) only by its presence."""
    return {p.name: p.read_bytes() if p.name != "provenance.json" else b"" for p in run.checkpoint_dpath.iterdir()}


class Crash(BaseException):
    """Stands for a SIGKILL: nothing after it runs, not even `except Exception` handlers."""


@pytest.mark.parametrize("crash_after", ["metrics.jsonl", "metrics.json", "provenance.json"])
def test_crash_between_metrics_and_sae_pt_is_finished_by_the_rerun(tmp_path, shard_dir, monkeypatch, crash_after):
    clean = run_from_sae_spec(tmp_path / "clean", shard_dir, **SPEC)
    train.train_runs([clean.root], CPU)
    run = run_from_sae_spec(tmp_path / "crashed", shard_dir, **SPEC)
    real_replace = os.replace

    def replace_then_crash(src, dst):
        real_replace(src, dst)
        if os.path.basename(dst) == crash_after:
            raise Crash

    monkeypatch.setattr(os, "replace", replace_then_crash)
    with pytest.raises(Crash):
        train.train_runs([run.root], CPU)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not run.sae_fpath.exists()  # not "done"; the sealed staging directory holds what is left
    assert (run.publish_dpath / "sae.pt").exists()
    assert train.train_runs([run.root], CPU) == []  # finished by renaming, without training again
    assert checkpoint_files(run) == checkpoint_files(clean)


def test_crash_while_staging_redoes_the_finish(tmp_path, shard_dir, monkeypatch):
    clean = run_from_sae_spec(tmp_path / "clean", shard_dir, **SPEC)
    train.train_runs([clean.root], CPU)
    run = run_from_sae_spec(tmp_path / "crashed", shard_dir, **SPEC)
    monkeypatch.setattr(train, "save_sae", lambda *a, **k: (_ for _ in ()).throw(Crash()))
    with pytest.raises(Crash):
        train.train_runs([run.root], CPU)
    monkeypatch.undo()
    assert not run.sae_fpath.exists() and not run.final_metrics_fpath.exists()
    (result,) = train.train_runs([run.root], CPU)
    assert result["step"] == 32
    assert checkpoint_files(run) == checkpoint_files(clean)


def test_published_run_files_are_read_only(tmp_path, shard_dir):
    run = run_from_sae_spec(tmp_path, shard_dir, **SPEC)
    train.train_runs([run.root], CPU)
    assert sorted(p.name for p in run.checkpoint_dpath.iterdir()) == sorted(PUBLISHED)
    for fname in PUBLISHED:
        mode = stat.S_IMODE((run.checkpoint_dpath / fname).stat().st_mode)
        assert mode == atomic.READONLY_FILE_MODE, (fname, oct(mode))


def test_a_second_trainer_waits_for_the_run_lock_then_finds_it_done(tmp_path, shard_dir):
    run = run_from_sae_spec(tmp_path, shard_dir, **SPEC)
    results = []
    with atomic.exclusive_lock(run.lock_fpath):
        waiter = threading.Thread(target=lambda: results.append(train.train_runs([run.root], CPU)))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive()  # blocked on the lock
        assert not run.sae_fpath.exists()
    waiter.join(timeout=HANG_SEC)
    assert len(results[0]) == 1 and run.sae_fpath.exists()
    assert train.train_runs([run.root], CPU) == []  # the next one finds it done
