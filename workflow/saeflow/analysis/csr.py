"""A streaming writer of CSR matrices in the `.npz` layout that `scipy.sparse.load_npz` reads.

Rows arrive in order, a batch at a time; the three CSR arrays are appended to raw side files, so memory is bounded
by one batch whatever the number of rows. `finish` streams the side files into an uncompressed `.npz` (a zip of
`.npy` files: `format`, `shape`, `data`, `indices`, `indptr`) and removes them. Index arrays are int32 when they
fit, as scipy itself writes them, else int64. Every zip entry is dated `ZIP_DATE_TIME` (scipy and `zipfile.writestr`
stamp the write time), so the same matrix is the same bytes.
"""

import io
import pathlib
import zipfile

import numpy as np

COPY_ELEMS = 1 << 22  # elements per chunk when streaming a side file into the zip
INT32_MAX = np.iinfo(np.int32).max
ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest a zip header holds; numpy's own savez entries carry it too


class CsrWriter:
    """Append dense row batches (zeros dropped) and write `<fpath>` as a scipy CSR `.npz` at the end."""

    def __init__(self, fpath: pathlib.Path, n_cols: int):
        self.fpath = pathlib.Path(fpath)
        self.n_cols = n_cols
        self.n_rows = 0
        self.nnz = 0
        self._side = {
            name: self.fpath.parent / f".{self.fpath.name}.{name}" for name in ("data", "indices", "indptr")
        }
        self._fds = {name: open(fpath, "wb") for name, fpath in self._side.items()}
        self._fds["indptr"].write(np.zeros(1, dtype=np.int64).tobytes())

    def append(self, x_bs: np.ndarray) -> None:
        """Append rows (b, n_cols); only non-zero entries are stored."""
        if x_bs.ndim != 2 or x_bs.shape[1] != self.n_cols:
            raise ValueError(f"rows must have shape (b, {self.n_cols}), got {x_bs.shape}")
        rows_n, cols_n = np.nonzero(x_bs)
        self.append_nonzero(rows_n, cols_n, x_bs[rows_n, cols_n], x_bs.shape[0])

    def append_nonzero(self, rows_n: np.ndarray, cols_n: np.ndarray, vals_n: np.ndarray, n_rows: int) -> None:
        """Append `n_rows` rows given as their non-zero entries in row-major order (as `np.nonzero` returns them)."""
        counts_b = np.bincount(rows_n, minlength=n_rows)
        indptr_b = self.nnz + np.cumsum(counts_b, dtype=np.int64)
        self._fds["data"].write(np.ascontiguousarray(vals_n, dtype=np.float32).tobytes())
        self._fds["indices"].write(cols_n.astype(np.int64).tobytes())
        self._fds["indptr"].write(indptr_b.tobytes())
        self.n_rows += n_rows
        self.nnz += len(rows_n)

    def finish(self) -> None:
        """Write the `.npz` and remove the side files."""
        for fd in self._fds.values():
            fd.close()
        idx_dtype = np.int32 if max(self.nnz, self.n_cols) <= INT32_MAX else np.int64
        with zipfile.ZipFile(self.fpath, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            _write_small(zf, "format", np.array(b"csr"))
            _write_small(zf, "shape", np.array([self.n_rows, self.n_cols], dtype=np.int64))
            _write_streamed(zf, "data", self._side["data"], np.float32, np.float32, self.nnz)
            _write_streamed(zf, "indices", self._side["indices"], np.int64, idx_dtype, self.nnz)
            _write_streamed(zf, "indptr", self._side["indptr"], np.int64, idx_dtype, self.n_rows + 1)
        for fpath in self._side.values():
            fpath.unlink()

    def abort(self) -> None:
        for fd in self._fds.values():
            fd.close()
        for fpath in self._side.values():
            fpath.unlink(missing_ok=True)


def _write_small(zf: zipfile.ZipFile, name: str, arr: np.ndarray) -> None:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, allow_pickle=False)
    zf.writestr(_entry(name), buf.getvalue())


def _entry(name: str) -> zipfile.ZipInfo:
    """The zip entry of `<name>.npy`, dated ZIP_DATE_TIME (not the write time)."""
    return zipfile.ZipInfo(f"{name}.npy", date_time=ZIP_DATE_TIME)


def _write_streamed(zf, name, src_fpath, src_dtype, dst_dtype, n: int) -> None:
    """Copy a raw array file into `<name>.npy` inside the zip, converting dtype chunk by chunk."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dst_dtype)), "fortran_order": False, "shape": (n,)}
    with zf.open(_entry(name), "w", force_zip64=True) as out, open(src_fpath, "rb") as src:
        np.lib.format.write_array_header_2_0(out, header)
        item_bytes = np.dtype(src_dtype).itemsize
        while chunk := src.read(COPY_ELEMS * item_bytes):
            out.write(np.frombuffer(chunk, dtype=src_dtype).astype(dst_dtype, copy=False).tobytes())
