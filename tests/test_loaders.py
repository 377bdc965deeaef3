"""Loaders: exactly-once coverage, determinism per seed, shard boundaries, token selection, damaged directories."""

import os
import pathlib
import tempfile

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
import torch

from builders import write_shards
from saeflow.errors import SaeflowError, ShardDirError
from saeflow.store.layout import ShardLayout
from saeflow.store.shards import ShardDir
from saeflow.training.loaders import TOKENS, Block, EpochPlan, IndexedReader, OrderedLoader, ShuffledLoader

N_EX, L, T, D = 37, 2, 5, 8  # 3 shards of 12 examples + one of 1; CLS at token 0
# A text packing's record in metadata.json (data.tokenization): BOS 1 before each example, EOS 2 between documents.
PACKING = {"tokenizer": "bytes", "context_length": T, "prefix": [1], "suffix": [], "separator": [2]}


@pytest.fixture
def acts_nltd():
    # Each vector encodes its own coordinates, so any misplaced read is visible.
    ex, layer, tok = np.meshgrid(np.arange(N_EX), np.arange(L), np.arange(T), indexing="ij")
    base = ex * 1000 + layer * 100 + tok
    return (base[..., None] + np.arange(D) / 100).astype(np.float32)


@pytest.fixture
def shard_dir(shards_root, acts_nltd):
    sd = write_shards(shards_root, acts_nltd, layers=(3, 7), cls_token=True, ex_per_shard=12)
    assert sd.shard_sizes == [12, 12, 12, 1]
    return sd


def _rows(batches) -> np.ndarray:
    return torch.cat([b.clone() for b in batches]).numpy()


def _sorted(rows: np.ndarray) -> np.ndarray:
    return rows[np.lexsort(rows.T[::-1])]


def _loader(sd, seed=0, **kw):
    # Tiny blocks (3 examples) and a pool of 24 rows: many blocks, refills and shard boundaries.
    return ShuffledLoader(
        sd, 7, batch_size=kw.pop("batch_size", 10), seed=seed, block_bytes=3 * 4 * D * 4,
        buffer_bytes=kw.pop("buffer_bytes", 24 * D * 4), **kw,
    )  # fmt: skip


@pytest.mark.parametrize("tokens, sel", [("content", slice(1, T)), ("cls", slice(0, 1)), ("all", slice(0, T))])
def test_shuffled_exactly_once_per_epoch(shard_dir, acts_nltd, tokens, sel):
    expected = acts_nltd[:, 1, sel].reshape(-1, D)
    loader = _loader(shard_dir, tokens=tokens)
    for epoch in (0, 1):
        rows = _rows(loader.iter_batches(epoch))
        assert rows.shape == expected.shape
        np.testing.assert_array_equal(_sorted(rows), _sorted(expected))
        assert not np.array_equal(rows, expected)  # actually shuffled
    assert len(loader) == -(-expected.shape[0] // 10)


def test_shuffled_deterministic_per_seed_and_resumable(shard_dir):
    a = _rows(_loader(shard_dir, seed=1).iter_batches(0))
    assert np.array_equal(a, _rows(_loader(shard_dir, seed=1).iter_batches(0)))
    assert not np.array_equal(a, _rows(_loader(shard_dir, seed=2).iter_batches(0)))
    assert not np.array_equal(a, _rows(_loader(shard_dir, seed=1).iter_batches(1)))
    # Batch b of an epoch is the same whether or not batches 0..b-1 were read (exact resume).
    for start in (1, 5, 13):
        assert np.array_equal(_rows(_loader(shard_dir, seed=1).iter_batches(0, start)), a[start * 10 :])


def test_data_that_fit_the_pool_get_the_same_batches_from_any_larger_pool(shard_dir, acts_nltd):
    """The README's reproducibility statement: `buffer_bytes: auto` gives machines with other memory other pools,
    but the pool never holds more than the layer, so data that fit it are shuffled alike by every larger pool."""
    n_rows = acts_nltd.shape[0] * (T - 1)  # content tokens of layer 7
    fitting = _rows(_loader(shard_dir, seed=3, buffer_bytes=n_rows * D * 4).iter_batches(0))
    for larger in (2 * n_rows * D * 4, 1 << 30):
        assert np.array_equal(_rows(_loader(shard_dir, seed=3, buffer_bytes=larger).iter_batches(0)), fitting)
    assert not np.array_equal(_rows(_loader(shard_dir, seed=3).iter_batches(0)), fitting)  # a smaller pool differs


def test_shuffled_mixes_across_shards(shard_dir):
    first = _rows([next(iter(_loader(shard_dir, seed=3, batch_size=40)))])
    shards_seen = {int(ex) // 12 for ex in first[:, 0] // 1000}
    assert len(shards_seen) >= 2


def test_ordered_is_storage_order_across_shards(shard_dir, acts_nltd):
    rows = _rows(OrderedLoader(shard_dir, 3, batch_size=7, block_bytes=5 * 4 * D * 4))
    np.testing.assert_array_equal(rows, acts_nltd[:, 0, 1:].reshape(-1, D))


def test_batches_are_the_callers_own_unless_borrowed(shard_dir, acts_nltd):
    """Issue 33: batches were views into 3 reused buffers, so `torch.cat(list(loader))` returned overwritten rows once
    a layer spanned more than 3 blocks (here 10 blocks of 4 examples). Owned by default; `borrowed=True` (for
    callers that finish with a batch before asking for the one after next) keeps the views, and list() shows it."""
    block_bytes = 4 * T * D * 4
    ordered = OrderedLoader(shard_dir, 3, batch_size=7, block_bytes=block_bytes)
    assert len(ordered.block_list) == 10
    np.testing.assert_array_equal(torch.cat(list(ordered)).numpy(), acts_nltd[:, 0, 1:].reshape(-1, D))
    shuffled = _loader(shard_dir)
    assert len(shuffled.block_list) > 3
    rows = torch.cat(list(shuffled)).numpy()
    np.testing.assert_array_equal(_sorted(rows), _sorted(acts_nltd[:, 1, 1:].reshape(-1, D)))
    borrowed = OrderedLoader(shard_dir, 3, batch_size=7, block_bytes=block_bytes, borrowed=True)
    assert not np.array_equal(torch.cat(list(borrowed)).numpy(), acts_nltd[:, 0, 1:].reshape(-1, D))
    np.testing.assert_array_equal(_rows(borrowed), acts_nltd[:, 0, 1:].reshape(-1, D))  # each copied in time


def test_indexed_random_access(shard_dir, acts_nltd):
    reader = IndexedReader(shard_dir, 7, tokens="all")
    idx = [0, 184, 59, 60, 61, 5]  # crosses shard boundaries (12 ex x 5 tokens = 60 vectors per shard)
    got = reader.get(idx).numpy()
    np.testing.assert_array_equal(got, acts_nltd[:, 1].reshape(-1, D)[idx])
    assert torch.equal(reader[184], torch.from_numpy(acts_nltd[36, 1, 4]))
    assert reader.view.coords(184) == (36, 4)
    with pytest.raises(SaeflowError, match="out of range"):
        reader.get([185])


@pytest.mark.parametrize("tokens, sel", [("content", slice(1, T)), ("all", slice(0, T)), ("cls", slice(0, 1))])
def test_single_layer_block_reads(shards_root, acts_nltd, tokens, sel):
    """One stored layer: a block is one pread of whole examples (CLS skipped in RAM), except for CLS alone."""
    sd = write_shards(shards_root, acts_nltd[:, :1], layers=(0,), cls_token=True, ex_per_shard=10)
    expected = acts_nltd[:, 0, sel].reshape(-1, D)
    loader = ShuffledLoader(sd, 0, batch_size=16, seed=0, tokens=tokens, block_bytes=4 * T * D * 4)
    assert loader.view.contiguous == (tokens != "cls")
    np.testing.assert_array_equal(_sorted(_rows(loader)), _sorted(expected))
    np.testing.assert_array_equal(
        _rows(OrderedLoader(sd, 0, batch_size=9, tokens=tokens, block_bytes=3 * T * D * 4)), expected
    )


def test_bad_selection_errors(shard_dir, shards_root, acts_nltd):
    with pytest.raises(SaeflowError, match="layer 5 is not stored"):
        _loader_layer(shard_dir, 5)
    no_cls = write_shards(shards_root, acts_nltd, layers=(3, 7), cls_token=False, tag="no-cls")
    with pytest.raises(SaeflowError, match="cls_token=false"):
        ShuffledLoader(no_cls, 3, batch_size=4, seed=0, tokens="cls")


def _loader_layer(sd, layer):
    return ShuffledLoader(sd, layer, batch_size=4, seed=0)


def test_corrupt_or_purged_directory(shard_dir):
    dpath = shard_dir.dpath
    os.chmod(dpath, 0o755)
    victim = dpath / "acts000001.bin"
    os.chmod(victim, 0o644)
    with open(victim, "r+b") as fd:
        fd.truncate(100)
    with pytest.raises(ShardDirError, match="acts000001.bin: 100 bytes"):
        ShardDir(dpath)
    # A scratch purge after the directory was opened: the loader names the missing file.
    for child in dpath.glob("acts*.bin"):
        child.unlink()
    with pytest.raises(SaeflowError, match="acts00000.\\.bin: cannot open shard"):
        _rows(_loader(shard_dir))
    with pytest.raises(ShardDirError, match="missing"):
        ShardDir(dpath)


def test_float16_shards(shards_root, acts_nltd):
    sd = write_shards(shards_root, acts_nltd, layers=(3, 7), cls_token=True, ex_per_shard=12, dtype="float16")
    rows = _rows(OrderedLoader(sd, 7, batch_size=32))
    assert rows.dtype == np.float16
    np.testing.assert_array_equal(rows, acts_nltd[:, 1, 1:].reshape(-1, D).astype(np.float16))
    np.testing.assert_array_equal(_sorted(_rows(_loader(sd))), _sorted(rows))


def test_batches_larger_than_several_windows(shard_dir, acts_nltd):
    # Windows hold 24 rows here; a 100-row batch spans 5 of them while buffers are recycled underneath.
    rows = _rows(_loader(shard_dir, batch_size=100).iter_batches(0))
    np.testing.assert_array_equal(_sorted(rows), _sorted(acts_nltd[:, 1, 1:].reshape(-1, D)))


def test_uneven_blocks_regression(shards_root):
    """Shards of 7 examples cut into blocks of 4 and 3: the old loader sized its buffers from neighbouring blocks
    and crashed (IndexError) when a shuffled window combined two 4-example blocks."""
    n, T3, D4 = 28, 3, 4
    acts_nltd = np.arange(n * T3 * D4, dtype=np.float32).reshape(n, 1, T3, D4)
    sd = write_shards(shards_root, acts_nltd, layers=(0,), cls_token=True, ex_per_shard=7)
    expected = acts_nltd[:, 0, 1:].reshape(-1, D4)
    for seed in range(5):
        loader = ShuffledLoader(sd, 0, batch_size=5, seed=seed, block_bytes=4 * T3 * D4 * 4, buffer_bytes=16 * D4 * 4)
        assert [b.n_ex for b in loader.block_list] == [4, 3] * 4
        np.testing.assert_array_equal(_sorted(_rows(loader)), _sorted(expected))


def test_newer_pass_stops_older(shard_dir, acts_nltd):
    """Passes of one loader share its pool: a new pass stops the old one, which then says so. The caller keeps
    its torch threads (the loader's threads set theirs to one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # not the test session's one thread (conftest), which the loader's would leave as is
    try:
        loader = _loader(shard_dir)
        old = loader.iter_batches(0)
        next(old)
        rows = _rows(loader.iter_batches(1))
        np.testing.assert_array_equal(_sorted(rows), _sorted(acts_nltd[:, 1, 1:].reshape(-1, D)))
        with pytest.raises(SaeflowError, match="stopped by a newer pass"):
            next(old)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def _uniform_distinct(n_ex: int, n_tok: int, batch_size: int) -> float:
    """Expected distinct examples in `batch_size` vectors drawn uniformly without replacement (hypergeometric)."""
    n = n_ex * n_tok
    log_none = sum(np.log1p(-n_tok / (n - i)) for i in range(batch_size))
    return n_ex * (1 - np.exp(log_none))


def test_mixing_close_to_uniform():
    """The issue's geometry in index space: 3,600 examples x 196 tokens, ~27-example blocks, batches of 4096 and a
    pool of 1 GiB of d=768 float32 rows: the median batch holds >= 0.8 of the examples uniform sampling would."""
    n_ex, n_tok, bs = 3600, 196, 4096
    blocks = [Block(0, s, min(27, n_ex - s)) for s in range(0, n_ex, 27)]
    plan = EpochPlan(blocks, [0], n_tok, (1 << 30) // (768 * 4), bs, seed=0, epoch=0)
    distinct = [np.unique(g // n_tok).size for g in plan.batches()][:-1]
    assert np.median(distinct) >= 0.8 * _uniform_distinct(n_ex, n_tok, bs)  # 2,450
    # the old loader's windows of 4 blocks: ~108 examples
    assert min(distinct) > 4 * 27 * 4


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    n_tok=st.integers(1, 5),
    ex_per_block=st.integers(1, 4),
    batch_size=st.integers(1, 30),
    n_pool=st.integers(1, 80),
    seed=st.integers(0, 2**32),
    data=st.data(),
)
def test_plan_exactly_once_deterministic_resumable(sizes, n_tok, ex_per_block, batch_size, n_pool, seed, data):
    """Any shard and block sizes, pool and batch: each epoch is a permutation of all vectors, cut into full batches
    (the last may be short), the same for the same seed, and batch b onwards is the same when started at b."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    blocks = [Block(i, s, min(ex_per_block, n - s)) for i, n in enumerate(sizes) for s in range(0, n, ex_per_block)]
    plan = EpochPlan(blocks, starts, n_tok, n_pool, batch_size, seed, epoch=1)
    batches = list(plan.batches())
    n_vec = int(starts[-1]) * n_tok
    assert [b.size for b in batches] == [batch_size] * (n_vec // batch_size) + [n_vec % batch_size] * bool(
        n_vec % batch_size
    )
    assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(n_vec))
    again = EpochPlan(blocks, starts, n_tok, n_pool, batch_size, seed, epoch=1)
    start = data.draw(st.integers(0, len(batches)))
    tail = list(again.batches(start))
    assert len(tail) == len(batches) - start
    assert all(np.array_equal(a, b) for a, b in zip(tail, batches[start:]))


@hypothesis.settings(max_examples=20, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(
    n_ex=st.integers(1, 20),
    ex_per_shard=st.integers(1, 8),
    two_layers=st.booleans(),
    tokens=st.sampled_from(TOKENS),
    ex_per_block=st.integers(1, 5),
    batch_size=st.integers(1, 25),
    pool_rows=st.integers(1, 60),
    start=st.integers(0, 5),
    d=st.sampled_from([8, 256]),
)
def test_loader_reads_what_the_plan_says(
    n_ex, ex_per_shard, two_layers, tokens, ex_per_block, batch_size, pool_rows, start, d
):
    """On real directories of any shard/block sizes and layouts: every batch holds exactly the vectors its plan
    names, from any start batch (scattered reads into the pool, CLS/other-layer gaps, shard boundaries)."""
    Tx = 4
    ex, layer, tok = np.meshgrid(np.arange(n_ex), np.arange(1 + two_layers), np.arange(Tx), indexing="ij")
    acts_nltd = ((ex * 1000 + layer * 100 + tok)[..., None] + np.arange(d) / 1000).astype(np.float32)
    ids_nt = np.random.default_rng([n_ex, start]).integers(0, 5, size=(n_ex, Tx), dtype=np.int32)  # 1, 2: special
    with tempfile.TemporaryDirectory() as tmp:
        layers = (3, 7)[: 1 + two_layers]
        sd = write_shards(pathlib.Path(tmp), acts_nltd, layers=layers, cls_token=True, ex_per_shard=ex_per_shard,
                          aux={ShardLayout.TOKENS_FNAME: ids_nt}, data={"tokenization": PACKING})  # fmt: skip
        loader = ShuffledLoader(
            sd, layers[-1], batch_size, seed=start, tokens=tokens,
            block_bytes=ex_per_block * Tx * d * 4, buffer_bytes=pool_rows * d * 4,
        )  # fmt: skip
        keep_nt = {"content": np.arange(Tx) >= 1, "cls": np.arange(Tx) < 1, "all": np.arange(Tx) < Tx,
                   "no_special": ~np.isin(ids_nt, [1, 2])}[tokens] & np.ones((n_ex, Tx), dtype=bool)  # fmt: skip
        vectors = acts_nltd[:, -1][keep_nt]
        plan = loader.plan(2)
        want = [vectors[g] for g in plan.batches(start)]
        got = [b.clone().numpy() for b in loader.iter_batches(2, start)]
        loader.close()
    assert len(got) == max(0, len(loader) - start)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("two_layers", [False, True])  # refills through the staging buffer; straight into slots
def test_two_workers_never_race_on_a_slot(shards_root, two_layers):
    """Many epochs of odd sizes (a partial last refill every epoch), each batch checked against its plan: a worker
    refilling a slot that the other has yet to gather, gathering one before its refill, or reusing the buffer of a
    batch the consumer still holds shows up here."""
    n_ex, Tx, d = 150, 9, 64
    ex, layer, tok = np.meshgrid(np.arange(n_ex), np.arange(1 + two_layers), np.arange(Tx), indexing="ij")
    acts_nltd = ((ex * 1000 + layer * 100 + tok)[..., None] + np.arange(d) / 1000).astype(np.float32)
    layers = (3, 7)[: 1 + two_layers]
    sd = write_shards(shards_root, acts_nltd, layers=layers, cls_token=True, ex_per_shard=41)
    vectors = acts_nltd[:, -1, 1:].reshape(-1, d)
    for batch_size in (37, 64):
        loader = ShuffledLoader(sd, layers[-1], batch_size, seed=3, block_bytes=5 * Tx * d * 4, buffer_bytes=97 * d * 4)
        for epoch in range(12):
            want = [vectors[g] for g in loader.plan(epoch).batches()]
            n_got, held = 0, None
            for i, x_bd in enumerate(loader.iter_batches(epoch)):
                if held is not None:  # a batch stays valid until the second next one is asked for
                    np.testing.assert_array_equal(held.numpy(), want[i - 1])
                np.testing.assert_array_equal(x_bd.numpy(), want[i])
                n_got, held = i + 1, x_bd
            assert n_got == len(want)
        loader.close()


def test_shard_truncated_after_open(shard_dir):
    """A shard cut short after the directory was validated: the shuffled loader's scattered reads name the file."""
    loader = _loader(shard_dir, buffer_bytes=10_000 * D * 4)  # the pool holds everything: one load reads it all
    victim = shard_dir.dpath / "acts000002.bin"
    os.chmod(shard_dir.dpath, 0o755)
    os.chmod(victim, 0o644)
    with open(victim, "r+b") as fd:
        fd.truncate(os.path.getsize(victim) - 100)
    with pytest.raises(SaeflowError, match="acts000002.bin: ended early"):
        _rows(loader)


def test_no_special_reads_every_token_but_the_packings_special_ids(shards_root, acts_nltd):
    """Examples of different sizes: each loader gives exactly the stored vectors whose id is not BOS/EOS."""
    ids_nt = np.random.default_rng(0).integers(0, 6, size=(N_EX, T), dtype=np.int32)
    ids_nt[5] = 2  # an example of special tokens only: no vector
    sd = write_shards(shards_root, acts_nltd, layers=(3, 7), ex_per_shard=12, aux={ShardLayout.TOKENS_FNAME: ids_nt},
                      data={"tokenization": PACKING})  # fmt: skip
    keep_nt = ~np.isin(ids_nt, [1, 2])
    expected = acts_nltd[:, 1][keep_nt]
    ordered = OrderedLoader(sd, 7, batch_size=7, tokens="no_special", block_bytes=3 * T * D * 4)
    assert ordered.n_vectors == keep_nt.sum() == len(expected)
    np.testing.assert_array_equal(_rows(ordered), expected)
    shuffled = _loader(sd, tokens="no_special")
    for epoch in (0, 1):  # every vector once per epoch, in a new order
        np.testing.assert_array_equal(_sorted(_rows(shuffled.iter_batches(epoch))), _sorted(expected))
    reader = IndexedReader(sd, 7, tokens="no_special")
    rows_n = np.flatnonzero(keep_nt.reshape(-1))
    for index in (0, 17, len(expected) - 1):
        assert reader.view.coords(index) == tuple(divmod(int(rows_n[index]), T))
        np.testing.assert_array_equal(reader[index].numpy(), expected[index])
    assert np.array_equal(reader.view.keep(4, 7), keep_nt[4:7])


def test_no_special_needs_text_shards_saeflow_extracted(shard_dir):
    with pytest.raises(SaeflowError, match="tokens='no_special' needs text shards extracted by saeflow"):
        OrderedLoader(shard_dir, 3, batch_size=4, tokens="no_special")
