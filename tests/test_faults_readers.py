"""Hostile and broken interop sources: `saeflow convert` refuses each within its memory budget, in one line.

Every case runs the real CLI in a fresh subprocess with `--memory-budget 64 MiB` and checks: exit 1, one stderr
line `saeflow convert: error: ...` naming the offending file, no traceback, no output directory, no payload marker,
and a peak RSS (that process's own, from wait4) below 512 MiB + the budget.
"""

import gzip
import hashlib
import json
import os
import pathlib
import pickle
import struct
import sys
import zlib

import numpy as np
import pytest

from peak_rss import run_measured
from saeflow.interop import lmprobe, pickle_shards, zarr_store
from saeflow.interop.records import Record

BUDGET = 64 << 20
RSS_SLACK = 512 << 20
SHARD = "shard_0001.pkl.gz"
HIDDEN0 = lmprobe.HIDDEN_FILE_PATTERN.format(layer=0, shard=0)
MARKER = "pwned-marker"
ZEROS_64MIB_GZ = gzip.compress(b"\0" * (64 << 20), compresslevel=9)  # one gzip member; members concatenate


def records(n=3, n_tokens=4, d=8):
    rng = np.random.default_rng(0)
    return [Record(text=f"prompt {i}", label=i % 2,
                   acts={layer: rng.standard_normal((n_tokens, d)).astype(np.float32) for layer in (0, 1)})
            for i in range(n)]


# ---------------------------------------------------------------------------------------------------------------
# Hostile gzip-pickle shards (a checksum in metadata.json does not help: the attacker writes both)
# ---------------------------------------------------------------------------------------------------------------


def binunicode(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def memo_codecs_bomb() -> bytes:
    """1 MiB str memoized once, then 8192 x `_codecs.encode(memo, 'latin1')`: 8 GiB from ~8 KB gzipped."""
    head = b"\x80\x02c_codecs\nencode\nq\x00" + binunicode("a" * (1 << 20)) + b"q\x01h\x01" + binunicode("latin1")
    return head + b"\x86q\x02](" + b"h\x00h\x02R" * 8192 + b"e."


def object_ndarray() -> bytes:
    return b"\x80\x02cnumpy\nndarray\n(J\x00\x00\x00\x10\x85" + binunicode("O") + b"tR."


def object_dtype() -> bytes:
    return b"\x80\x02cnumpy\ndtype\n" + binunicode("O8") + b"\x89\x88\x87R."


def reconstruct(shape_ops: bytes, state: bytes = b"") -> bytes:
    """numpy's own array pickle (`_reconstruct(ndarray, shape, b'b')` then BUILD) with our shape/state."""
    return (b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n" + shape_ops + b"C\x01b\x87R"
            + state + b".")


def huge_state() -> bytes:
    dtype = (b"cnumpy\ndtype\n" + binunicode("f4") + b"\x89\x88\x87R(K\x03" + binunicode("<")
             + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb")
    return reconstruct(b"K\x00\x85", b"(K\x01\x8a\x06\x00\x00\x00\x00\x00\x01\x85" + dtype + b"\x89C\x04\0\0\0\0tb")


def declared_bomb() -> bytes:
    return gzip.compress(b"\x80\x04\x8e" + struct.pack("<Q", 6 << 30)) + ZEROS_64MIB_GZ * 96


def streamed_bomb() -> bytes:
    """A protocol 0 unicode line that never ends: 6 GiB of zeros and no newline."""
    return gzip.compress(b"V") + ZEROS_64MIB_GZ * 96


def bytes_list_bomb() -> bytes:
    """Many 16 MiB bytes objects (each alone within the budget) in one list: 6 GiB in total."""
    one = gzip.compress(b"\x8e" + struct.pack("<Q", 16 << 20) + b"\0" * (16 << 20), compresslevel=9)
    return gzip.compress(b"\x80\x04](") + one * 384 + gzip.compress(b"e.")


def ref_list_bomb() -> bytes:
    """One list, then 30 M appends of a memo reference (2 bytes each): about 20x amplification."""
    return gzip.compress(b"\x80\x02](K\x00" + b"2" * (30 << 20) + b"e.", compresslevel=9)


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


def item(**overrides):
    base = {"sample_idx": 0, "activation": np.zeros((4, 8), np.float32), "text_preview": "x", "metadata": {}}
    return {k: v for k, v in {**base, **overrides}.items() if v is not ...}


def shard_of(layer_items) -> bytes:
    return gzip.compress(pickle.dumps({"layer_0": layer_items, "layer_1": layer_items}, protocol=4))


PICKLE_SHARDS = {
    "memo_codecs_8gib": lambda: gzip.compress(memo_codecs_bomb()),
    "object_ndarray_2gib": lambda: gzip.compress(object_ndarray()),
    "object_dtype": lambda: gzip.compress(object_dtype()),
    "huge_reconstruct_shape": lambda: gzip.compress(reconstruct(b"\x8a\x06\x00\x00\x00\x00\x00\x01\x85")),
    "huge_setstate_shape": lambda: gzip.compress(huge_state()),
    "gzip_bomb_declared_6gib": declared_bomb,
    "gzip_bomb_endless_line": streamed_bomb,
    "gzip_bomb_many_bytes": bytes_list_bomb,
    "memo_reference_list": ref_list_bomb,
    "long4_declared_huge": lambda: gzip.compress(b"\x80\x02\x8b\xff\xff\xff\x7f"),
    "binunicode8_declared_huge": lambda: gzip.compress(b"\x80\x04\x8d" + struct.pack("<Q", 1 << 62)),
    "frame_declared_huge": lambda: gzip.compress(b"\x80\x04\x95" + struct.pack("<Q", 1 << 40)),
    "os_system_payload": lambda: gzip.compress(pickle.dumps({"layer_0": [Evil()]}, protocol=2)),
    "builtins_eval": lambda: gzip.compress(b"\x80\x02c__builtin__\neval\n" + binunicode("1") + b"\x85R."),
    "newobj_refused": lambda: gzip.compress(b"\x80\x02cnumpy\nndarray\n)\x81."),
    "set_refused": lambda: gzip.compress(b"\x80\x04\x8f."),
    "truncated_gzip": lambda: shard_of([item()])[:40],
    "garbled_stream": lambda: gzip.compress(bytes(np.random.default_rng(1).integers(0, 256, 4096, np.uint8))),
    "not_gzip": lambda: b"\x80\x02}.",
    "item_without_sample_idx": lambda: shard_of([item(sample_idx=...)]),
    "activation_is_a_list": lambda: shard_of([item(activation=[[0.0] * 8] * 4)]),
    "sample_idx_is_a_str": lambda: shard_of([item(sample_idx="0")]),
    "top_level_is_a_list": lambda: gzip.compress(pickle.dumps([item()], protocol=2)),
}


def pickle_source(tmp: pathlib.Path, name: str) -> tuple[pathlib.Path, str]:
    dpath = tmp / "src"
    opts = pickle_shards.PickleOptions.defaults(samples_per_shard=8)
    pickle_shards.write(records(1), dpath, {"model_name": "m"}, opts)
    payload = PICKLE_SHARDS[name]()
    (dpath / SHARD).chmod(0o644)
    (dpath / SHARD).write_bytes(payload)
    md_fpath = dpath / pickle_shards.METADATA_FNAME
    md_fpath.chmod(0o644)
    md = json.loads(md_fpath.read_text())
    md["shards"][0]["checksum"] = "sha256:" + hashlib.sha256(payload).hexdigest()
    md_fpath.write_text(json.dumps(md))
    return dpath, SHARD


def metadata_source(tmp: pathlib.Path, name: str) -> tuple[pathlib.Path, str]:
    dpath = tmp / "src"
    pickle_shards.write(records(1), dpath, {"model_name": "m"}, pickle_shards.PickleOptions.defaults())
    md_fpath = dpath / pickle_shards.METADATA_FNAME
    md_fpath.chmod(0o644)
    if name == "metadata_not_json":
        md_fpath.write_text('{"version": "1.0", "shards": [')
    elif name == "metadata_wrong_types":
        md = json.loads(md_fpath.read_text())
        md["shards"][0]["num_samples"] = "many"
        md_fpath.write_text(json.dumps(md))
    else:  # metadata_huge: 8 MiB of JSON is 128 MiB of objects at worst
        md_fpath.write_text(json.dumps({"version": "1.0", "pad": [[]] * (3 << 20)}))
    return dpath, pickle_shards.METADATA_FNAME


# ---------------------------------------------------------------------------------------------------------------
# Broken lmprobe datasets
# ---------------------------------------------------------------------------------------------------------------


def safetensors_bytes(header: dict, data: bytes = b"", n_header: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if n_header is None else n_header) + raw + data


LMPROBE_FAULTS = {
    "safetensors_offsets_past_end": (HIDDEN0, lambda: safetensors_bytes(
        {"hidden.layer_0": {"dtype": "F32", "shape": [3, 8], "data_offsets": [0, 96]}}, b"\0" * 16)),
    "safetensors_absurd_shape": (HIDDEN0, lambda: safetensors_bytes(
        {"hidden.layer_0": {"dtype": "F32", "shape": [1 << 40, 1 << 20], "data_offsets": [0, 1 << 62]}})),
    "safetensors_header_length_huge": (HIDDEN0, lambda: safetensors_bytes({}, n_header=1 << 60)),
    "safetensors_header_garbled": (HIDDEN0, lambda: struct.pack("<Q", 12) + b"{not json..."),
    "safetensors_object_dtype": (HIDDEN0, lambda: safetensors_bytes(
        {"hidden.layer_0": {"dtype": "O", "shape": [3, 8], "data_offsets": [0, 96]}}, b"\0" * 96)),
    "parquet_index_garbled": (lmprobe.PARQUET_PATH, lambda: b"PAR1" + b"\x13" * 200 + b"PAR1"),
}


def lmprobe_source(tmp: pathlib.Path, name: str) -> tuple[pathlib.Path, str]:
    dpath = tmp / "src"
    lmprobe.write(records(), dpath, "m", None, lmprobe.LmprobeOptions.defaults(top_k=0, perplexity=False))
    rel, make = LMPROBE_FAULTS[name]
    (dpath / rel).chmod(0o644)
    (dpath / rel).write_bytes(make())
    return dpath, pathlib.Path(rel).name


# ---------------------------------------------------------------------------------------------------------------
# Broken Zarr stores
# ---------------------------------------------------------------------------------------------------------------


def edit_zmeta(dpath: pathlib.Path, edit) -> None:
    fpath = dpath / ".zmetadata"
    zmeta = json.loads(fpath.read_text())
    edit(zmeta["metadata"])
    fpath.chmod(0o644)
    fpath.write_text(json.dumps(zmeta))


def _set(key, field, value):
    return lambda meta: meta[key].__setitem__(field, value)


def _zlib_bomb_chunk(dpath: pathlib.Path) -> None:
    key = "arrays/prompt_activations/.zarray"
    edit_zmeta(dpath, _set(key, "compressor", {"id": "zlib", "level": 1}))
    for fpath in (dpath / "arrays/prompt_activations").glob("[0-9]*"):
        fpath.unlink()
    (dpath / "arrays/prompt_activations/0.0.0.0").write_bytes(zlib.compress(b"\0" * (200 << 20), 9))


def _blosc_len_lies(dpath: pathlib.Path) -> None:
    fpath = dpath / "arrays/prompt_len/0"
    raw = bytearray(fpath.read_bytes())
    raw[4:8] = struct.pack("<I", 1 << 31)
    fpath.write_bytes(bytes(raw))


def _lens_past_p_max(dpath: pathlib.Path) -> None:
    import numcodecs

    (dpath / "arrays/prompt_len/0").write_bytes(numcodecs.Blosc().encode(np.array([1 << 30] * 3, np.int32)))


def _write(rel: str, data: bytes):
    return lambda dpath: (dpath / rel).write_bytes(data)


ZARR_FAULTS = {
    "zarray_huge_chunks": (".zmetadata", lambda d: edit_zmeta(
        d, _set("arrays/prompt_activations/.zarray", "chunks", [1, 1, 1 << 20, 1 << 20]))),
    "zarray_huge_shape": (".zmetadata", lambda d: edit_zmeta(
        d, _set("arrays/prompt_activations/.zarray", "shape", [3, 2, 1 << 40, 8]))),
    "zarray_small_array_huge_shape": (".zmetadata", lambda d: edit_zmeta(
        d, _set("arrays/prompt_len/.zarray", "shape", [1 << 40]))),
    "zarray_shape_not_ints": (".zmetadata", lambda d: edit_zmeta(
        d, _set("arrays/prompt_activations/.zarray", "shape", ["3", 2, 4, 8]))),
    "chunk_decompresses_past_declared": ("prompt_activations", _zlib_bomb_chunk),
    "blosc_header_lies": ("prompt_len", _blosc_len_lies),
    "lengths_past_p_max": ("prompt_activations", _lens_past_p_max),
    "zmetadata_garbled": (".zmetadata", _write(".zmetadata", b'{"metadata": {')),
    "prompts_rows_malformed": ("prompts.jsonl", _write("text/prompts.jsonl", b'{"i": 0}\n[1]\n"x"\n')),
}


def zarr_source(tmp: pathlib.Path, name: str) -> tuple[pathlib.Path, str]:
    dpath = tmp / "src"
    opts = zarr_store.ZarrOptions.defaults(prompt_max=4, response_max=0, t_chunk_prompt=2)
    zarr_store.write_store(records(), 3, dpath, {"model_id": "m"}, opts)
    for p in [dpath, *dpath.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    offender, make = ZARR_FAULTS[name]
    make(dpath)
    return dpath, offender


def manifest_source(tmp: pathlib.Path, name: str) -> tuple[pathlib.Path, str]:
    dpath = tmp / "src"
    dpath.mkdir()
    (dpath / zarr_store.MANIFEST_FNAME).write_text(json.dumps({"shards": [{"path": "../../etc", "num_samples": 1}]}))
    return dpath, zarr_store.MANIFEST_FNAME


CASES = ([(pickle_source, n) for n in PICKLE_SHARDS]
         + [(metadata_source, n) for n in ("metadata_not_json", "metadata_wrong_types", "metadata_huge")]
         + [(lmprobe_source, n) for n in LMPROBE_FAULTS]
         + [(zarr_source, n) for n in ZARR_FAULTS] + [(manifest_source, "manifest_path_escapes_root")])


@pytest.mark.parametrize(("make", "name"), CASES, ids=[n for _, n in CASES])
@pytest.mark.slow
def test_hostile_source_is_refused_within_budget(make, name, tmp_path):
    src, offender = make(tmp_path, name)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "saeflow", "convert", str(src), "--to", "pickle", str(out),
            "--memory-budget", str(BUDGET)]
    rc, stdout, stderr, peak_bytes = run_measured(argv, tmp_path)
    assert rc == 1, (rc, stdout, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("saeflow convert: error: "), stderr
    assert offender in lines[0], (offender, stderr)
    assert "Traceback" not in stdout + stderr
    assert not out.exists() and not (tmp_path / MARKER).exists()
    assert peak_bytes < RSS_SLACK + BUDGET, f"{name}: peak RSS {peak_bytes / 2**20:.0f} MiB"
    print(f"{name}: peak RSS {peak_bytes / 2**20:.0f} MiB; {lines[0]}")


@pytest.mark.slow
def test_budget_option_is_documented_and_validated(tmp_path):
    rc, stdout, _, _ = run_measured([sys.executable, "-m", "saeflow", "convert", "--help"], tmp_path)
    assert rc == 0 and "--memory-budget" in stdout and "1 GiB" in stdout
    rc, _, stderr, _ = run_measured([sys.executable, "-m", "saeflow", "convert", "x", "--to", "pickle", "y",
                                     "--memory-budget", "0"], tmp_path)
    assert rc == 2 and "not a positive number of bytes" in stderr


@pytest.mark.slow
def test_legit_sources_still_load_within_a_small_budget(tmp_path):
    """The budget refuses hostile files, not ordinary ones: each format converts under 64 MiB, bit-identical."""
    recs = records()
    srcs = {"pickle": pickle_shards.write(recs, tmp_path / "p", {"model_name": "m"},
                                          pickle_shards.PickleOptions.defaults(samples_per_shard=2)),
            "lmprobe": lmprobe.write(recs, tmp_path / "l", "m", None,
                                     lmprobe.LmprobeOptions.defaults(top_k=0, storage="full_sequence"))}
    for name, src in srcs.items():
        out = tmp_path / f"{name}-out"
        rc, _, stderr, _ = run_measured([sys.executable, "-m", "saeflow", "convert", str(src), "--to", "pickle",
                                         str(out), "--memory-budget", str(BUDGET)], tmp_path)
        assert rc == 0, stderr
        for rec, back in zip(recs, pickle_shards.PickleShards(out, BUDGET).records(), strict=True):
            assert all(np.array_equal(back.acts[layer], rec.acts[layer]) for layer in (0, 1))
