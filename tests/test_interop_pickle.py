"""gzip-pickle shards: checksums first, an allow-list unpickler, numpy 1.x/2.x pickles, and the saev import."""

import gzip
import hashlib
import importlib.util
import json
import os
import pathlib
import pickle
import shutil

import numpy as np
import pytest

from saeflow.errors import SaeflowError
from saeflow.interop import pickle_shards, saev_sink
from saeflow.interop.records import Record
from saeflow.store import shards

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "interop"
_spec = importlib.util.spec_from_file_location("make_numpy1_pickles", FIXTURES / "make_numpy1_pickles.py")
numpy1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(numpy1)


def make_records(n=5, n_tokens=4, d=8, layers=(0, 2), seed=0):
    rng = np.random.default_rng(seed)
    return [
        Record(text=f"prompt {i} " + "x" * 300, label=i % 2,
               acts={layer: rng.standard_normal((n_tokens, d)).astype(np.float32) for layer in layers})
        for i in range(n)
    ]


def writable_copy(src, dst):
    shutil.copytree(src, dst)
    for p in pathlib.Path(dst).rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    pathlib.Path(dst).chmod(0o755)
    return pathlib.Path(dst)


def put_shard(dpath, payload: bytes, fname="shard_0001.pkl.gz"):
    """Replace a shard's bytes and record the matching checksum (an attacker controls both)."""
    (dpath / fname).write_bytes(payload)
    md = json.loads((dpath / "metadata.json").read_text())
    md["shards"][0]["checksum"] = "sha256:" + hashlib.sha256(payload).hexdigest()
    (dpath / "metadata.json").write_text(json.dumps(md))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    recs = make_records()
    out = tmp_path_factory.mktemp("pkl") / "acts"
    opts = pickle_shards.PickleOptions.defaults(samples_per_shard=2)
    pickle_shards.write(recs, out, {"model_name": "m", "dataset_name": "d"}, opts)
    return recs, out


def test_round_trip_and_spec_use_cases(written):
    recs, out = written
    store = pickle_shards.PickleShards(out)
    md = store.metadata
    assert [s["num_samples"] for s in md["shards"]] == [2, 2, 1] and md["statistics"]["total_samples"] == 5
    assert [s["filename"] for s in md["shards"]] == ["shard_0001.pkl.gz", "shard_0002.pkl.gz", "shard_0003.pkl.gz"]
    assert all(s["size_bytes"] == (out / s["filename"]).stat().st_size for s in md["shards"])
    for rec, back in zip(recs, store.records(), strict=True):
        assert back.text == rec.text[:200] and back.label == rec.label
        for layer in (0, 2):
            assert np.array_equal(back.acts[layer], rec.acts[layer])
    items = list(store.iter_activations(2))
    assert [it["sample_idx"] for it in items] == list(range(5)) and items[3]["shape"] == (4, 8)
    ds = pickle_shards.ActivationDataset(out, layer=0)
    assert len(ds) == 5 and np.array_equal(ds[4]["activation"], recs[4].acts[0]) and ds[1]["sample_idx"] == 1
    import torch.utils.data

    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=5)))
    assert batch["activation"].shape == (5, 4, 8)


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/saeflow-pwned",))


def test_malicious_pickle_is_rejected_without_running(written, tmp_path):
    dpath = writable_copy(written[1], tmp_path / "evil")
    marker = pathlib.Path("/tmp/saeflow-pwned")
    marker.unlink(missing_ok=True)
    for payload in (Evil(), {"layer_0": [{"activation": Evil()}]}, [eval, "1"]):
        put_shard(dpath, gzip.compress(pickle.dumps(payload, protocol=2)))
        with pytest.raises(SaeflowError, match="not allowed"):
            pickle_shards.PickleShards(dpath).load_shard(pickle_shards.PickleShards(dpath).shards[0])
    assert not marker.exists()


def test_corrupted_shard_fails_checksum_before_unpickling(written, tmp_path):
    dpath = writable_copy(written[1], tmp_path / "bad")
    fpath = dpath / "shard_0002.pkl.gz"
    raw = bytearray(fpath.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    fpath.write_bytes(raw)
    store = pickle_shards.PickleShards(dpath)
    with pytest.raises(SaeflowError, match="shard_0002.pkl.gz: checksum .* differs"):
        list(store.records())


def test_decompressed_size_cap(written, tmp_path):
    dpath = writable_copy(written[1], tmp_path / "bomb")
    put_shard(dpath, gzip.compress(pickle.dumps({"layer_0": [b"\0" * (1 << 20)]})))
    with pytest.raises(SaeflowError, match="more than the memory budget of 64.0 KiB"):
        store = pickle_shards.PickleShards(dpath, memory_budget=1 << 16)
        store.load_shard(store.shards[0])


@pytest.mark.parametrize("protocol", [2, 4])
def test_numpy1_pickles_load(protocol):
    store = pickle_shards.PickleShards(FIXTURES / f"numpy1_protocol{protocol}")
    assert b"numpy.core.multiarray" in gzip.decompress((store.dpath / "shard_0001.pkl.gz").read_bytes())
    recs = list(store.records())
    assert len(recs) == 3
    for i, rec in enumerate(recs):
        for layer in (0, 2):
            assert np.array_equal(rec.acts[layer], numpy1.expected_activation(i, layer))


def test_numpy2_protocol5_loads(tmp_path):
    recs = make_records(n=2)
    opts = pickle_shards.PickleOptions.defaults(protocol=5)
    out = pickle_shards.write(recs, tmp_path / "p5", {"model_name": "m"}, opts)
    raw = gzip.decompress((out / "shard_0001.pkl.gz").read_bytes())
    assert raw[1] == 5 and b"numpy._core" in raw
    assert np.array_equal(next(pickle_shards.PickleShards(out).records()).acts[2], recs[0].acts[2])


def test_import_into_saev_shards(written, shards_root):
    recs, out = written
    store = pickle_shards.PickleShards(out)
    data = {"__class__": "GzipPickleShards", "checksums": [s["checksum"] for s in store.shards]}
    sd = saev_sink.write(store.records(), store.n_samples, shards_root, "gpt2", "m", "d", data, patches_per_shard=16)
    assert shards.validate(sd.dpath, deep=True).ok and sd.metadata.layers == (0, 2) and sd.shard_sizes == [2, 2, 1]
    for i, rec in enumerate(recs):
        assert np.array_equal(sd.example(i, 2), rec.acts[2])
    again = saev_sink.write(store.records(), store.n_samples, shards_root, "gpt2", "m", "d", data, patches_per_shard=16)
    assert again.dpath == sd.dpath


def test_saev_import_refuses_ragged(tmp_path):
    recs = make_records(n=2) + make_records(n=1, n_tokens=5)
    with pytest.raises(SaeflowError, match="example 2 has shapes"):
        saev_sink.write(recs, 3, tmp_path, "gpt2", "m", "d", {"__class__": "X"})
    assert not [p for p in tmp_path.iterdir() if len(p.name) == 64]  # nothing published
