"""A SAELens or sparsify checkpoint directory read as untrusted input, before its files become an SAE (sae_formats).

Every check here runs before the next file, or the next byte of the weights, is read, so a hostile directory is
refused in one line (SaeflowError naming the file) holding at most `MAX_CFG_BYTES` and `MAX_HEADER_BYTES`:

- cfg.json and the weights file: regular files only (fstat on a non-blocking descriptor: a FIFO, a device or a
  directory is refused without a read), cfg.json at most `MAX_CFG_BYTES`;
- cfg.json's values: the types the library itself gives them (a boolean is a JSON boolean, a size a positive
  integer), the sizes the library requires (`REQUIRED`), every `k` within the SAE's latents, hook names well formed;
- the safetensors header (8-byte little-endian length + JSON): at most `MAX_HEADER_BYTES` and `MAX_TENSORS`, every
  tensor's dtype one saeflow computes in, its shape the one cfg.json's sizes give it, its bytes tiling the file to
  its end; only then are the tensors read (`weights_bytes` is the most that takes);
- the values: finite, and a float64 tensor only when float32 holds every value exactly;
- after the format's mapping (`check_all_read`): every tensor was used, so none is silently dropped.
"""

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import stat

import torch

from saeflow.errors import SaeflowError, read_problem
from saeflow.interop.budget import fmt_bytes
from saeflow.interop.checkpoints import hooknames
from saeflow.training import archs

MAX_CFG_BYTES = 1 << 20  # a SAELens training cfg.json is a few KB
MAX_HEADER_BYTES = 1 << 20  # an SAE has at most a few tensors: a few hundred bytes of header each
MAX_TENSORS = 64
LIBRARIES = {"saelens": "SAELens", "sparsify": "sparsify", "circuit-tracer": "circuit-tracer",
             "circuit-tracer-clt": "circuit-tracer"}  # fmt: skip
# the safetensors dtypes saeflow reads: float32 as it is, float16 and bfloat16 exactly widened, float64 only exact
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
_CHUNK_ITEMS = 1 << 22  # float64 -> float32 check granularity (32 MiB of float64)

_SIZE, _BOOL, _NAME = "a positive integer", "a JSON boolean (true or false)", "a string"
# key -> what its value must be, as each library reads cfg.json (SAELens SAEConfig and subclasses; sparsify
# SparseCoderConfig plus `d_in`); None in an optional non-boolean key means the library's default
SAELENS_KEYS = {"architecture": _NAME, "d_in": _SIZE, "d_sae": _SIZE, "d_out": _SIZE, "k": _SIZE,
                "apply_b_dec_to_input": _BOOL, "rescale_acts_by_decoder_norm": _BOOL, "dtype": _NAME,
                "device": _NAME, "normalize_activations": _NAME, "reshape_activations": _NAME, "hook_name": _NAME,
                "hook_name_out": _NAME, "metadata": "an object"}  # fmt: skip
SAELENS_METADATA_KEYS = {"hook_name": _NAME, "hook_name_out": _NAME, "training_architecture": _NAME,
                         "training_architecture_details": "an object", "saeflow": "an object"}  # fmt: skip
SPARSIFY_KEYS = {"activation": _NAME, "transcode": _BOOL, "skip_connection": _BOOL, "multi_topk": _BOOL,
                 "normalize_decoder": _BOOL, "k": _SIZE, "num_latents": "a non-negative integer",
                 "expansion_factor": _SIZE, "d_in": _SIZE, "saeflow": "an object"}  # fmt: skip
# keys without a default in the library (SAELens SAEConfig: d_in, d_sae; sparsify `load_from_disk` pops d_in); an
# architecture's own: `Arch.saelens_required` (TopKSAEConfig's k defaults to 100, which saeflow does not guess)
REQUIRED = {"saelens": ("d_in", "d_sae"), "sparsify": ("d_in",)}
# tensor -> its shape in sizes (d_in, d_sae, d_out); any other tensor is per latent, (d_sae,)
SHAPES = {
    "saelens": {"W_enc": ("d_in", "d_sae"), "W_dec": ("d_sae", "d_out"), "b_dec": ("d_out",),
                "W_skip": ("d_out", "d_in")},
    "sparsify": {"encoder.weight": ("d_sae", "d_in"), "W_dec": ("d_sae", "d_in"), "b_dec": ("d_in",),
                 "W_skip": ("d_in", "d_in")},
    "circuit-tracer": {"W_enc": ("d_sae", "d_in"), "W_dec": ("d_sae", "d_out"), "b_dec": ("d_out",),
                       "W_skip": ("d_out", "d_in")},
    # a CLT's files name each tensor with its layer (W_enc_3): the shape is the name's without it
    "circuit-tracer-clt": {"W_enc": ("d_sae", "d_in"), "W_dec": ("d_sae", "n_out", "d_out"), "b_dec": ("d_out",)},
}  # fmt: skip
# a format whose config gives no sizes: they come from these tensors' shapes in the header (size -> (tensor, axis))
HEADER_SIZES = {"circuit-tracer": {"d_sae": ("b_enc", 0), "d_in": ("W_enc", 1), "d_out": ("b_dec", 0)},
                "circuit-tracer-clt": {"d_sae": ("b_enc_0", 0), "d_in": ("W_enc_0", 1), "d_out": ("b_dec_0", 0)}}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The SAE's sizes as cfg.json gives them; the weights' shapes must agree."""

    d_in: int
    d_sae: int
    d_out: int
    n_out: int = 1  # the layers a CLT's decoder writes (its W_dec_i: d_sae x n_out x d_out)

    def shape(self, fmt: str, name: str) -> tuple[int, ...]:
        base = name.rstrip("0123456789").removesuffix("_") if fmt == "circuit-tracer-clt" else name
        return tuple(getattr(self, size) for size in SHAPES[fmt].get(base, ("d_sae",)))


class Tensors(dict):
    """The weights file's tensors (float32), remembering which the format's mapping read (`check_all_read`)."""

    def __init__(self, tensors: dict):
        super().__init__(tensors)
        self.used: set[str] = set()

    def __getitem__(self, name):
        self.used.add(name)
        return super().__getitem__(name)

    def get(self, name, default=None):
        if name in self:
            self.used.add(name)
        return super().get(name, default)


# ---------------------------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------------------------

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))  # fmt: skip


def open_regular(fpath: pathlib.Path):
    """(binary file, size) of a regular file: opened non-blocking (a FIFO opens at once), its type from fstat."""
    try:
        fd = os.open(fpath, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as err:
        raise SaeflowError(f"{fpath}: {read_problem(err)}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a plain file")
        raise SaeflowError(f"{fpath}: {kind}, not a regular file; refusing to read it")
    return os.fdopen(fd, "rb"), st.st_size


def read_cfg(fpath: pathlib.Path, yaml_file: bool = False) -> dict:
    """cfg.json (a YAML file: circuit-tracer's config.yaml) as an object, refused before reading when over
    `MAX_CFG_BYTES` or not a regular file."""
    fd, size = open_regular(fpath)
    with fd:
        if size > MAX_CFG_BYTES:
            raise SaeflowError(f"{fpath}: {fmt_bytes(size)}, more than the {fmt_bytes(MAX_CFG_BYTES)} a cfg.json may "
                               "be; refusing to read it")  # fmt: skip
        data = fd.read(MAX_CFG_BYTES + 1)
    if len(data) > MAX_CFG_BYTES:
        raise SaeflowError(f"{fpath}: grew past {fmt_bytes(MAX_CFG_BYTES)} while read; refusing")
    try:
        cfg = _safe_yaml(data) if yaml_file else json.loads(data)
    except (ValueError, RecursionError) as err:
        raise SaeflowError(f"{fpath}: not valid {'YAML' if yaml_file else 'JSON'} "
                           f"({' '.join(str(err).split())[:120]})") from None  # fmt: skip
    if not isinstance(cfg, dict):
        raise SaeflowError(f"{fpath}: holds a {type(cfg).__name__}, not a config object")
    return cfg


def _safe_yaml(data: bytes):
    """YAML's plain data only (no tags that build objects); its errors as ValueError."""
    import yaml

    try:
        return yaml.safe_load(data)
    except yaml.YAMLError as err:
        raise ValueError(str(err)) from None


# ---------------------------------------------------------------------------------------------------------------
# cfg.json
# ---------------------------------------------------------------------------------------------------------------


def _saelens_required(name: str, cfg: dict) -> tuple[str, ...]:
    """The keys the architecture a SAELens cfg.json names needs beyond the common ones (`Arch.saelens_required`);
    none for a name saeflow does not map (the format mapping refuses it, saying why)."""
    try:
        return archs.from_saelens(name, cfg, transcoder=name.endswith("transcoder")).saelens_required
    except archs.Unsupported:
        return ()


def check_cfg(fmt: str, cfg: dict, fpath: pathlib.Path) -> Sizes:
    """cfg.json's values typed as the library types them, its required keys there, its `k`s within d_sae, its hook
    names well formed; the sizes it gives the SAE."""
    _check_types(cfg, SAELENS_KEYS if fmt == "saelens" else SPARSIFY_KEYS, fpath, "")
    inner = {"saelens": ("metadata", SAELENS_METADATA_KEYS), "sparsify": ("saeflow", {"hookpoint": _NAME})}[fmt]
    nested = cfg.get(inner[0]) or {}
    _check_types(nested, inner[1], fpath, f"{inner[0]}.")
    architecture = cfg.get("architecture", "standard") if fmt == "saelens" else cfg.get("activation", "topk")
    required = REQUIRED[fmt] + (_saelens_required(architecture, cfg) if fmt == "saelens" else ())
    missing = [key for key in required if cfg.get(key) is None]
    if missing:
        raise SaeflowError(f"{fpath}: no {', '.join(missing)} (a {LIBRARIES[fmt]} {architecture!r} cfg.json has "
                           f"{', '.join(required)}); refusing to guess")  # fmt: skip
    if fmt == "saelens":
        sizes = Sizes(cfg["d_in"], cfg["d_sae"], cfg.get("d_out") or cfg["d_in"])
        details = nested.get("training_architecture_details") or {}
        _check_types(details, {"k": _SIZE}, fpath, "metadata.training_architecture_details.")
        ks = {"k": cfg.get("k"), "metadata.training_architecture_details.k": details.get("k")}
        names = {key: cfg[key] for key in ("hook_name", "hook_name_out") if key in cfg}
        names.update({f"metadata.{key}": nested[key] for key in ("hook_name", "hook_name_out") if key in nested})
    else:
        d_in = cfg["d_in"]
        sizes = Sizes(d_in, cfg.get("num_latents") or d_in * (cfg.get("expansion_factor") or 32), d_in)
        ks = {"k": cfg.get("k", 32)}  # sparsify's default
        names = {"saeflow.hookpoint": nested.get("hookpoint")}
    for key, k in ks.items():
        if k is not None and k > sizes.d_sae:
            raise SaeflowError(f"{fpath}: {key}={k} is more than the SAE's {sizes.d_sae} latents")
    for key, name in names.items():
        if name is not None and not hooknames.well_formed(fmt, name):
            raise SaeflowError(f"{fpath}: {key} {name[:80]!r} is not a {LIBRARIES[fmt]} hook name (dotted "
                               f"identifiers, e.g. {hooknames.EXAMPLES[fmt]})")  # fmt: skip
    return sizes


def _check_types(cfg: dict, kinds: dict, fpath: pathlib.Path, prefix: str) -> None:
    for key, kind in kinds.items():
        value = cfg.get(key)
        if (value is not None or kind == _BOOL and key in cfg) and not _is(value, kind):
            raise SaeflowError(f"{fpath}: {prefix}{key} is {_describe(value)}, not {kind}")


def _is(value, kind: str) -> bool:
    if kind == _BOOL:
        return type(value) is bool
    if kind == _NAME:
        return isinstance(value, str)
    if kind == "an object":
        return isinstance(value, dict)
    return type(value) is int and (value >= 1 or (value == 0 and kind.startswith("a non-negative")))


def _describe(value) -> str:
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    kind = {dict: "an object", list: "an array", bool: "a boolean", int: "an integer", float: "a number"}
    return "null" if value is None else f"{json.dumps(value)[:40]} ({kind[type(value)]})"


# ---------------------------------------------------------------------------------------------------------------
# the weights file
# ---------------------------------------------------------------------------------------------------------------


def weights_bytes(sizes: Sizes, fmt: str, names) -> int:
    return sum(math.prod(sizes.shape(fmt, name)) for name in names) * 4


def read_weights(fpath: pathlib.Path, fmt: str, sizes: Sizes | None, cfg_fname: str) -> tuple[Tensors, str]:
    """(the tensors as float32, the file's sha256), every tensor checked against its header entry and `sizes`
    (None: the format's `HEADER_SIZES`, from the header) before a byte of the data is read; the file is read once,
    through one descriptor."""
    fd, size = open_regular(fpath)
    with fd:
        digest = hashlib.sha256()
        header, data_start = _read_header(fd, fpath, size, digest)
        sizes = sizes or _header_sizes(header, fpath, fmt)
        layout = _check_header(header, fpath, fmt, sizes, size - data_start, cfg_fname)
        tensors = {}
        for name, dtype, shape, n_bytes in layout:
            buf = bytearray(n_bytes)
            if fd.readinto(buf) != n_bytes:
                raise SaeflowError(f"{fpath}: ended inside tensor {name!r} (truncated while read)")
            digest.update(buf)
            tensors[name] = _float32(torch.frombuffer(buf, dtype=dtype).reshape(shape) if n_bytes else
                                     torch.empty(shape, dtype=dtype), fpath, name)  # fmt: skip
    return Tensors(tensors), digest.hexdigest()


def _read_header(fd, fpath: pathlib.Path, size: int, digest) -> tuple[dict, int]:
    head = fd.read(8)
    n_header = int.from_bytes(head, "little")
    if len(head) < 8 or n_header > size - 8:
        raise SaeflowError(f"{fpath}: not a safetensors file (a header of {n_header} bytes in {size} bytes)")
    if n_header > MAX_HEADER_BYTES:
        raise SaeflowError(f"{fpath}: safetensors header of {fmt_bytes(n_header)}, more than the "
                           f"{fmt_bytes(MAX_HEADER_BYTES)} an SAE's few tensors need; refusing to read it")  # fmt: skip
    raw = fd.read(n_header)
    digest.update(head + raw)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise SaeflowError(f"{fpath}: unreadable safetensors header ({' '.join(str(err).split())[:120]})") from None
    if not isinstance(header, dict):
        raise SaeflowError(f"{fpath}: safetensors header is not an object")
    return header, 8 + n_header


def _header_sizes(header: dict, fpath: pathlib.Path, fmt: str) -> Sizes:
    """The sizes a format without them in its config takes from its tensors' shapes (`HEADER_SIZES`); every other
    shape is then checked against them, and the offsets against the file's length, so a claimed size is one the file
    holds."""
    found = {}
    for size, (name, axis) in HEADER_SIZES[fmt].items():
        desc = header.get(name)
        shape = desc.get("shape") if isinstance(desc, dict) else None
        if not isinstance(shape, list) or len(shape) <= axis or not all(type(n) is int and n > 0 for n in shape):
            raise SaeflowError(f"{fpath}: no tensor {name!r} of a positive shape in its header; not a "
                               f"{LIBRARIES[fmt]} transcoder file")  # fmt: skip
        found[size] = shape[axis]
    return Sizes(**found)


def _check_header(header: dict, fpath: pathlib.Path, fmt: str, sizes: Sizes, n_data: int, cfg_fname: str) -> list:
    """[(name, dtype, shape, bytes)] in file order: dtypes saeflow reads, shapes as `sizes` give them, offsets that
    tile the data to the file's end."""
    entries = {name: desc for name, desc in header.items() if name != "__metadata__"}
    if len(entries) > MAX_TENSORS:
        raise SaeflowError(f"{fpath}: {len(entries)} tensors, more than the {MAX_TENSORS} an SAE has; refusing")
    layout, end = [], 0
    for name, desc in sorted(entries.items(), key=lambda item: _begin(item[1])):
        if not isinstance(desc, dict) or desc.get("dtype") not in DTYPES:
            dtype = desc.get("dtype") if isinstance(desc, dict) else desc
            raise SaeflowError(f"{fpath}: tensor {name[:60]!r} is {str(dtype)[:20]}; saeflow reads float16, bfloat16 "
                               "and float32 (float64 where float32 holds it exactly)")  # fmt: skip
        want = sizes.shape(fmt, name)
        if desc.get("shape") != list(want):
            given = ", ".join(f"{size}={getattr(sizes, size)}" for size in ("d_in", "d_sae", "d_out"))
            raise SaeflowError(f"{fpath}: tensor {name[:60]!r} has shape {str(desc.get('shape'))[:60]}, but "
                               f"{cfg_fname} ({given}) makes it {list(want)}; refusing to read it")  # fmt: skip
        dtype = DTYPES[desc["dtype"]]
        n_bytes = math.prod(want) * dtype.itemsize
        offsets = desc.get("data_offsets")
        if offsets != [end, end + n_bytes]:
            raise SaeflowError(f"{fpath}: tensor {name[:60]!r} declares bytes {str(offsets)[:60]}, not "
                               f"{[end, end + n_bytes]} (its {n_bytes} bytes after the previous tensor)")  # fmt: skip
        layout.append((name, dtype, want, n_bytes))
        end += n_bytes
    if end != n_data:
        raise SaeflowError(f"{fpath}: {n_data} bytes of data, but its tensors take {end}; refusing")
    return layout


def _begin(desc) -> int:
    offsets = desc.get("data_offsets") if isinstance(desc, dict) else None
    return offsets[0] if isinstance(offsets, list) and offsets and type(offsets[0]) is int else -1


def _float32(t: torch.Tensor, fpath: pathlib.Path, name: str) -> torch.Tensor:
    """float32 values of a tensor whose every value is finite (a float64 one: exactly a float32)."""
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise SaeflowError(f"{fpath}: tensor {name!r} holds {bad} non-finite value{'s' * (bad > 1)} (NaN or inf); "
                           "an SAE computing them computes NaN")  # fmt: skip
    if t.dtype != torch.float64:
        return t.float() if t.dtype != torch.float32 else t
    out = torch.empty(t.shape, dtype=torch.float32)
    for src, dst in zip(t.view(-1).split(_CHUNK_ITEMS), out.view(-1).split(_CHUNK_ITEMS), strict=True):
        dst.copy_(src)
        if not torch.equal(dst.double(), src):
            at = int((dst.double() != src).nonzero()[0])
            value = float(src[at])
            what = "overflows float32" if math.isinf(float(dst[at])) else "is no float32 value"
            raise SaeflowError(f"{fpath}: float64 tensor {name!r} holds {value!r}, which {what}; saeflow converts "
                               "float64 only when exact (convert it yourself if the rounding is acceptable)")
    return out


def check_all_read(tensors: Tensors, fpath: pathlib.Path, what: str) -> None:
    """Refuse a tensor the format's mapping did not read: the checkpoint is not what cfg.json says (`what`)."""
    unused = sorted(set(tensors) - tensors.used)
    if unused:
        raise SaeflowError(f"{fpath}: {what} does not use tensor {', '.join(map(repr, unused))}; refusing to drop it "
                           "(is cfg.json's architecture the one the weights were trained as?)")
