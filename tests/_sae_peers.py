"""Run by tests/test_sae_interop.py with SAELens and sparsify on PYTHONPATH (never imported by the test process).

    python _sae_peers.py JOB.json

JOB: {"inputs": x.npy, "out": results.npz, "load": {name: [library, dir]}}. Each directory (a saeflow export) is
loaded with the library's own loader and run on the inputs. results.npz holds <name>.codes (dense), <name>.recon
(the codes decoded) and <name>.forward (the model's forward output: a transcoder's prediction, skip path included) for
every name, and versions.
"""

import json
import sys
import warnings

import numpy as np
import torch

warnings.simplefilter("ignore")


def load(library, dpath):
    if library == "saelens":
        from sae_lens import SAE

        return SAE.load_from_disk(dpath, device="cpu")
    from sparsify import Sae

    return Sae.load_from_disk(dpath, device="cpu")


@torch.no_grad()
def run(model, x):
    out = model.encode(x)
    if isinstance(out, torch.Tensor):  # SAELens: dense codes
        return out, model.decode(out), model(x)
    codes = torch.zeros(x.shape[0], model.num_latents).scatter_(-1, out.top_indices, out.top_acts)
    return codes, model.decode(out.top_acts, out.top_indices), model(x).sae_out


def main(job_fpath):
    job = json.loads(open(job_fpath).read())
    x = torch.from_numpy(np.load(job["inputs"]))
    results = {}
    for name, spec in job["load"].items():
        for key, value in zip(("codes", "recon", "forward"), run(load(*spec), x)):
            results[f"{name}.{key}"] = value.float().numpy()
    import sae_lens
    import sparsify

    np.savez(job["out"], **results, versions=np.array([sae_lens.__version__, sparsify.__version__]))


if __name__ == "__main__":
    main(sys.argv[1])
