"""saeflow.analysis.csr_stream reads an inference dump's CSR .npz row by row: what scipy itself wrote or saeflow's
CsrWriter wrote, any rows in any order, and a compressed archive refused in one line."""

import numpy as np
import pytest
import scipy.sparse

from saeflow.analysis.csr import CsrWriter
from saeflow.analysis.csr_stream import CsrFile
from saeflow.errors import SaeflowError


def _matrix(n_rows: int = 1000, n_cols: int = 50) -> np.ndarray:
    rng = np.random.default_rng(0)
    return ((rng.random((n_rows, n_cols)) < 0.1) * rng.random((n_rows, n_cols))).astype(np.float32)


def test_rows_and_gathers_equal_the_matrix_the_writer_streamed(tmp_path):
    x = _matrix()
    writer = CsrWriter(tmp_path / "acts.npz", x.shape[1])
    for lo in range(0, len(x), 128):
        writer.append(x[lo : lo + 128])
    writer.finish()
    with CsrFile(tmp_path / "acts.npz") as csr:
        assert csr.shape == x.shape
        assert np.array_equal(csr.rows(10, 300).toarray(), x[10:300])
        rows = np.array([5, 6, 7, 999, 0, 5, 500])  # runs, repeats, any order
        assert np.array_equal(csr.gather(rows).toarray(), x[rows])
        assert np.array_equal(scipy.sparse.vstack([r for _, r in csr.iter_rows(300)]).toarray(), x)
        with pytest.raises(SaeflowError, match="row index outside"):
            csr.gather(np.array([1000]))


def test_scipy_written_archives_are_read_and_compressed_ones_refused(tmp_path):
    x = _matrix(200, 30)
    scipy.sparse.save_npz(tmp_path / "plain.npz", scipy.sparse.csr_matrix(x), compressed=False)
    with CsrFile(tmp_path / "plain.npz") as csr:
        assert np.array_equal(csr.gather(np.arange(200)[::-3]).toarray(), x[::-3])
    scipy.sparse.save_npz(tmp_path / "zipped.npz", scipy.sparse.csr_matrix(x), compressed=True)
    with pytest.raises(SaeflowError, match="zipped.npz: data.npy is compressed"):
        CsrFile(tmp_path / "zipped.npz")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(SaeflowError, match="not a readable .npz"):
        CsrFile(tmp_path / "bad.npz")
