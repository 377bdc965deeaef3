"""The units `saeflow probe` samples (saeflow.analysis.probe): each label file's values, the held-out split by example,
and per label its positives and negatives, every choice a pure function of (seed, unit), in chunks whose memory
follows the caps and the number of distinct label values, never the data or the largest id."""

import dataclasses

import numpy as np

from saeflow.extraction import datasets
from saeflow.store.layout import ShardLayout
from saeflow.store.shards import ShardDir

CHUNK_UNITS = 1 << 20  # labelled units (patches or examples) per chunk of the label passes


def uniform(ids_n: np.ndarray, seed: int, salt: int) -> np.ndarray:
    """A uniform number in [0, 1) per id, a pure function of (id, seed, salt) (splitmix64): the same in any
    chunking and on any machine."""
    gamma, mix = 0x9E3779B97F4A7C15, (seed * 0x632BE59BD9B4E019 + salt * 0xD6E8FEB86659FD93 + 1) % 2**64
    with np.errstate(over="ignore"):
        z = ids_n.astype(np.uint64) * np.uint64(gamma) + np.uint64(mix)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) / 2.0**53


def is_test(ex_n: np.ndarray, seed: int, test_frac: float) -> np.ndarray:
    """Whether each example is held out (the split is by example: all its patches go with it)."""
    return uniform(ex_n, seed, salt=0) < test_frac


@dataclasses.dataclass(frozen=True)
class LabelSource:
    """One side file of labels: `labels.bin` (per patch) or `classes.bin` (per example), and its names."""

    fname: str
    scope: str  # "patch" or "example"
    units_per_ex: int  # patches per example, or 1
    names: tuple[str, ...]  # names of the label values that have one (ImageFolder classes, generated shapes)

    def name(self, value: int) -> str:
        if 0 <= value < len(self.names):
            return self.names[value]
        return f"{'label' if self.scope == 'patch' else 'class'} {value}"

    def read(self, sd: ShardDir, lo: int, hi: int) -> np.ndarray:
        """The labels of examples lo..hi-1, one per unit (example-major), int64; read with one pread (a memory
        map would keep every page it touched resident)."""
        dtype = np.dtype("uint8" if self.scope == "patch" else "int32")
        count = (hi - lo) * self.units_per_ex
        return np.fromfile(sd.layout.file(self.fname), dtype, count, offset=lo * self.units_per_ex * dtype.itemsize
                           ).astype(np.int64)  # fmt: skip


def label_sources(sd: ShardDir) -> list[LabelSource]:
    """The label files of a shard directory, with the names its metadata gives their values."""
    data, sources = sd.metadata.data, []
    if sd.has_aux(ShardLayout.LABELS_FNAME):
        shapes = data.get("__class__") == datasets.GeneratedImages.__name__
        names = datasets.GeneratedImages.LABEL_NAMES if shapes else ()
        sources.append(LabelSource(ShardLayout.LABELS_FNAME, "patch", sd.metadata.patches_per_ex, names))
    if sd.has_aux(ShardLayout.CLASSES_FNAME):
        names = tuple(data.get("classes") or ())  # ImageFolder's sorted sub-folder names
        sources.append(LabelSource(ShardLayout.CLASSES_FNAME, "example", 1, names))
    return sources


class BottomK:
    """Per group, the `caps_g[g]` units with the smallest keys seen so far (ties: the smaller unit), each with a
    label, merged chunk by chunk: memory is the caps, whatever the number of units."""

    def __init__(self, caps_g: np.ndarray):
        self.caps_g = np.asarray(caps_g, dtype=np.int64)
        self.groups, self.keys = np.empty(0, np.int64), np.empty(0)
        self.units, self.labels = np.empty(0, np.int64), np.empty(0, np.int64)
        self._bar_g = np.full(len(self.caps_g), np.inf)  # a full group's largest kept key: larger ones cannot enter

    def update(self, groups_n: np.ndarray, keys_n: np.ndarray, units_n: np.ndarray, labels_n: np.ndarray) -> None:
        cand = keys_n < self._bar_g[groups_n]
        if not cand.any():
            return
        g, k = np.concatenate([self.groups, groups_n[cand]]), np.concatenate([self.keys, keys_n[cand]])
        u, y = np.concatenate([self.units, units_n[cand]]), np.concatenate([self.labels, labels_n[cand]])
        order = np.lexsort((u, k, g))
        g, k, u, y = g[order], k[order], u[order], y[order]
        rank = np.arange(g.size) - np.searchsorted(g, g, side="left")
        keep = rank < self.caps_g[g]
        self.groups, self.keys, self.units, self.labels = g[keep], k[keep], u[keep], y[keep]
        full = np.flatnonzero(np.bincount(self.groups, minlength=len(self.caps_g)) >= self.caps_g)
        self._bar_g[full] = self.keys[np.searchsorted(self.groups, full, side="right") - 1]

    def members(self, group: int) -> tuple[np.ndarray, np.ndarray]:
        """The group's units and their labels, smallest key first."""
        mine = self.groups == group
        return self.units[mine], self.labels[mine]


@dataclasses.dataclass
class Sample:
    """The units one label source's tasks use: per (split, value index) its positives, per split a uniform pool
    (where negatives come from) with the pool's labels, each in key order; `units_n`: all of them, sorted."""

    values: np.ndarray  # the label values present
    counts_sv: np.ndarray  # units per (split: 0 train, 1 test; value index)
    positives: dict[tuple[int, int], np.ndarray]
    pool: dict[int, tuple[np.ndarray, np.ndarray]]
    units_n: np.ndarray

    def task(self, split: int, vi: int) -> tuple[np.ndarray, np.ndarray]:
        """Balanced (positives, negatives) of value index `vi` in one split: as many of each, in key order."""
        pos = self.positives[(split, vi)]
        pool_units, pool_labels = self.pool[split]
        neg = pool_units[pool_labels != self.values[vi]]
        n = min(len(pos), len(neg))
        return pos[:n], neg[:n]


def _chunks(sd: ShardDir, source: LabelSource, cfg):
    """(unit ids, labels, split: 1 held out) of every labelled unit, about CHUNK_UNITS at a time."""
    chunk_ex = max(1, CHUNK_UNITS // source.units_per_ex)
    for lo in range(0, sd.n_ex, chunk_ex):
        hi = min(lo + chunk_ex, sd.n_ex)
        units_n = np.arange(lo * source.units_per_ex, hi * source.units_per_ex, dtype=np.int64)
        labels_n = source.read(sd, lo, hi)
        split_n = is_test(units_n // source.units_per_ex, cfg.seed, cfg.test_frac).astype(np.int64)
        ok = labels_n >= 0  # a negative class id: unlabelled
        yield units_n[ok], labels_n[ok], split_n[ok]


def count_values(sd: ShardDir, source: LabelSource, cfg) -> tuple[np.ndarray, np.ndarray]:
    """The label values present (sorted) and each one's units per split, (2, n_values): merged chunk by chunk
    through np.unique, so memory follows the number of distinct values, never the largest id (a class id of
    2^31 - 1 is one value like any other)."""
    values, counts_sv = np.empty(0, np.int64), np.zeros((2, 0), np.int64)
    for _, labels_n, split_n in _chunks(sd, source, cfg):
        grown = np.union1d(values, labels_n)
        merged_sv = np.zeros((2, len(grown)), np.int64)
        merged_sv[:, np.searchsorted(grown, values)] = counts_sv
        index_n = np.searchsorted(grown, labels_n)
        merged_sv += np.stack([np.bincount(index_n[split_n == s], minlength=len(grown)) for s in (0, 1)])
        values, counts_sv = grown, merged_sv
    return values, counts_sv


def caps(counts_sv: np.ndarray, cfg) -> tuple[np.ndarray, np.ndarray]:
    """(positives kept per label, pool size) per split. The pool, a uniform sample of the split, is where every
    label's negatives come from: it is sized so that the most common label's other units in it are, in expectation
    with a margin of 4 standard deviations, as many as its positives; the positives' cap shrinks so positives and
    pool fit `max_units` (the pool takes at most half of it)."""
    per_label = np.array([cfg.train_per_label, cfg.test_per_label])
    budget_s = cfg.max_units * per_label // per_label.sum()  # units held per split
    n_values = counts_sv.shape[1]
    cap_s, pool_s = np.ones(2, np.int64), np.ones(2, np.int64)
    for s in (0, 1):
        n_units = int(counts_sv[s].sum())
        first = max(1, min(per_label[s], budget_s[s] // (n_values + 1)))
        other_frac = 1 - counts_sv[s].max(initial=0) / max(n_units, 1)  # the most common label's negatives
        want = (first + 4 * np.sqrt(first) + 4) / other_frac if other_frac > 0 else first
        pool_s[s] = max(1, min(int(np.ceil(want)), n_units, max(first, budget_s[s] // 2)))
        cap_s[s] = max(1, min(per_label[s], (budget_s[s] - pool_s[s]) // max(n_values, 1)))
    return cap_s, pool_s


def sample_units(sd: ShardDir, source: LabelSource, cfg) -> Sample:
    """Two passes over the labels: count each value per split; then keep, per (split, value), the units of smallest
    key (the positives) and, per split, a uniform pool (`caps`) that every label's negatives come from."""
    values, counts_sv = count_values(sd, source, cfg)
    n_values = len(values)
    cap_s, pool_s = caps(counts_sv, cfg)
    # group split * (n_values + 1) + value index; the last of each split: the pool
    bottom = BottomK(np.concatenate([np.r_[np.repeat(cap_s[s], n_values), pool_s[s]] for s in (0, 1)]))
    for units_n, labels_n, split_n in _chunks(sd, source, cfg):
        base_n = split_n * (n_values + 1)
        bottom.update(base_n + np.searchsorted(values, labels_n), uniform(units_n, cfg.seed, 1), units_n, labels_n)
        bottom.update(base_n + n_values, uniform(units_n, cfg.seed, 2), units_n, labels_n)
    positives = {(s, vi): bottom.members(s * (n_values + 1) + vi)[0] for s in (0, 1) for vi in range(n_values)}
    pool = {s: bottom.members(s * (n_values + 1) + n_values) for s in (0, 1)}
    return Sample(values, counts_sv, positives, pool, np.unique(bottom.units))
