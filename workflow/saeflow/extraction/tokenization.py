"""Tokenization: how text becomes fixed-length examples, and how the tokenizer's identity is hashed.

    packing = tokenization.model_packing(info, tokenizer=None, context_length=128)  # hashed as data["tokenization"]
    ids_nt = tokenization.token_ids(info, None, dataset, packing)                   # int32 (n_ex, context_length)
    tok = tokenization.load_tokenizer(info, None)          # transformers tokenizer, for decoding and the interop engine

Text -> examples: every document is tokenized by the checkpoint's own transformers tokenizer (`AutoTokenizer`)
without special tokens; the documents' ids are concatenated, each followed by a separator (EOS for decoders,
[SEP] for BERT-style encoders, nothing when the tokenizer has neither), and cut into bodies of `context_length`
minus the special tokens; each example is prefix + body + suffix, where prefix and suffix are what the tokenizer
itself adds (`special_tokens`: GPT-2 and Qwen2 nothing, Llama [BOS], BERT [CLS] ... [SEP]). The last partial body
is dropped. One rule for `extract` and `export`: an example whose document fills it is exactly
`AutoTokenizer(doc, truncation=True, max_length=context_length)`, which is how `export` encodes a prompt
(`encode`).

Identity: the `Packing` (tokenizer name, context length, prefix, suffix and separator ids) is hashed into the shard
metadata as `data["tokenization"]`. The tokenizer is named by the model's `ckpt` when it is the model's own (its
files belong to that checkpoint revision), `bytes` for the byte tokenizer, and `<id or path>@<sha256 of its
tokenizer files>` for another checkpoint's.

Planning does not import transformers (a 3 s import) once it has seen a tokenizer: the packing's special ids and
the corpus's example count are kept in the fingerprint cache (`saeflow.extraction.fingerprints`), keyed by the tokenizer
files' sha256. The tokenizer and the packed corpus are memoized per process.
"""

import contextlib
import dataclasses
import functools
import hashlib
import typing

import numpy as np

from saeflow.errors import SaeflowError
from saeflow.extraction import models
from saeflow.store.hashing import file_sha256

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
    """The tokenizer that packs text: the byte tokenizer, or the checkpoint's transformers tokenizer
    (`AutoTokenizer`), the same object `saeflow export` encodes prompts with."""
    return load_tokenizer(info, tokenizer)


def encode(tok, text: str, max_tokens: int) -> list[int]:
    """One prompt's ids as AutoTokenizer gives them: its special tokens included, truncated to `max_tokens`."""
    return tok(text, truncation=True, max_length=max_tokens)["input_ids"]


def special_tokens(tok) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prefix, suffix): the ids the tokenizer itself puts around a sequence (AutoTokenizer's
    `add_special_tokens=True`), found by encoding a probe with and without them. GPT-2 and Qwen2 add none, Llama
    adds BOS, BERT [CLS] ... [SEP]; the byte tokenizer adds BOS."""
    if isinstance(tok, ByteTokenizer):
        return (tok.bos_token_id,), ()
    probe = "a b"
    bare = tok(probe, add_special_tokens=False)["input_ids"]
    full = tok(probe, add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return tuple(full[:start]), tuple(full[start + len(bare) :])
    raise SaeflowError(f"tokenizer {tok.name_or_path}: special tokens wrap the text in an unsupported way")


def tokenizer_files_sha256(info: models.ModelInfo, tokenizer: str | None) -> str:
    """sha256 over the name and bytes of every tokenizer file of the checkpoint (planning never loads it)."""
    if tokenizer == "bytes":
        return "bytes"
    source, revision = (tokenizer, None) if tokenizer else (info.source, info.revision)
    if source is None:
        raise SaeflowError(
            f"model {info.ckpt} has no tokenizer of its own (random init): set `tokenizer: bytes` or a checkpoint"
        )
    h = hashlib.sha256()
    found = False
    for fname in models.TOKENIZER_FILES:
        fpath = models.model_file(source, revision, fname)
        if fpath is not None:
            found = True
            h.update(f"{fname}\0{file_sha256(fpath)}\0".encode())
    if not found:
        raise SaeflowError(f"tokenizer {source!r}: no tokenizer files ({', '.join(models.TOKENIZER_FILES[:3])}, ...)")
    return h.hexdigest()


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


def tokenizer_id(info: models.ModelInfo, tokenizer: str | None, files_sha256: str) -> str:
    """The model's own tokenizer is identified by ckpt (revision included), another by its files' sha256."""
    if tokenizer is None:
        return info.ckpt
    if tokenizer == "bytes":
        return tokenizer
    return f"{tokenizer}@{files_sha256}"


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


class CorpusTooShort(SaeflowError):
    """A corpus that packs into too few examples (`Packing`); `named` puts the corpus's name in front."""


@contextlib.contextmanager
def named(dataset) -> typing.Iterator[None]:
    """A `CorpusTooShort` raised inside names the dataset (its `label`: the file or directory and its files)."""
    try:
        yield
    except CorpusTooShort as err:
        raise SaeflowError(f"{dataset.label} {err}") from None


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

    @property
    def special_ids(self) -> tuple[int, ...]:
        """The special ids an example holds ([CLS], [SEP], BOS, EOS: prefix, suffix, separators), sorted: what
        `tokens: no_special` leaves out and `evaluate` keeps clean. Packed examples have no padding."""
        return tuple(sorted({*self.prefix, *self.suffix, *self.separator}))

    def count(self, token_lists: typing.Iterable[list[int]], n_ex: int | None = None) -> tuple[int, int]:
        """(examples, largest id) that `pack` would give, streaming: memory does not grow with the corpus."""
        if self.body_len < 1:
            raise SaeflowError(f"context_length={self.context_length} leaves no room besides special tokens")
        need = None if n_ex is None else n_ex * self.body_len
        n_tokens, n_text, max_id = 0, 0, max((*self.prefix, *self.suffix, *self.separator), default=0)
        for ids in token_lists:
            n_tokens += len(ids) + len(self.separator)
            n_text += len(ids)
            max_id = max(max_id, max(ids, default=0))
            if need is not None and n_tokens >= need:
                break
        return self._n_examples(n_tokens, n_text, n_ex), max_id

    def pack(self, token_lists: typing.Iterable[list[int]], n_ex: int | None = None) -> np.ndarray:
        """int32 (n_ex, context_length); stops reading once `n_ex` examples are filled."""
        if self.body_len < 1:
            raise SaeflowError(f"context_length={self.context_length} leaves no room besides special tokens")
        need = None if n_ex is None else n_ex * self.body_len
        stream: list[int] = []
        n_text = 0
        for ids in token_lists:
            stream.extend(ids)
            stream.extend(self.separator)
            n_text += len(ids)
            if need is not None and len(stream) >= need:
                break
        n = self._n_examples(len(stream), n_text, n_ex)
        body_nb = np.asarray(stream[: n * self.body_len], np.int64).reshape(n, self.body_len)
        parts = [np.broadcast_to(np.asarray(self.prefix, np.int64), (n, len(self.prefix))), body_nb]
        parts.append(np.broadcast_to(np.asarray(self.suffix, np.int64), (n, len(self.suffix))))
        ids_nt = np.concatenate(parts, axis=1)
        if ids_nt.max() > np.iinfo(np.int32).max:
            raise SaeflowError("token ids do not fit tokens.bin (int32)")
        return ids_nt.astype(np.int32)

    def _n_examples(self, n_tokens: int, n_text: int, n_ex: int | None) -> int:
        """The examples a stream of `n_tokens` (`n_text` of them the documents' own) packs into: all of them, or
        `n_ex`; too few is a `CorpusTooShort` saying why (the caller names the corpus)."""
        n_avail = n_tokens // self.body_len
        if n_avail and (n_ex is None or n_avail >= n_ex):
            return n_avail if n_ex is None else n_ex
        n_special = self.context_length - self.body_len
        example = f"{self.body_len} tokens (context_length {self.context_length}" + (
            f" less {n_special} special tokens)" if n_special else ")"
        )
        if n_ex is not None and n_avail:
            raise CorpusTooShort(f"holds {n_text} tokens of text: {n_avail} examples of {example}, fewer than "
                                 f"n_ex={n_ex}")  # fmt: skip
        if n_text == 0:
            raise CorpusTooShort(f"holds no text: not one example of {example}")
        raise CorpusTooShort(f"holds only {n_text} tokens of text: too little for one example of {example}")


def recorded_packing(md) -> Packing | None:
    """The packing a text shard directory's metadata records (`data.tokenization`), None when it records none
    (vision, or text shards another tool wrote)."""
    obj = md.data.get("tokenization")
    if not isinstance(obj, dict):
        return None
    try:
        return Packing(**{**obj, **{key: tuple(obj[key]) for key in ("prefix", "suffix", "separator")}})
    except (KeyError, TypeError) as err:
        raise SaeflowError(f"metadata.json data.tokenization is no packing this saeflow reads ({err!r})") from None


def packing_for(tokenizer, tokenizer_name: str, context_length: int, encoder: bool) -> Packing:
    """Each example is wrapped in the tokenizer's own special tokens (`special_tokens`: what AutoTokenizer adds,
    the rule `export` follows too); documents are separated by [SEP] for encoders, else by EOS when there is one."""
    prefix, suffix = special_tokens(tokenizer)
    if encoder and tokenizer.sep_token_id is not None:
        sep = (tokenizer.sep_token_id,)
    else:
        sep = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    return Packing(tokenizer_name, context_length, prefix, suffix, sep)


def model_packing(info: models.ModelInfo, tokenizer: str | None, context_length: int) -> Packing:
    """The packing of a text model with its tokenizer option (None: its own, "bytes", or an id/path). Loading a
    transformers tokenizer costs seconds, so the result is kept in the fingerprint cache, keyed by the tokenizer
    files' sha256 and the transformers version: a re-plan reads a few small files and loads nothing."""
    from saeflow.extraction import fingerprints

    files_sha256 = tokenizer_files_sha256(info, tokenizer)
    name = tokenizer_id(info, tokenizer, files_sha256)
    encoder = info.family in models.ENCODER_FAMILIES
    key = {"what": "packing", "tokenizer_files": files_sha256, "encoder": encoder, "transformers": _version()}

    def compute() -> dict:
        packing = packing_for(packing_tokenizer(info, tokenizer), name, context_length, encoder)
        return {"prefix": packing.prefix, "suffix": packing.suffix, "separator": packing.separator}

    ids = fingerprints.cached_value(key, compute)
    return Packing(name, context_length, tuple(ids["prefix"]), tuple(ids["suffix"]), tuple(ids["separator"]))


def _version() -> str:
    import importlib.metadata

    return importlib.metadata.version("transformers")


def example_count(info: models.ModelInfo, tokenizer: str | None, dataset, packing: Packing) -> int:
    """How many examples the packed corpus has, without packing it: counted once (streaming), then from the
    fingerprint cache, keyed by the dataset's hashed description (its content fingerprint included), the packing
    and the tokenizer file's sha256. Checks the vocabulary like `token_ids`."""
    from saeflow.extraction import fingerprints

    vocab = info.config.get("vocab_size")
    key = {
        "what": "text examples",
        "data": dataset.data(),
        "n_ex": dataset.n_ex,
        "packing": dataclasses.asdict(packing),
        "tokenizer_files": tokenizer_files_sha256(info, tokenizer),
        "transformers": _version(),
        "ckpt": info.ckpt,
    }

    def compute():
        with named(dataset):
            return packing.count(tokenize(packing_tokenizer(info, tokenizer), dataset.documents()), dataset.n_ex)

    n_ex, max_id = fingerprints.cached_value(key, compute)
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
    with named(dataset):
        ids_nt = packing.pack(tokenize(tok, dataset.documents()), n_ex=dataset.n_ex)
    _check_vocab(info, packing, int(ids_nt.max()), info.config.get("vocab_size"))
    return ids_nt
