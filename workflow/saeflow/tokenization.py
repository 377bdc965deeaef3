"""Tokenization: how text becomes fixed-length examples, and how the tokenizer's identity is hashed.

    packing = tokenization.model_packing(info, tokenizer=None, context_length=128)  # hashed as data["tokenization"]
    ids_nt = tokenization.token_ids(info, None, dataset, packing)                   # int32 (n_ex, context_length)
    tok = tokenization.load_tokenizer(info, None)          # transformers tokenizer, for decoding and the interop engine

Text -> examples: every document is tokenized without special tokens; the documents' ids are concatenated, each
followed by a separator (EOS for decoders, [SEP] for BERT-style encoders, nothing when the tokenizer has neither),
and cut into bodies of `context_length` minus the special tokens; each example is prefix + body + suffix (decoders:
[BOS] + body when the tokenizer has BOS; encoders: [CLS] + body + [SEP]). The last partial body is dropped.

Identity: the `Packing` (tokenizer name, context length, prefix, suffix and separator ids) is hashed into the shard
metadata as `data["tokenization"]`. The tokenizer is named by the model's `ckpt` when it is the model's own (its
files belong to that checkpoint revision), `bytes` for the byte tokenizer, and `<id or path>@<tokenizer.json
sha256>` for another checkpoint's.

Packing reads tokenizer.json with the `tokenizers` library (`FileTokenizer`), not transformers (a 3 s import), so
planning stays fast; its ids are those of the transformers fast tokenizer, which wraps the same file. The packing
tokenizer and the packed corpus are memoized per process: Snakemake plans, then the CLI extracts, each once.
"""

import dataclasses
import functools
import pathlib
import typing

import numpy as np

from saeflow import models
from saeflow.errors import SaeflowError
from saeflow.hashing import file_sha256

# Special tokens a tokenizer class sets by default when its files do not name them.
DEFAULT_SPECIAL_TOKENS = {"gpt2": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}}
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "cls_token", "sep_token")


# ---------------------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------------------


def from_pretrained(source: str, revision: str | None = None):
    """A checkpoint's transformers tokenizer (HF id or local directory), for whole documents (no length limit)."""
    import transformers

    try:
        tok = transformers.AutoTokenizer.from_pretrained(source, revision=revision)
    except (OSError, ValueError) as err:
        raise SaeflowError(f"cannot load the tokenizer {source!r}: {err}") from None
    tok.model_max_length = 1 << 62  # whole documents are tokenized, then packed; silences the length warning
    return tok


def load_tokenizer(info: models.ModelInfo, tokenizer: str | None):
    """The model's own tokenizer, another checkpoint's (`tokenizer: <id or path>`), or the byte tokenizer."""
    if tokenizer == "bytes":
        return ByteTokenizer()
    source = tokenizer or info.source
    if source is None:
        raise SaeflowError(
            f"model {info.ckpt} has no tokenizer of its own (random init): set `tokenizer: bytes` or a checkpoint"
        )
    return from_pretrained(source, info.revision if tokenizer is None else None)


@functools.lru_cache(maxsize=8)
def packing_tokenizer(info: models.ModelInfo, tokenizer: str | None):
    """The tokenizer used to pack text: like `load_tokenizer`, but straight from tokenizer.json with the
    `tokenizers` library when the checkpoint has one (no transformers import, so planning stays fast). Same ids as
    the transformers fast tokenizer, which wraps the same file."""
    if tokenizer == "bytes" or (tokenizer is None and info.source is None):
        return load_tokenizer(info, tokenizer)
    source, revision = (tokenizer, None) if tokenizer else (info.source, info.revision)
    if not pathlib.Path(source).is_dir():
        import huggingface_hub.errors

        try:
            huggingface_hub.hf_hub_download(source, "config.json", revision=revision)
        except (huggingface_hub.errors.HFValidationError, ValueError):
            raise SaeflowError(f"tokenizer {source!r}: not a local directory nor a valid Hugging Face id") from None
        except Exception:  # tokenizer-only repositories have no config.json; the files below decide
            pass
    tokenizer_fpath = models.model_file(source, revision, "tokenizer.json")
    if tokenizer_fpath is None:
        return load_tokenizer(info, tokenizer)
    special = dict(DEFAULT_SPECIAL_TOKENS.get(info.family, {}) if tokenizer is None else {})
    for fname in ("special_tokens_map.json", "tokenizer_config.json"):
        fpath = models.model_file(source, revision, fname)
        for key, value in (models.read_json(fpath) if fpath else {}).items():
            if key in SPECIAL_TOKEN_KEYS and value is not None:
                special[key] = value["content"] if isinstance(value, dict) else value
    return FileTokenizer(tokenizer_fpath, special)


class FileTokenizer:
    """A `tokenizers.Tokenizer` loaded from tokenizer.json, with the checkpoint's special tokens."""

    def __init__(self, fpath: pathlib.Path, special: dict[str, str]):
        import tokenizers

        try:
            self.tok = tokenizers.Tokenizer.from_file(str(fpath))
        except Exception as err:  # the Rust library raises its own exception type
            raise SaeflowError(f"{fpath}: unreadable tokenizer ({err})") from None
        self.tok.no_truncation()  # whole documents are tokenized, then packed
        self.tok.no_padding()
        self.name_or_path = str(fpath.parent)
        self.sha256 = file_sha256(fpath)
        for key in SPECIAL_TOKEN_KEYS:
            setattr(self, f"{key}_id", self.tok.token_to_id(special[key]) if key in special else None)

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict:
        encodings = self.tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings]}


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 3..258) with BOS=1, EOS=2: needs no files, for random-init text models."""

    name_or_path = "bytes"
    bos_token_id = 1
    eos_token_id = 2
    cls_token_id = None
    sep_token_id = None
    vocab_size = 259

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict:
        return {"input_ids": [[b + 3 for b in text.encode("utf-8")] for text in texts]}


def tokenizer_id(info: models.ModelInfo, tokenizer: str | None, tok) -> str:
    """The model's own tokenizer is identified by ckpt (revision included), another by its tokenizer.json sha256."""
    if tokenizer is None:
        return info.ckpt
    if tokenizer == "bytes":
        return tokenizer
    return f"{tokenizer}@{getattr(tok, 'sha256', 'no-tokenizer.json')}"


def tokenize(tokenizer, documents: typing.Iterable[str], batch_docs: int = 64) -> typing.Iterator[list[int]]:
    """Token ids of each document (no special tokens), in order, tokenized in batches."""
    batch: list[str] = []
    for doc in documents:
        batch.append(doc)
        if len(batch) == batch_docs:
            yield from tokenizer(batch, add_special_tokens=False)["input_ids"]
            batch = []
    if batch:
        yield from tokenizer(batch, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------------------------
# Packing text into fixed-length examples
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Packing:
    """How documents become examples of exactly `context_length` tokens; hashed inside `data` as `tokenization`.

    The documents' tokens (no special tokens) are concatenated with `separator` after every document, and cut
    into bodies of `context_length - len(prefix) - len(suffix)` tokens; each example is prefix + body + suffix.
    Decoders get prefix [BOS] when the tokenizer has one; BERT-style encoders get [CLS] ... [SEP]. The last
    partial body is dropped.
    """

    tokenizer: str  # the tokenizer's identity (see `tokenizer_id`)
    context_length: int  # tokens per example, special tokens included
    prefix: tuple[int, ...]  # ids before each body
    suffix: tuple[int, ...]  # ids after each body
    separator: tuple[int, ...]  # ids after each document

    @property
    def body_len(self) -> int:
        return self.context_length - len(self.prefix) - len(self.suffix)

    def count(self, token_lists: typing.Iterable[list[int]], n_ex: int | None = None) -> tuple[int, int]:
        """(examples, largest id) that `pack` would give, streaming: memory does not grow with the corpus."""
        if self.body_len < 1:
            raise SaeflowError(f"context_length={self.context_length} leaves no room besides special tokens")
        need = None if n_ex is None else n_ex * self.body_len
        n_tokens, max_id = 0, max((*self.prefix, *self.suffix, *self.separator), default=0)
        for ids in token_lists:
            n_tokens += len(ids) + len(self.separator)
            max_id = max(max_id, max(ids, default=0))
            if need is not None and n_tokens >= need:
                break
        n_avail = n_tokens // self.body_len
        if n_avail == 0 or (n_ex is not None and n_avail < n_ex):
            raise SaeflowError(
                f"the corpus has {n_tokens} tokens: {n_avail} examples of {self.body_len} tokens"
                + (f", fewer than n_ex={n_ex}" if n_ex is not None else " (empty dataset)")
            )
        return (n_avail if n_ex is None else n_ex), max_id

    def pack(self, token_lists: typing.Iterable[list[int]], n_ex: int | None = None) -> np.ndarray:
        """int32 (n_ex, context_length); stops reading once `n_ex` examples are filled."""
        if self.body_len < 1:
            raise SaeflowError(f"context_length={self.context_length} leaves no room besides special tokens")
        need = None if n_ex is None else n_ex * self.body_len
        stream: list[int] = []
        for ids in token_lists:
            stream.extend(ids)
            stream.extend(self.separator)
            if need is not None and len(stream) >= need:
                break
        n_avail = len(stream) // self.body_len
        if n_avail == 0 or (n_ex is not None and n_avail < n_ex):
            raise SaeflowError(
                f"the corpus has {len(stream)} tokens: {n_avail} examples of {self.body_len} tokens"
                + (f", fewer than n_ex={n_ex}" if n_ex is not None else " (empty dataset)")
            )
        n = n_avail if n_ex is None else n_ex
        body_nb = np.asarray(stream[: n * self.body_len], np.int64).reshape(n, self.body_len)
        parts = [np.broadcast_to(np.asarray(self.prefix, np.int64), (n, len(self.prefix))), body_nb]
        parts.append(np.broadcast_to(np.asarray(self.suffix, np.int64), (n, len(self.suffix))))
        ids_nt = np.concatenate(parts, axis=1)
        if ids_nt.max() > np.iinfo(np.int32).max:
            raise SaeflowError("token ids do not fit tokens.bin (int32)")
        return ids_nt.astype(np.int32)


def packing_for(tokenizer, tokenizer_name: str, context_length: int, encoder: bool) -> Packing:
    """[CLS] body [SEP] for encoders whose tokenizer has both; else [BOS] body, documents ended by EOS."""
    if encoder and tokenizer.cls_token_id is not None and tokenizer.sep_token_id is not None:
        prefix, suffix, sep = (tokenizer.cls_token_id,), (tokenizer.sep_token_id,), (tokenizer.sep_token_id,)
    else:
        prefix = () if tokenizer.bos_token_id is None else (tokenizer.bos_token_id,)
        suffix = ()
        sep = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    return Packing(tokenizer_name, context_length, prefix, suffix, sep)


def model_packing(info: models.ModelInfo, tokenizer: str | None, context_length: int) -> Packing:
    """The packing of a text model with its tokenizer option (None: its own, "bytes", or an id/path)."""
    tok = packing_tokenizer(info, tokenizer)
    encoder = info.family in models.ENCODER_FAMILIES
    return packing_for(tok, tokenizer_id(info, tokenizer, tok), context_length, encoder)


def example_count(info: models.ModelInfo, tokenizer: str | None, dataset, packing: Packing) -> int:
    """How many examples the packed corpus has, without packing it: counted once (streaming), then from the
    fingerprint cache, keyed by the dataset's hashed description (its content fingerprint included), the packing
    and the tokenizer file's sha256. Checks the vocabulary like `token_ids`."""
    from saeflow import fingerprints

    tok = packing_tokenizer(info, tokenizer)
    vocab = info.config.get("vocab_size")
    key = {
        "what": "text examples",
        "data": dataset.data(),
        "n_ex": dataset.n_ex,
        "packing": dataclasses.asdict(packing),
        "tokenizer_sha256": getattr(tok, "sha256", None),
        "ckpt": info.ckpt,
    }
    n_ex, max_id = fingerprints.cached_value(
        key, lambda: packing.count(tokenize(tok, dataset.documents()), dataset.n_ex)
    )
    _check_vocab(info, packing, max_id, vocab)
    return n_ex


def _check_vocab(info: models.ModelInfo, packing: Packing, max_id: int, vocab: int | None) -> None:
    if vocab is not None and max_id >= vocab:
        raise SaeflowError(
            f"the tokenizer {packing.tokenizer} produces id {max_id} but {info.ckpt} has a vocabulary of "
            f"{vocab}: tokenizer and model do not match"
        )


@functools.lru_cache(maxsize=4)
def token_ids(info: models.ModelInfo, tokenizer: str | None, dataset, packing: Packing) -> np.ndarray:
    """int32 (n_ex, context_length): the packed corpus (the expensive part of planning a text spec)."""
    tok = packing_tokenizer(info, tokenizer)
    ids_nt = packing.pack(tokenize(tok, dataset.documents()), n_ex=dataset.n_ex)
    _check_vocab(info, packing, int(ids_nt.max()), info.config.get("vocab_size"))
    return ids_nt
