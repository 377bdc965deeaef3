"""Run by tests/test_sae_interop.py with SAELens and sparsify on PYTHONPATH (never imported by the test process).

    python _sae_peers.py JOB.json

JOB: {"inputs": x.npy, "out": results.npz, "load": {name: [library, dir]}, "create": {name: [kind, dir]},
"d_in": int, "d_sae": int, "k": int}. Each "load" directory is loaded with the library's own loader, each "create"
SAE is built with the library's own classes (random init, random biases) and saved with its own save function;
both are run on the inputs. results.npz holds <name>.codes (dense) and <name>.recon for every name, and versions.
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


def create(kind, dpath, d_in, d_sae, k):
    torch.manual_seed(0)
    if kind == "sparsify-topk":
        from sparsify import Sae, SaeConfig

        model = Sae(d_in, SaeConfig(num_latents=d_sae, k=k))
        _randomize_biases([model.encoder.bias, model.b_dec])
        model.save_to_disk(dpath)
        return model
    import sae_lens

    if kind == "saelens-standard":
        model = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(d_in=d_in, d_sae=d_sae))
    elif kind == "saelens-topk":
        model = sae_lens.TopKSAE(sae_lens.TopKSAEConfig(d_in=d_in, d_sae=d_sae, k=k))
    else:  # saelens-batchtopk: trained as BatchTopK, saved for inference as JumpReLU (one threshold)
        model = sae_lens.BatchTopKTrainingSAE(sae_lens.BatchTopKTrainingSAEConfig(d_in=d_in, d_sae=d_sae, k=k))
        model.topk_threshold = torch.tensor(0.05)
        _randomize_biases([model.b_enc, model.b_dec])
        model.save_inference_model(dpath)
        return load("saelens", dpath)
    _randomize_biases([model.b_enc, model.b_dec])
    model.save_model(dpath)
    return model


def _randomize_biases(params):
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.1)


@torch.no_grad()
def run(model, x):
    out = model.encode(x)
    if isinstance(out, torch.Tensor):  # SAELens: dense codes
        return out, model.decode(out)
    codes = torch.zeros(x.shape[0], model.num_latents).scatter_(-1, out.top_indices, out.top_acts)
    return codes, model.decode(out.top_acts, out.top_indices)


def main(job_fpath):
    job = json.loads(open(job_fpath).read())
    x = torch.from_numpy(np.load(job["inputs"]))
    results = {}
    models = {name: load(*spec) for name, spec in job["load"].items()}
    models.update({name: create(kind, dpath, job["d_in"], job["d_sae"], job["k"])
                   for name, (kind, dpath) in job["create"].items()})  # fmt: skip
    for name, model in models.items():
        codes, recon = run(model, x)
        results[f"{name}.codes"], results[f"{name}.recon"] = codes.float().numpy(), recon.float().numpy()
    import sae_lens
    import sparsify

    np.savez(job["out"], **results, versions=np.array([sae_lens.__version__, sparsify.__version__]))


if __name__ == "__main__":
    main(sys.argv[1])
