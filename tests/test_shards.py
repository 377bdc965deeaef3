"""Protocol 2.0 maths (hypothesis against brute force), metadata hashing, and write/read round trips."""

import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import make_acts, make_aux, make_md, snapshot, write_all
from saeflow.errors import SaeflowError
from saeflow.store import atomic, shards

# ---------------------------------------------------------------------------------------------------------------
# Sizing and indexing maths (sections 3 and 4) against brute force
# ---------------------------------------------------------------------------------------------------------------

shapes = st.fixed_dictionaries(
    {
        "n_ex": st.integers(1, 60),
        "n_layers": st.integers(1, 4),
        "patches_per_ex": st.integers(1, 9),
        "cls_token": st.booleans(),
        "ex_per_shard": st.integers(1, 70),
        "slack": st.integers(0, 50),  # patches_per_shard need not be a multiple of one example's vectors
    }
)


def md_from(shape, d_model=3, dtype="float32") -> shards.Metadata:
    tokens = shape["patches_per_ex"] + int(shape["cls_token"])
    per_ex = tokens * shape["n_layers"]
    return shards.Metadata(
        family="dinov2",
        ckpt="m",
        layers=tuple(range(10, 10 + 2 * shape["n_layers"], 2)),
        patches_per_ex=shape["patches_per_ex"],
        cls_token=shape["cls_token"],
        d_model=d_model,
        n_ex=shape["n_ex"],
        patches_per_shard=shape["ex_per_shard"] * per_ex + shape["slack"] % per_ex,
        data={"__class__": "X"},
        dataset="/d",
        dtype=dtype,
    )


@settings(max_examples=300, deadline=None)
@given(shapes)
def test_sizing_matches_brute_force(shape):
    md = md_from(shape)
    assert md.tokens_per_ex == shape["patches_per_ex"] + (1 if shape["cls_token"] else 0)
    assert md.ex_per_shard == shape["ex_per_shard"]
    # Brute force: deal examples one at a time into shards that hold at most ex_per_shard vectors' worth.
    budget = md.patches_per_shard
    sizes, used = [], budget
    for _ in range(md.n_ex):
        if used + md.tokens_per_ex * md.n_layers > budget:
            sizes.append(0)
            used = 0
        sizes[-1] += 1
        used += md.tokens_per_ex * md.n_layers
    assert md.shard_sizes == sizes
    assert shards.expected_shards_json(md) == [{"name": f"acts{i:06d}.bin", "n_ex": n} for i, n in enumerate(sizes)]


@settings(max_examples=200, deadline=None)
@given(shapes, st.data(), st.sampled_from(["float32", "float16"]))
def test_locate_matches_flat_c_order_index(shape, data, dtype):
    md = md_from(shape, d_model=5, dtype=dtype)
    ex = data.draw(st.integers(0, md.n_ex - 1))
    layer_idx = data.draw(st.integers(0, md.n_layers - 1))
    token = data.draw(st.integers(0, md.tokens_per_ex - 1))
    # Brute force: the logical (n_ex, L, T, D) tensor is cut along examples; count vectors before ours.
    starts = np.cumsum([0, *md.shard_sizes])
    shard_idx = int(np.searchsorted(starts, ex, side="right") - 1)
    flat = np.ravel_multi_index((ex, layer_idx, token), (md.n_ex, md.n_layers, md.tokens_per_ex))
    first = starts[shard_idx] * md.n_layers * md.tokens_per_ex
    itemsize = np.dtype(dtype).itemsize
    assert shards.locate(md, ex, md.layers[layer_idx], token) == (shard_idx, (flat - first) * md.d_model * itemsize)


def test_locate_rejects_out_of_range():
    md = make_md()
    for args, msg in [((7, 3, 0), "example 7"), ((0, 4, 0), "layer 4 is not stored"), ((0, 3, 5), "token 5")]:
        with pytest.raises(SaeflowError, match=msg):
            shards.locate(md, *args)


# ---------------------------------------------------------------------------------------------------------------
# Metadata and its hash
# ---------------------------------------------------------------------------------------------------------------


def test_hash_is_sha256_of_canonical_json():
    md = make_md()
    obj = json.loads(json.dumps(md.to_dict()))
    assert set(obj) == {
        "family", "ckpt", "layers", "patches_per_ex", "cls_token", "d_model", "n_ex", "patches_per_shard", "data",
        "dataset", "dtype", "protocol",
    }  # fmt: skip
    expected = hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()
    assert md.hash == expected and len(md.hash) == 64


HASH_SCRIPT = """
import json, random, sys
from saeflow.store import atomic, shards
obj = json.loads(sys.argv[1])
order = list(obj)
random.Random(int(sys.argv[2])).shuffle(order)
data = dict(reversed(list(obj["data"].items())))
print(shards.Metadata.from_dict({**{k: obj[k] for k in order}, "data": data}).hash)
"""


@pytest.mark.slow
def test_hash_same_across_processes_seeds_and_key_orders():
    obj = make_md().to_dict()
    hashes = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", HASH_SCRIPT, json.dumps(obj), seed],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        hashes.add(out.stdout.strip())
    assert hashes == {make_md().hash}
    assert make_md(data={"split": "train", "__class__": "ImageFolder", "root": "/data/imgs"}).hash == make_md().hash
    assert make_md(n_ex=8).hash != make_md().hash


@pytest.mark.parametrize(
    "change, msg",
    [
        ({"layers": []}, "layers must be a non-empty"),
        ({"layers": [1, 1]}, "must not repeat"),
        ({"n_ex": 0}, "n_ex must be a positive integer"),
        ({"cls_token": 1}, "cls_token must be true or false"),
        ({"dtype": "float64"}, "dtype must be one of"),
        ({"protocol": "1.0"}, "protocol must be '2.0'"),
        ({"data": {"root": "/x"}}, "'__class__'"),
        ({"data": {"__class__": "X", "w": float("nan")}}, "plain JSON"),
        ({"data": {"__class__": "X", 3: "int key"}}, "plain JSON"),
        ({"patches_per_shard": 5}, "smaller than one example"),
    ],
)
def test_metadata_rejects_bad_values(change, msg):
    with pytest.raises(SaeflowError, match=msg):
        shards.Metadata(**{**make_md().to_dict(), **change})


def test_metadata_from_dict_names_missing_and_extra_keys():
    obj = make_md().to_dict()
    del obj["dataset"]
    obj["seed"] = 1
    with pytest.raises(SaeflowError, match=r"missing \['dataset'\], unexpected \['seed'\]"):
        shards.Metadata.from_dict(obj)


# ---------------------------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------------------------


def check_round_trip(root, md, aux=("labels.bin", "tokens.bin"), batch=2):
    writer = write_all(root, md, aux=aux, batch=batch)
    dpath = root / md.hash
    assert writer.dpath == dpath and not writer.reused
    assert sorted(p.name for p in root.iterdir()) == [md.hash]  # no staging, no lock left behind
    expected = make_acts(md, 0, md.n_ex)
    sd = shards.ShardDir(dpath)
    sizes = md.shard_sizes
    assert json.loads((dpath / "shards.json").read_text()) == [
        {"name": f"acts{i:06d}.bin", "n_ex": n} for i, n in enumerate(sizes)
    ]
    assert sum(sizes) == md.n_ex and all(n > 0 for n in sizes) and all(n == md.ex_per_shard for n in sizes[:-1])
    # Raw files: C-order (n_in_shard, L, T, D) slices of the logical tensor.
    start = 0
    for i, n in enumerate(sizes):
        assert (dpath / f"acts{i:06d}.bin").read_bytes() == expected[start : start + n].tobytes()
        start += n
    assert not (dpath / f"acts{len(sizes):06d}.bin").exists()
    for ex in range(md.n_ex):
        for layer_idx, layer in enumerate(md.layers):
            np.testing.assert_array_equal(sd.example(ex, layer), expected[ex, layer_idx])
            for token in range(md.tokens_per_ex):
                np.testing.assert_array_equal(sd.vector(ex, layer, token), expected[ex, layer_idx, token])
    with pytest.raises(SaeflowError, match="ex_per_block"):
        next(sd.iter_blocks(md.layers[0], ex_per_block=0))
    for layer_idx, layer in enumerate(md.layers):
        blocks = list(sd.iter_blocks(layer, ex_per_block=2))
        assert [b[0] for b in blocks] == sorted(b[0] for b in blocks)
        np.testing.assert_array_equal(np.concatenate([b[1] for b in blocks]), expected[:, layer_idx])
    for fname in aux:
        np.testing.assert_array_equal(sd.aux(fname), make_aux(md, fname, 0, md.n_ex))
    report = shards.validate(dpath, deep=True)
    assert report.ok and not report.warnings, report
    assert all(not os.access(p, os.W_OK) for p in [dpath, *dpath.iterdir()]) or os.geteuid() == 0
    assert all(p.stat().st_mode & 0o222 == 0 for p in [dpath, *dpath.iterdir()])


@pytest.mark.parametrize(
    "kw",
    [
        dict(n_ex=7, ex_per_shard=3),  # last shard smaller
        dict(n_ex=9, ex_per_shard=3),  # exact multiple: no empty shard
        dict(n_ex=1, ex_per_shard=3),  # a single example
        dict(n_ex=5, ex_per_shard=1),  # one example per shard
        dict(n_ex=4, ex_per_shard=10, cls_token=False, layers=(0,)),
        dict(n_ex=6, ex_per_shard=4, dtype="float16", layers=(11, 2, 7)),  # layer values in any order
    ],
)
def test_round_trip_edge_shapes(shards_root, kw):
    check_round_trip(shards_root, make_md(**kw))


@settings(max_examples=15, deadline=None)
@given(shapes, st.integers(1, 5))
def test_round_trip_many_shapes(shape, batch):
    shape = {**shape, "n_ex": shape["n_ex"] % 13 + 1, "ex_per_shard": shape["ex_per_shard"] % 6 + 1}
    with tempfile.TemporaryDirectory() as tmp:
        check_round_trip(pathlib.Path(tmp), md_from(shape, d_model=4), aux=("labels.bin",), batch=batch)
        atomic.make_tree_writable(pathlib.Path(tmp))


def test_write_across_shard_boundaries_in_one_call(shards_root):
    md = make_md(n_ex=10, ex_per_shard=3)
    check_round_trip(shards_root, md, aux=(), batch=10)


def test_writer_rejects_bad_input(shards_root):
    md = make_md()
    with pytest.raises(SaeflowError, match="inside `with"):
        shards.ShardWriter(shards_root, md).write(make_acts(md, 0, 1))
    with pytest.raises(SaeflowError, match="unknown side file"):
        shards.ShardWriter(shards_root, md, aux=("logits.bin",))
    # Leaving the block early publishes nothing and keeps the staging directory for a resume.
    with (
        pytest.raises(SaeflowError, match="only 2 of 7 examples"),
        shards.ShardWriter(shards_root, md, aux=("labels.bin",)) as writer,
    ):
        with pytest.raises(SaeflowError, match=r"shape \(n, 2, 5, 8\)"):
            writer.write(np.zeros((1, 2, 5, 7), np.float32), aux={"labels.bin": make_aux(md, "labels.bin", 0, 1)})
        with pytest.raises(SaeflowError, match="differ from the declared"):
            writer.write(make_acts(md, 0, 1))
        with pytest.raises(SaeflowError, match=r"labels.bin rows must have shape \(1, 4\)"):
            writer.write(make_acts(md, 0, 1), aux={"labels.bin": np.zeros((1, 5), np.uint8)})
        with pytest.raises(SaeflowError, match="too many examples"):
            writer.write(make_acts(md, 0, 8), aux={"labels.bin": make_aux(md, "labels.bin", 0, 8)})
        writer.write(make_acts(md, 0, 2), aux={"labels.bin": make_aux(md, "labels.bin", 0, 2)})
    assert not (shards_root / md.hash).exists()
    writer = write_all(shards_root, md)
    assert writer.resumed_from == 0  # shard 0 (3 examples) was never complete
    assert shards.ShardDir(writer.dpath).provenance()["resumed_from_ex"] == 0


def test_resume_skips_complete_shards(shards_root):
    md = make_md(n_ex=8, ex_per_shard=3)
    with pytest.raises(RuntimeError):
        with shards.ShardWriter(shards_root, md) as writer:
            writer.write(make_acts(md, 0, 5))
            raise RuntimeError("the model crashed")
    writer = write_all(shards_root, md, aux=())
    assert writer.resumed_from == 3
    reference = write_all(shards_root / "ref", md, aux=())
    for name in ("acts000000.bin", "acts000001.bin", "acts000002.bin", "checksums.json"):
        assert (writer.dpath / name).read_bytes() == (reference.dpath / name).read_bytes()


def test_reuse_writes_nothing(shards_root):
    md = make_md()
    write_all(shards_root, md)
    before = snapshot(shards_root)
    writer = write_all(shards_root, md)
    assert writer.reused and snapshot(shards_root) == before
    with pytest.raises(SaeflowError, match="already complete"):
        writer.write(make_acts(md, 0, 1))
