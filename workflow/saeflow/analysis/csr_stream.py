"""Read rows of an inference dump's `patch_acts.npz` (scipy CSR, saeflow.analysis.csr) without loading it.

The `.npz` that `saeflow.analysis.csr.CsrWriter` writes is an uncompressed zip of `.npy` files, so each array is one run
of bytes inside the file: `CsrFile` finds where `data`, `indices` and `indptr` start and reads any range of rows, or any
set of rows, with `pread` into fresh arrays. Memory is what the rows read hold, never the whole matrix (a memory map
would keep every page it touched resident). Probing (saeflow.analysis.probe) and the benchmarks read dumps so.
"""

import io
import os
import pathlib
import struct
import zipfile

import numpy as np
import scipy.sparse

from saeflow.errors import SaeflowError, unreadable

LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip member's local file header (PKWARE APPNOTE 4.3.7)
ARRAYS = ("data", "indices", "indptr", "shape")


class CsrFile:
    """A CSR `.npz` on disk: `shape`, and rows read on demand (`rows`, `gather`)."""

    def __init__(self, fpath: str | os.PathLike):
        self.fpath = pathlib.Path(fpath)
        try:
            self._fd = os.open(self.fpath, os.O_RDONLY)
        except OSError as err:
            raise unreadable(self.fpath, err) from None
        try:
            self._arrays = _locate_arrays(self.fpath, self._fd)
        except BaseException:
            os.close(self._fd)
            raise
        self.shape = tuple(int(v) for v in self._read("shape", 0, 2))
        if self._arrays["indptr"][2] != self.shape[0] + 1:
            self.close()
            raise SaeflowError(f"{self.fpath}: indptr has {self._arrays['indptr'][2]} entries for {self.shape[0]} rows")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "CsrFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Elements lo..hi-1 of one array."""
        offset, dtype, n = self._arrays[name]
        if not 0 <= lo <= hi <= n:
            raise SaeflowError(f"{self.fpath}: {name}[{lo}:{hi}] is outside its {n} entries")
        want = (hi - lo) * dtype.itemsize
        buf = os.pread(self._fd, want, offset + lo * dtype.itemsize)
        if len(buf) != want:
            raise SaeflowError(f"{self.fpath}: ended early reading {name} (truncated?)")
        return np.frombuffer(buf, dtype=dtype).copy()

    def rows(self, lo: int, hi: int) -> scipy.sparse.csr_matrix:
        """Rows lo..hi-1 as a CSR matrix (hi - lo, n_cols)."""
        indptr = self._read("indptr", lo, hi + 1).astype(np.int64)
        start, stop = int(indptr[0]), int(indptr[-1])
        data, indices = self._read("data", start, stop), self._read("indices", start, stop)
        return scipy.sparse.csr_matrix((data, indices, indptr - start), shape=(hi - lo, self.shape[1]))

    def gather(self, rows_n: np.ndarray) -> scipy.sparse.csr_matrix:
        """The given rows (any order, repeats allowed) as a CSR matrix (n, n_cols): one read per run of consecutive
        rows, so rows of one example come in one read."""
        rows_n = np.asarray(rows_n, dtype=np.int64)
        if rows_n.size and (rows_n.min() < 0 or rows_n.max() >= self.shape[0]):
            raise SaeflowError(f"{self.fpath}: row index outside 0..{self.shape[0] - 1}")
        uniq = np.unique(rows_n)
        starts = np.r_[0, np.flatnonzero(np.diff(uniq) != 1) + 1]
        stops = np.r_[starts[1:], len(uniq)]
        data, indices, counts = [], [], []
        for lo, hi in zip(uniq[starts].tolist(), (uniq[stops - 1] + 1).tolist()):
            indptr = self._read("indptr", lo, hi + 1).astype(np.int64)
            data.append(self._read("data", int(indptr[0]), int(indptr[-1])))
            indices.append(self._read("indices", int(indptr[0]), int(indptr[-1])))
            counts.append(np.diff(indptr))
        if not counts:
            return scipy.sparse.csr_matrix((len(rows_n), self.shape[1]), dtype=np.float32)
        indptr = np.r_[0, np.cumsum(np.concatenate(counts))]
        stacked = scipy.sparse.csr_matrix((np.concatenate(data), np.concatenate(indices), indptr),
                                          shape=(len(uniq), self.shape[1]))  # fmt: skip
        return stacked[np.searchsorted(uniq, rows_n)]

    def iter_rows(self, rows_per_chunk: int):
        """(first row, CSR chunk) over every row, in order."""
        for lo in range(0, self.shape[0], rows_per_chunk):
            yield lo, self.rows(lo, min(lo + rows_per_chunk, self.shape[0]))


def _locate_arrays(fpath: pathlib.Path, fd: int) -> dict[str, tuple[int, np.dtype, int]]:
    """name -> (byte offset of its first element, dtype, element count) of each array of the npz."""
    try:
        with zipfile.ZipFile(fpath) as zf:
            infos = {info.filename.removesuffix(".npy"): info for info in zf.infolist()}
    except (zipfile.BadZipFile, OSError) as err:
        raise SaeflowError(f"{fpath}: not a readable .npz archive ({err})") from None
    if missing := [name for name in ARRAYS if name not in infos]:
        raise SaeflowError(f"{fpath}: not a scipy CSR .npz (no {', '.join(missing)})")
    arrays = {}
    for name in ARRAYS:
        info = infos[name]
        if info.compress_type != zipfile.ZIP_STORED:
            raise SaeflowError(f"{fpath}: {name}.npy is compressed; saeflow reads dumps stored uncompressed, as "
                               "`saeflow inference` writes them")  # fmt: skip
        head = os.pread(fd, LOCAL_HEADER.size, info.header_offset)
        fields = LOCAL_HEADER.unpack(head)
        member_offset = info.header_offset + LOCAL_HEADER.size + fields[-2] + fields[-1]
        arrays[name] = _npy_array(fpath, fd, name, member_offset)
    return arrays


def _npy_array(fpath: pathlib.Path, fd: int, name: str, member_offset: int) -> tuple[int, np.dtype, int]:
    """(offset of the data, dtype, count) of a 1-d `.npy` stored at `member_offset`."""
    stream = io.BytesIO(os.pread(fd, 4096, member_offset))  # magic + header: a few hundred bytes for a 1-d array
    try:
        version = np.lib.format.read_magic(stream)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        if version not in read_header:
            raise ValueError(f".npy format version {version}")
        shape, fortran, dtype = read_header[version](stream)
    except ValueError as err:
        raise SaeflowError(f"{fpath}: {name}.npy has no readable .npy header ({err})") from None
    if len(shape) != 1 or fortran or dtype.hasobject:
        raise SaeflowError(f"{fpath}: {name}.npy is not a 1-d array of numbers")
    return member_offset + stream.tell(), dtype, int(shape[0])
