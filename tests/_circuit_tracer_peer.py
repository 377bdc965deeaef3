"""Run by tests/test_circuit_tracer.py with circuit-tracer 0.5.0 on PYTHONPATH (never imported by the test process).

    python _circuit_tracer_peer.py JOB.json

JOB: {"model": a TransformerLens model name (in HF_HUB_CACHE) or, with "backend": "nnsight", a model directory,
"transcoders": an absolute transcoder-set or CLT directory (saeflow's export), "inputs": {layer: x.npy}, "tokens":
token ids, "prompt": text, "out": results.npz}. circuit-tracer loads the set with its own loader and the model through
the backend, runs each layer's transcoder on its inputs, records (TransformerLens) its model's activations at the
set's input and output hooks for the tokens, and builds an attribution graph of the prompt. results.npz holds layer<i>
(each transcoder's output), hook:<name> (T, d_model), the graph's replacement and completeness scores, its feature
count and nonzero edges, and circuit-tracer's version.
"""

import importlib.metadata
import json
import sys
import warnings

import numpy as np
import torch

warnings.simplefilter("ignore")


@torch.no_grad()
def transcoder_outputs(transcoders_dpath: str, inputs: dict) -> dict:
    """Each layer's transcoder, as circuit-tracer's own loader (the one ReplacementModel uses) loads the set."""
    from circuit_tracer.utils.hf_utils import load_transcoder_from_hub

    transcoders, config = load_transcoder_from_hub(transcoders_dpath, device=torch.device("cpu"), dtype=torch.float32)
    if config["model_kind"] == "cross_layer_transcoder":  # one model over every layer: inputs (L, n, d) at once
        x_lnd = torch.stack([torch.from_numpy(np.load(inputs[str(layer)])) for layer in range(len(inputs))])
        return {f"layer{layer}": y_nd.numpy() for layer, y_nd in enumerate(transcoders(x_lnd))}
    return {f"layer{layer}": transcoders[int(layer)](torch.from_numpy(np.load(fpath))).numpy()
            for layer, fpath in inputs.items()}  # fmt: skip


@torch.no_grad()
def hook_values(model, tokens: list, hooks: list) -> dict:
    """The model's own activations at each `blocks.{l}.<hook>` for the token ids (no BOS added)."""
    _, cache = model.run_with_cache(torch.tensor([tokens]), names_filter=lambda name: name in hooks)
    return {f"hook:{name}": cache[name][0].float().numpy() for name in hooks}


def main(job_fpath):
    from circuit_tracer import ReplacementModel, attribute
    from circuit_tracer.graph import compute_graph_scores

    job = json.loads(open(job_fpath).read())
    backend = job.get("backend", "transformerlens")
    model = ReplacementModel.from_pretrained(job["model"], job["transcoders"], backend=backend,
                                             device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
    results = transcoder_outputs(job["transcoders"], job["inputs"])
    if backend == "transformerlens":  # its activations by TransformerLens hook name
        hooks = [f"blocks.{layer}.{hook}" for layer in range(model.cfg.n_layers)
                 for hook in (model.transcoders.feature_input_hook, model.transcoders.feature_output_hook)]  # fmt: skip
        results.update(hook_values(model, job["tokens"], hooks))
    graph = attribute(job["prompt"], model, max_n_logits=3, batch_size=64, verbose=False)
    replacement, completeness = compute_graph_scores(graph)
    results.update(replacement=replacement, completeness=completeness, n_features=len(graph.selected_features),
                   adjacency_nonzero=int((graph.adjacency_matrix != 0).sum()),
                   version=importlib.metadata.version("circuit-tracer"))  # fmt: skip
    np.savez(job["out"], **results)


if __name__ == "__main__":
    main(sys.argv[1])
