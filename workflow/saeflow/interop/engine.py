"""Run a Hugging Face text model over prompts and yield `Record`s: the engine behind every interop export.

Hidden-state layer k = output of transformer block k = `hidden_states[k + 1]`, as in the extraction engine.
Causal LMs (GPT-2, Llama, ...) also give top-k logits at the last prompt token, per-token NLL (perplexity) and a
greedy response; encoders (BERT, MiniLM) give activations only. Examples run one at a time in fp32 on CPU so a
record does not depend on which other prompts shared its batch (no padding).
"""

import dataclasses
import os
import typing

import numpy as np

from saeflow.errors import SaeflowError
from saeflow.interop.records import Record


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str  # Hugging Face id or local directory
    layers: tuple[int, ...]
    revision: str | None = None
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
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(cfg.model, revision=cfg.revision)
            hf_config = transformers.AutoConfig.from_pretrained(cfg.model, revision=cfg.revision)
        except OSError as err:
            raise SaeflowError(f"cannot load model {cfg.model!r}: {err}") from None
        causal = type(hf_config) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING and not getattr(
            hf_config, "is_encoder_decoder", False
        )
        auto_cls = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
        if not causal and (cfg.top_k or cfg.perplexity or cfg.response_max):
            raise SaeflowError(
                f"model {cfg.model!r} ({hf_config.model_type}) is not a causal LM: top-k logits, perplexity and "
                "responses need one (set top_k: 0, perplexity: false, response_max: 0)"
            )
        self.model = auto_cls.from_pretrained(cfg.model, revision=cfg.revision, dtype=torch.float32)
        self.model.eval().to(cfg.device)
        self.causal = causal
        self.n_layers = hf_config.num_hidden_layers
        self.d_model = hf_config.hidden_size
        bad = [layer for layer in cfg.layers if not 0 <= layer < self.n_layers]
        if bad or not cfg.layers:
            raise SaeflowError(f"layers {list(cfg.layers)}: {cfg.model!r} has layers 0..{self.n_layers - 1}")
        self.revision = cfg.revision or getattr(hf_config, "_commit_hash", None)

    def _forward(self, ids_t):
        import torch

        with torch.inference_mode():
            return self.model(input_ids=ids_t[None].to(self.cfg.device), output_hidden_states=True)

    def _acts(self, out, start: int, stop: int) -> dict[int, np.ndarray]:
        return {
            layer: out.hidden_states[layer + 1][0, start:stop].float().cpu().numpy().copy() for layer in self.cfg.layers
        }

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
            out = self._forward(torch.cat([ids_t, resp_ids]))
            fields["response_ids"] = resp_ids.numpy().astype(np.int64)
            fields["response_text"] = self.tokenizer.decode(resp_ids, skip_special_tokens=True)
            fields["response_acts"] = self._acts(out, len(ids), len(ids) + len(resp_ids))
        else:
            out = self._forward(ids_t)
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
            acts=self._acts(out, 0, T),
            token_ids=np.asarray(ids, dtype=np.int64),
            extra=dict(extra or {}),
            **fields,
        )

    def records(self, prompts: typing.Sequence[dict], progress: bool = True) -> typing.Iterator[Record]:
        """One record per prompt row ({"text", "label", "extra"}), in order, with a progress bar on stderr."""
        import tqdm

        for row in tqdm.tqdm(prompts, desc=f"forward {self.cfg.model}", unit="prompt", disable=not progress):
            yield self.record(row["text"], row.get("label"), row.get("extra"))
