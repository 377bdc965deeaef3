"""Run inside a subprocess with lmprobe 0.10.x importable: load local lmprobe datasets with lmprobe's own
public functions (hf_hub_download pointed at a local directory) and print what it read as JSON."""

import json
import pathlib
import sys

import huggingface_hub

root = pathlib.Path(sys.argv[1])


def local_hf_hub_download(repo_id, filename, **kwargs):
    fpath = root / repo_id / filename
    if not fpath.exists():
        raise FileNotFoundError(fpath)
    return str(fpath)


huggingface_hub.hf_hub_download = local_hf_hub_download

import lmprobe  # noqa: E402
import lmprobe.sharing  # noqa: E402

out = {}
for name in sys.argv[2:]:
    tensors, info = lmprobe.sharing.load_activation_dataset(name)
    acts, labels = lmprobe.load_activations(name, return_labels=True, show_progress=False)
    meta = lmprobe.sharing.fetch_dataset_metadata(name)
    out[name] = {
        "raw": {k: v.tolist() for k, v in tensors.items()},
        "pooled": {str(k): v.tolist() for k, v in acts.items()},
        "labels": labels.tolist(),
        "model_name": meta.model_name,
        "prompts": meta.prompts,
    }
print(json.dumps(out))
