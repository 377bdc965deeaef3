"""Run in a subprocess with another zarr-python first on sys.path (test_interop_zarr's cross-version tests).

    python _zarr_other_version.py read STORE OUT.npz   plain zarr-python reads a saeflow store: every array
                                                       under arrays/, the root attrs (JSON) and zarr's version
    python _zarr_other_version.py write STORE          saeflow writes `synthetic_records()` with this zarr-python

`synthetic_records` is imported by the test too, so both sides write the same values.
"""

import json
import sys

import numpy as np

N_SAMPLES, LAYERS, WIDTH, P_MAX, R_MAX = 5, (2, 4), 6, 8, 4


def synthetic_records():
    """Deterministic records of varied prompt and response lengths (some past P_max / R_max), int labels."""
    from saeflow.interop.records import Record

    rng = np.random.default_rng(7)
    out = []
    for i in range(N_SAMPLES):
        p, r = 3 + 2 * i, 1 + i
        out.append(Record(
            text=f"prompt {i}", label=i % 2, extra={"source": f"s{i}"},
            acts={layer: rng.standard_normal((p, WIDTH), dtype=np.float32) for layer in LAYERS},
            response_text=f"response {i}", response_ids=np.zeros(r, np.int64),
            response_acts={layer: rng.standard_normal((r, WIDTH), dtype=np.float32) for layer in LAYERS},
        ))
    return out


def options():
    from saeflow.interop import zarr_store

    return zarr_store.ZarrOptions.defaults(prompt_max=P_MAX, response_max=R_MAX, t_chunk_prompt=4)


def read(store: str, out_fpath: str) -> None:
    import zarr

    root = zarr.open_consolidated(store, mode="r")
    arrays = {f"arrays/{name}": arr[:] for name, arr in root["arrays"].arrays()}
    np.savez(out_fpath, zarr_version=np.array(zarr.__version__), attrs=np.array(json.dumps(dict(root.attrs))),
             **arrays)


def write(store: str) -> None:
    from saeflow.interop import zarr_store

    zarr_store.write_store(synthetic_records(), N_SAMPLES, store, {"model_id": "synthetic"}, options())


if __name__ == "__main__":
    if sys.argv[1] == "read":
        read(sys.argv[2], sys.argv[3])
    else:
        write(sys.argv[2])
