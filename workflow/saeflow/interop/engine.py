"""Run a Hugging Face text model over prompts and yield `Record`s: the engine behind every interop export.

Models are resolved by `extraction.models` (the extraction adapters) and tokenized by `extraction.tokenization`,
and layer k means the same thing there and here: the raw output of transformer block k, recorded by a forward
hook. That equals Hugging Face's `hidden_states[k + 1]` for every block but the last of pre-norm decoders (GPT-2,
Llama), where `hidden_states[-1]` has the final norm applied and we keep the raw residual stream. Causal LMs also
give top-k logits at the last prompt token, per-token NLL (perplexity) and a greedy response; encoders (BERT,
MiniLM) give activations only.
"""

import dataclasses
import os
import typing

import numpy as np

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.extraction import adapters, models, tokenization
from saeflow.interop.records import Record


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What the engine runs and what each record holds; `defaults` takes the schema's for `exports.<name>`."""

    model: str  # Hugging Face id or local directory
    layers: tuple[int, ...]  # block indices; negative ones count from the end
    revision: str  # branch, tag or commit of an HF id
    max_tokens: int  # prompts are truncated to this many tokens
    batch_size: int  # prompts per forward pass (right-padded); 1 = every record from its own pass
    device: str  # torch device of the forward pass
    top_k: int = 0  # top-k logits at the last prompt token; 0: none
    perplexity: bool = False  # per-token NLL
    response_max: int = 0  # greedy response tokens to generate (0: none)
    token_strings: bool = False  # the tokenizer's string of every prompt token
    seed: int = 0  # torch seed, set before the model loads

    @classmethod
    def defaults(cls, **overrides) -> "EngineConfig":
        """The schema's defaults (revision, max_tokens, batch_size, device), with `overrides` (model and layers)."""
        return cls(**{**config.export_defaults(cls, None, "model"), **overrides})


def _load_model(info: models.ModelInfo, spec: models.ModelSpec, cfg: EngineConfig):
    """The transformers model in eval mode on cfg.device; a causal LM (`info.causal`) loads with its head."""
    import torch

    if not info.causal and (cfg.top_k or cfg.perplexity or cfg.response_max):
        raise SaeflowError(
            f"model {cfg.model!r} ({info.model_type}) is not a causal LM: top-k logits, perplexity and "
            "responses need one (set top_k: 0, perplexity: false, response_max: 0)"
        )
    torch.manual_seed(cfg.seed)
    return adapters.build(info, spec, "float32", lm_head=True).eval().to(cfg.device)


def _right_pad(ids_list: list[list[int]]):
    """Token ids (B, T) long, zero-padded on the right to the longest, and the attention mask (B, T)."""
    import torch

    T = max(len(ids) for ids in ids_list)
    ids_bt = torch.zeros(len(ids_list), T, dtype=torch.long)
    mask_bt = torch.zeros(len(ids_list), T, dtype=torch.long)
    for b, ids in enumerate(ids_list):
        ids_bt[b, : len(ids)] = torch.tensor(ids)
        mask_bt[b, : len(ids)] = 1
    return ids_bt, mask_bt


def _logit_fields(cfg: EngineConfig, ids: list[int], logits_tv) -> dict:
    """Top-k logits at the last prompt token and per-token NLL, as `cfg` asks (logits_tv may be right-padded)."""
    import torch

    fields, T = {}, len(ids)
    if cfg.top_k:
        topk = torch.topk(logits_tv[T - 1], cfg.top_k)
        fields["topk_values"] = topk.values.numpy()
        fields["topk_indices"] = topk.indices.numpy().astype(np.int64)
    if cfg.perplexity and T > 1:
        log_probs = torch.log_softmax(logits_tv[: T - 1].double(), dim=-1)
        targets = torch.tensor(ids[1:], dtype=torch.long)[:, None]
        fields["token_nll"] = (-log_probs.gather(1, targets).squeeze(1)).numpy()
    return fields


class TextEngine:
    """A text model loaded once, turning prompt rows into `Record`s (see the module docstring for what they hold)."""

    def __init__(self, cfg: EngineConfig):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.cfg = cfg
        spec = models.ModelSpec(name=cfg.model, revision=cfg.revision)
        self.info = models.describe(spec)
        if (modality := self.info.modality) != "text":
            raise SaeflowError(f"model {cfg.model!r} is a {modality} model; interop exports need a text model")
        self.layers = self.info.resolve_layers(cfg.layers)
        self.tokenizer = tokenization.load_tokenizer(self.info, None)
        self.model, self.causal = _load_model(self.info, spec, cfg), self.info.causal
        self.blocks = adapters.find_blocks(self.model.base_model)
        self.d_model = self.info.d_model

    def _forward(self, ids_bt, mask_bt=None):
        """(logits (B, T, V) or None, {layer: (B, T, D) float32 block outputs}) for right-padded sequences."""
        import torch

        if mask_bt is None:
            mask_bt = torch.ones_like(ids_bt)
        # The whole model runs (logits are needed), so the hooks must not stop it after the deepest block.
        recording = adapters.record_blocks(self.blocks, self.layers, stop_after_deepest=False)
        with recording as recorded, torch.inference_mode():
            out = self.model(input_ids=ids_bt.to(self.cfg.device), attention_mask=mask_bt.to(self.cfg.device),
                             use_cache=False)
        acts = {layer: recorded[layer].float().cpu().numpy() for layer in self.layers}
        return (out.logits.float().cpu() if self.causal else None), acts

    def tokenize(self, text: str) -> list[int]:
        ids = tokenization.encode(self.tokenizer, text, self.cfg.max_tokens)  # the rule extraction packs by too
        if not ids:
            raise SaeflowError(f"prompt {text[:60]!r} tokenizes to nothing")
        return ids

    def _respond(self, ids: list[int]) -> tuple[dict, typing.Any, dict]:
        """Greedy response fields, and the logits/activations of the prompt + response forward pass."""
        import torch

        ids_t = torch.tensor(ids, dtype=torch.long)[None]
        with torch.inference_mode():
            gen = self.model.generate(
                ids_t.to(self.cfg.device),
                attention_mask=torch.ones_like(ids_t).to(self.cfg.device),
                do_sample=False,
                max_new_tokens=self.cfg.response_max,
                pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id or 0,
            )
        resp_ids = gen[0, len(ids) :].cpu()
        logits, acts = self._forward(gen.cpu())
        fields = {
            "response_ids": resp_ids.numpy().astype(np.int64),
            "response_text": self.tokenizer.decode(resp_ids, skip_special_tokens=True),
            "response_acts": {layer: a[0, len(ids) :].copy() for layer, a in acts.items()},
        }
        return fields, logits[0], {layer: a[0] for layer, a in acts.items()}

    def _record(self, row: dict, ids: list[int], logits_tv, acts_td: dict, fields: dict) -> Record:
        """A record from one sequence's logits and activations (positions beyond len(ids) are ignored)."""
        T = len(ids)
        fields.update(_logit_fields(self.cfg, ids, logits_tv))
        if self.cfg.token_strings:
            fields["token_strings"] = tuple(self.tokenizer.convert_ids_to_tokens(ids))
        return Record(
            text=row["text"],
            label=row.get("label"),
            acts={layer: a[:T].copy() for layer, a in acts_td.items()},
            token_ids=np.asarray(ids, dtype=np.int64),
            extra=dict(row.get("extra") or {}),
            **fields,
        )

    def record(self, text: str, label=None, extra: dict | None = None) -> Record:
        return next(self.records([{"text": text, "label": label, "extra": extra}], progress=False))

    def records(self, prompts: typing.Sequence[dict], progress: bool = True) -> typing.Iterator[Record]:
        """One record per prompt row ({"text", "label", "extra"}), in order, with a progress bar on stderr.

        Prompts run `batch_size` at a time, right-padded with an attention mask (valid positions never attend to
        padding; values agree with a batch of one up to float rounding). Responses are generated one by one.
        """
        import tqdm

        bar = tqdm.tqdm(total=len(prompts), desc=f"forward {self.cfg.model}", unit="prompt", disable=not progress)
        step = 1 if self.cfg.response_max else self.cfg.batch_size
        for start in range(0, len(prompts), step):
            rows = prompts[start : start + step]
            ids_list = [self.tokenize(row["text"]) for row in rows]
            if self.cfg.response_max:
                fields, logits_tv, acts_td = self._respond(ids_list[0])
                yield self._record(rows[0], ids_list[0], logits_tv, acts_td, fields)
            else:
                logits, acts = self._forward(*_right_pad(ids_list))
                for b, (row, ids) in enumerate(zip(rows, ids_list)):
                    acts_td = {layer: a[b] for layer, a in acts.items()}
                    yield self._record(row, ids, None if logits is None else logits[b], acts_td, {})
            bar.update(len(rows))
        bar.close()
