"""The tokens a latent's decoder direction promotes and suppresses, and the page's search by token."""

import torch

from saeflow.analysis.visuals.examples import TextExamples
from saeflow.analysis.visuals.settings import VisualsConfig
from saeflow.extraction import models


def vocab_matrix(family: str, name: str) -> tuple[torch.Tensor, str]:
    """(vocabulary x d_model matrix, what it is): a causal LM's unembedding, else the input word embeddings.

    Only that one tensor is read from the checkpoint's safetensors (a 7B model is not loaded to read its LM head);
    a checkpoint without safetensors is loaded whole.
    """
    import transformers

    causal = models.is_causal_lm(family)
    what = "unembedding (the LM head)" if causal else (
        "input word embeddings: an encoder has no unembedding, so these are the tokens whose embeddings the "
        "decoder direction points towards / away from, not a logit effect"
    )
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    with torch.device("meta"):
        skeleton = auto.from_config(transformers.AutoConfig.from_pretrained(name))
    weight = (skeleton.get_output_embeddings() if causal else skeleton.get_input_embeddings()).weight
    names = [n for n, p in skeleton.named_parameters(remove_duplicate=False) if p is weight]
    prefix = f"{skeleton.base_model_prefix}."
    keys = [*names, *(n.removeprefix(prefix) for n in names), *(prefix + n for n in names)]
    tensor = _safetensors_tensor(name, keys)
    if tensor is None:
        model = auto.from_pretrained(name)
        tensor = (model.get_output_embeddings() if causal else model.get_input_embeddings()).weight.detach()
    return tensor.float(), what


def _safetensors_tensor(name: str, keys: list[str]) -> torch.Tensor | None:
    """The first of `keys` stored in the checkpoint's safetensors (single file or sharded index), else None."""
    from safetensors import safe_open

    index_fpath = models.model_file(name, None, "model.safetensors.index.json")
    if index_fpath is not None:
        weight_map = models.read_json(index_fpath).get("weight_map", {})
        files = {key: weight_map[key] for key in keys if key in weight_map}
    else:
        files = dict.fromkeys(keys, "model.safetensors")
    for key, fname in files.items():
        fpath = models.model_file(name, None, fname)
        if fpath is None:
            return None
        with safe_open(str(fpath), framework="pt") as st:
            if key in st.keys():
                return st.get_tensor(key)
    return None


def vocab_effects(cfg: VisualsConfig, examples, family: str, model, chosen: list[int]) -> tuple[dict, str]:
    """{latent: {"promote": [[token, value]...], "suppress": [...]}} from decoder row x vocabulary matrix, and a note
    saying which matrix (or why there are none)."""
    if not isinstance(examples, TextExamples) or examples.tokenizer is None:
        return {}, "" if examples.kind != "text" else "no tokenizer, so no promoted tokens"
    try:
        W_vd, what = vocab_matrix(family, examples.name)
    except Exception as err:  # noqa: BLE001 - no weights here (random-init model, offline cache miss): say why
        return {}, f"promoted tokens unavailable: cannot load the weights of {examples.name} ({type(err).__name__})"
    if W_vd.shape[1] != model.W_dec.shape[1]:  # the decoder's width: its input's (an SAE) or its target's
        d_vocab, d_dec = W_vd.shape[1], model.W_dec.shape[1]
        return {}, f"promoted tokens unavailable: {examples.name} has d={d_vocab}, the SAE's decoder writes d={d_dec}"
    with torch.no_grad():
        effects_sv = model.W_dec[chosen].float() @ W_vd.T  # the direction's sign and ranking (scale is positive)
    n = min(cfg.n_vocab, W_vd.shape[0])
    out = {}
    for j, latent in enumerate(chosen):
        order = torch.argsort(effects_sv[j], descending=True, stable=True).tolist()
        out[latent] = {
            key: [[examples.token_text(i), round(float(effects_sv[j, i]), 4)] for i in ids]
            for key, ids in (("promote", order[:n]), ("suppress", order[::-1][:n]))
        }
    return out, what


def token_index(drawn: dict) -> dict[str, list]:
    """{token (stripped, lower case): [[latent, "top" | "promoted"], ...]}: the page's search by token."""
    index: dict[str, list] = {}
    for latent, entry in drawn.items():
        for ctx in entry.get("contexts", []):
            key = ctx["tokens"][ctx["token"] - ctx["offset"]].strip().lower()
            if key and [int(latent), "top"] not in index.setdefault(key, []):
                index[key].append([int(latent), "top"])
        for tok, _ in entry.get("promote", []):
            key = tok.strip().lower()
            if key and [int(latent), "promoted"] not in index.setdefault(key, []):
                index[key].append([int(latent), "promoted"])
    return index
