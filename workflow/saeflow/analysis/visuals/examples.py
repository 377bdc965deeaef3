"""What a row of the shards looks like to a person: an image (rebuilt from the hashed `data`, cropped as the model saw
it) or a token sequence (tokens.bin, shown with the tokenizer's own detokenization)."""

import dataclasses
import logging

import numpy as np
from PIL import Image

from saeflow.extraction import datasets, tokenization
from saeflow.store import layout

logger = logging.getLogger(__name__)

class Examples:
    """Access to the source examples in shard order; `kind` is "image", "text" or "none"."""

    kind = "none"

    def image(self, ex: int) -> Image.Image:
        raise NotImplementedError

    def tokens(self, ex: int) -> list[str]:
        raise NotImplementedError


class ImageExamples(Examples):
    """Images rebuilt from the hashed `data` description, cropped as the model saw them."""

    kind = "image"

    def __init__(self, dataset, preprocess: "datasets.Preprocess | datasets.ProcessorPreprocess | None"):
        self.dataset = dataset
        self.preprocess = preprocess
        # ImageFolder has one class per example (classes.bin), no patch labels: its caption names the class.
        self.patch_labels = not isinstance(dataset, datasets.ImageFolder)

    def caption(self, ex: int) -> str:
        if isinstance(self.dataset, datasets.ImageFolder):
            return f"ex {ex} {self.dataset.classes[self.dataset.items[ex][1]]}"
        return f"ex {ex}"

    def image(self, ex: int) -> Image.Image:
        if isinstance(self.dataset, datasets.GeneratedImages):
            img = Image.fromarray(self.dataset.image(ex)[0])
        else:
            img = Image.open(self.dataset.items[ex][0]).convert("RGB")
        if self.preprocess is not None:
            return self.preprocess.view(img)
        side = min(img.size)
        left, top = (img.width - side) // 2, (img.height - side) // 2
        return img.crop((left, top, left + side, top + side))


class TextExamples(Examples):
    """Token ids from tokens.bin, shown with the tokenizer's own detokenization (ids when it cannot be loaded)."""

    kind = "text"

    def __init__(self, token_ids_nt: np.ndarray, tokenizer_name: str):
        self.token_ids_nt = token_ids_nt
        self.name = tokenizer_name
        try:
            self.tokenizer = tokenization.from_pretrained(tokenizer_name)
        except Exception as err:  # noqa: BLE001 - any failure means "show ids"
            logger.warning("tokenizer %s not loadable (%s); showing token ids (pass --tokenizer PATH_OR_ID)",
                           tokenizer_name, err)
            self.tokenizer = None
        self.special_ids = set(getattr(self.tokenizer, "all_special_ids", None) or ())

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""

    def pieces(self, ex: int, start: int, stop: int) -> tuple[list[str], list[int]]:
        """Tokens start..stop-1 of an example as the text pieces they add to the decoded string (leading spaces and
        subword joins as the tokenizer detokenizes: "a", " base", "class"), and the offsets of special tokens."""
        ids = [int(i) for i in self.token_ids_nt[ex]]
        if self.tokenizer is None:
            return [f"#{i}" for i in ids[start:stop]], []
        lead = ids[max(0, start - 1) : start]  # one token of left context, so a word piece joins (no space) right
        prev, out = self._decode(lead), []
        for j in range(start, stop):
            text = self._decode(lead + ids[start : j + 1])
            out.append(text[len(prev) :] if text.startswith(prev) else self._decode([ids[j]]))
            prev = text
        return out, [j - start for j in range(start, stop) if ids[j] in self.special_ids]

    def tokens(self, ex: int) -> list[str]:
        return self.pieces(ex, 0, self.token_ids_nt.shape[1])[0]

    def token_text(self, token_id: int) -> str:
        """One vocabulary entry as a reader sees it (the tokenizer's token string: "##ing", "Ġthe" -> " the")."""
        text = self._decode([token_id])
        return text if text.strip() else repr(text)


def _preprocess_from(pre: dict | None):
    """The geometry recorded in `data["preprocess"]`: the processor's settings, or the resize-and-crop fields."""
    if not pre:
        return None
    if pre.get("mode") == "processor":  # only its geometry is used here: no processor is loaded
        return datasets.ProcessorPreprocess("", None, pre["settings"], pre["image_size"], pre["patch_size"])
    pre_names = {f.name for f in dataclasses.fields(datasets.Preprocess)}
    return datasets.Preprocess(**{k: v for k, v in pre.items() if k in pre_names})


def open_examples(sd, tokenizer: str | None = None) -> Examples:
    """Text: `tokenizer`, else the model directory recorded in provenance.json by extraction, else the name the
    shards were tokenized with (an HF id). Images: the dataset rebuilt from the metadata."""
    md = sd.metadata
    if sd.has_aux(layout.ShardLayout.TOKENS_FNAME):
        recorded = (sd.provenance() or {}).get("model_source")
        name = tokenizer or recorded or md.data.get("tokenization", {}).get("tokenizer") or md.ckpt
        return TextExamples(sd.aux(layout.ShardLayout.TOKENS_FNAME), name)
    cls = getattr(datasets, str(md.data.get("__class__")), None)
    if cls in (datasets.ImageFolder, datasets.SegFolder, datasets.GeneratedImages):
        names = {f.name for f in dataclasses.fields(cls)}
        dataset = cls(**{k: v for k, v in md.data.items() if k in names})
        return ImageExamples(dataset, _preprocess_from(md.data.get("preprocess")))
    return Examples()
