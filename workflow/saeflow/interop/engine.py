"""Run a Hugging Face text model over prompts and yield `Record`s: the engine behind every interop export.

Models are resolved and tokenized by `saeflow.models` (the extraction engine's adapters), and layer k means the
same thing there and here: the raw output of transformer block k, recorded by a forward hook. That equals
Hugging Face's `hidden_states[k + 1]` for every block but the last of pre-norm decoders (GPT-2, Llama), where
`hidden_states[-1]` has the final norm applied and we keep the raw residual stream. Causal LMs also give top-k
logits at the last prompt token, per-token NLL (perplexity) and a greedy response; encoders (BERT, MiniLM) give
activations only. Examples run one at a time so a record never depends on which prompts shared its batch.
"""

import dataclasses
import os
import typing

import numpy as np

from saeflow import models
from saeflow.errors import SaeflowError
from saeflow.interop.records import Record


ENCODERS = ("bert", "roberta")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str  # Hugging Face id or local directory
    layers: tuple[int, ...]  # block indices; negative ones count from the end
    revision: str = "main"
    max_tokens: int = 128  # prompts are truncated to this many tokens
    top_k: int = 0  # 0: no logits
    perplexity: bool = False
    response_max: int = 0  # greedy response tokens to generate (0: none)
    token_strings: bool = False
    device: str = "cpu"
    seed: int = 0


class TextEngine:
    def __init__(self, cfg: EngineConfig):
        import torch
        import transformers

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.info = models.describe(models.ModelSpec(name=cfg.model, revision=cfg.revision))
        if self.info.modality != "text":
            raise SaeflowError(f"model {cfg.model!r} is a {self.info.modality} model; interop exports need a text model")
        self.layers = self.info.resolve_layers(cfg.layers)
        self.tokenizer = models.load_tokenizer(self.info, None)
        hf_config = transformers.AutoConfig.from_pretrained(self.info.source, revision=self.info.revision)
        # BERT-style configs map to an LM-head class too, but are bidirectional encoders: no next-token logits.
        self.causal = type(hf_config) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING and self.info.family not in ENCODERS
        if not self.causal and (cfg.top_k or cfg.perplexity or cfg.response_max):
            raise SaeflowError(
                f"model {cfg.model!r} ({hf_config.model_type}) is not a causal LM: top-k logits, perplexity and "
                "responses need one (set top_k: 0, perplexity: false, response_max: 0)"
            )
        auto_cls = transformers.AutoModelForCausalLM if self.causal else transformers.AutoModel
        try:
            self.model = auto_cls.from_pretrained(self.info.source, revision=self.info.revision, dtype=torch.float32)
        except (OSError, ValueError) as err:
            raise SaeflowError(f"cannot load the weights of {self.info.ckpt}: {err}") from None
        self.model.eval().to(cfg.device)
        self.blocks = models._find_blocks(self.model.base_model)
        self.d_model = self.info.d_model

    def _forward(self, ids_t):
        """(model output, {layer: (T, D) float32 block outputs}) for one sequence."""
        import torch

        recorded = {}

        def make_hook(layer):
            def hook(module, args, output):
                recorded[layer] = (output[0] if isinstance(output, (tuple, list)) else output)[0].float().cpu()

            return hook

        handles = [self.blocks[layer].register_forward_hook(make_hook(layer)) for layer in self.layers]
        try:
            with torch.inference_mode():
                out = self.model(input_ids=ids_t[None].to(self.cfg.device), use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        return out, {layer: recorded[layer].numpy() for layer in self.layers}

    def record(self, text: str, label=None, extra: dict | None = None) -> Record:
        import torch

        cfg = self.cfg
        ids = self.tokenizer(text, truncation=True, max_length=cfg.max_tokens)["input_ids"]
        if not ids:
            raise SaeflowError(f"prompt {text[:60]!r} tokenizes to nothing")
        ids_t = torch.tensor(ids, dtype=torch.long)
        fields: dict[str, typing.Any] = {}
        if cfg.response_max:
            with torch.inference_mode():
                gen = self.model.generate(
                    ids_t[None].to(cfg.device),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=cfg.device),
                    do_sample=False,
                    max_new_tokens=cfg.response_max,
                    pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id or 0,
                )
            resp_ids = gen[0, len(ids) :].cpu()
            out, acts = self._forward(torch.cat([ids_t, resp_ids]))
            fields["response_ids"] = resp_ids.numpy().astype(np.int64)
            fields["response_text"] = self.tokenizer.decode(resp_ids, skip_special_tokens=True)
            fields["response_acts"] = {layer: a[len(ids) :].copy() for layer, a in acts.items()}
        else:
            out, acts = self._forward(ids_t)
        T = len(ids)
        if cfg.top_k:
            topk = torch.topk(out.logits[0, T - 1].float(), cfg.top_k)
            fields["topk_values"] = topk.values.cpu().numpy()
            fields["topk_indices"] = topk.indices.cpu().numpy().astype(np.int64)
        if cfg.perplexity and T > 1:
            log_probs = torch.log_softmax(out.logits[0, : T - 1].double(), dim=-1)
            fields["token_nll"] = (-log_probs.gather(1, ids_t[1:, None]).squeeze(1)).cpu().numpy()
        if cfg.token_strings:
            fields["token_strings"] = tuple(self.tokenizer.convert_ids_to_tokens(ids))
        return Record(
            text=text,
            label=label,
            acts={layer: a[:T].copy() for layer, a in acts.items()},
            token_ids=np.asarray(ids, dtype=np.int64),
            extra=dict(extra or {}),
            **fields,
        )

    def records(self, prompts: typing.Sequence[dict], progress: bool = True) -> typing.Iterator[Record]:
        """One record per prompt row ({"text", "label", "extra"}), in order, with a progress bar on stderr."""
        import tqdm

        for row in tqdm.tqdm(prompts, desc=f"forward {self.cfg.model}", unit="prompt", disable=not progress):
            yield self.record(row["text"], row.get("label"), row.get("extra"))
