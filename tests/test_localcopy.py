"""Node-local staging of the training shards ($TMPDIR): one checked copy per node, read instead of the source."""

import pytest
import torch

from builders import planted_data, run_from_sae_spec, write_shards
from saeflow.errors import SaeflowError
from saeflow.store import atomic
from saeflow.training import localcopy, train
from saeflow.training.sae import load_sae

SPEC = dict(arch="topk", k=2, expansion=4, batch_size=32, n_epochs=1)


def _weights(run):
    return load_sae(run.sae_fpath).state_dict()


def test_training_reads_the_checked_local_copy(tmp_path, monkeypatch):
    x_nd, _ = planted_data(512, d_model=16, n_atoms=32, k=2, seed=3)
    sd = write_shards(tmp_path / "shards", x_nd.reshape(-1, 1, 8, 16), layers=(0,), ex_per_shard=16, tag="lc")
    in_place = run_from_sae_spec(tmp_path / "a", sd, **SPEC)
    train.train_runs([in_place.root], train.TrainSettings(device="cpu"))

    monkeypatch.setenv("TMPDIR", str(tmp_path / "node"))
    copied = run_from_sae_spec(tmp_path / "b", sd, **SPEC)
    train.train_runs([copied.root], train.TrainSettings(device="cpu", local_copy="$TMPDIR"))
    local = tmp_path / "node" / localcopy.LOCAL_DNAME / sd.dpath.name
    assert (local.parent / f".{sd.dpath.name}.complete").exists() and (local / "acts000000.bin").is_file()
    a, b = _weights(in_place), _weights(copied)
    assert all(torch.equal(a[k], b[k]) for k in a)

    # Zero the source's shards (same sizes): a third run still trains to the same weights, so it read the copy.
    atomic.make_tree_writable(sd.dpath)
    for shard in sd.dpath.glob("acts*.bin"):
        shard.write_bytes(bytes(shard.stat().st_size))
    third = run_from_sae_spec(tmp_path / "c", sd, **SPEC)
    train.train_runs([third.root], train.TrainSettings(device="cpu", local_copy="$TMPDIR"))
    c = _weights(third)
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_a_copy_whose_sizes_differ_is_made_again(tmp_path):
    src = tmp_path / "src" / ("a" * 64)
    src.mkdir(parents=True)
    (src / "acts000000.bin").write_bytes(b"x" * 100)
    dest = localcopy.local_copy(src, tmp_path / "node")
    with open(dest / "acts000000.bin", "r+b") as fd:
        fd.truncate(10)  # e.g. a full local disk during an earlier copy
    assert localcopy.local_copy(src, tmp_path / "node") == dest
    assert (dest / "acts000000.bin").read_bytes() == b"x" * 100


def test_an_unset_variable_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("SAEFLOW_NO_SUCH_DIR", raising=False)
    with pytest.raises(SaeflowError, match=r"names an unset environment variable"):
        localcopy.local_copy(tmp_path, "$SAEFLOW_NO_SUCH_DIR")
