"""The typed training config of one run and the SAE it trains: `TrainConfig` (exactly a run's config.json, whose
sha256 is the run id; `sae_config`: d_sae and the check that k fits it) and `SAEConfig` (what rebuilds the module).
No torch: planning builds them at parse time (training.sweeps plans the runs of a sweep into them)."""

import dataclasses
import typing

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.training import archs, shapes
from saeflow.training.keys import COMMON, INTRODUCED, canonical_spec

ARCHS = config.enum("sae_spec", "arch")  # the SAE architectures (each one module of training/archs)
NOT_SWEPT = ("train", "val", "target", "val_target")  # activation names (a run config holds their shard hashes)
# A cross-layer transcoder's keys that hold a value per layer (lists in its config.json, tuples here)
PER_LAYER = ("layer", "train_shards", "val_shards", "target", "val_target")


def is_sweep(key: str, value) -> bool:
    """Whether a config value is swept: a list, except an activation name's and a single Matryoshka list."""
    if key in NOT_SWEPT or not isinstance(value, list):
        return False
    return key != "matryoshka" or (bool(value) and all(isinstance(v, list) for v in value))


def trainer_of(arch: str) -> str:
    """The trainer version a new run of `arch` records (`Arch.trainer`): its training maths now."""
    return archs.get(arch).trainer


def trains(run_config: dict) -> bool:
    """Whether this saeflow trains the run `run_config` (a config.json) with the maths it was made with: its
    architecture's trainer now, or an earlier one it still computes (`Arch.earlier_trainers`)."""
    arch = archs.REGISTRY.get(run_config.get("arch"))
    return arch is not None and run_config.get("trainer") in (arch.trainer, *arch.earlier_trainers)


def check_trainer(run_config: dict, where: str) -> None:
    """Refuse, in one line, a run made by a trainer whose maths this saeflow does not compute for its architecture."""
    if not trains(run_config):
        arch = archs.get(run_config.get("arch"))
        raise SaeflowError(f"{where}: made by trainer {run_config.get('trainer')!r}; this saeflow trains {arch.name} "
                           f"as {arch.trainer!r} (and resumes {list(arch.earlier_trainers)}): plan it again for a new "
                           "run")  # fmt: skip


class _Layers:
    """What a run's config says of its layers and its data: a `TrainConfig` is one (kept apart for its size)."""

    @property
    def cross_layer(self) -> bool:
        """A cross-layer transcoder: `layer` and the shard keys are tuples, a value per layer."""
        return shapes.of(self).cross_layer

    @property
    def spanned_layers(self) -> tuple[int, ...]:
        """The layers it reads: a CLT's list, or the one layer of any other run."""
        return tuple(self.layer) if self.cross_layer else (self.layer,)

    def per_layer(self, key: str) -> tuple:
        """A PER_LAYER key's values, one per layer of `spanned_layers` (an SAE's or a transcoder's one value)."""
        value = getattr(self, key)
        return tuple(value) if self.cross_layer else (value,)

    def loader_key(self) -> tuple:
        """Runs with equal keys see identical batches, so they can share one pass."""
        return (
            self.train_shards,
            self.layer,
            self.tokens,
            self.batch_size,
            self.data_seed,
            self.n_epochs,
            self.n_train_vectors,
            self.target,  # a transcoder's batches are pairs: its target's rows ride along
            self.shape,
        )


@dataclasses.dataclass(frozen=True)
class TrainConfig(_Layers):
    """The hyper-parameters of one run (exactly the keys of the run's config.json; defaults live in the schema)."""

    trainer: str
    train_shards: str  # a CLT's: one per layer (PER_LAYER), as are val_shards, layer, target and val_target
    val_shards: str
    layer: int
    tokens: str
    arch: str
    expansion: int
    k: int
    matryoshka: tuple[float, ...]
    l1_coeff: float
    aux_k: int
    aux_alpha: float
    dead_after_vectors: int | None  # None: objectives.dead_after_steps' default
    lr: float | None  # None: rates.peak_lr's default
    lr_warmup_frac: float
    sparsity_warmup_frac: float
    batch_size: int
    n_epochs: int
    n_train_vectors: int | None
    n_val_vectors: int | None
    seed: int
    data_seed: int
    # introduced later (INTRODUCED): hashed only off their introduction values, which are also their defaults here,
    # so code that builds a TrainConfig by its fields (benchmarks) keeps working as keys are added
    jumprelu_loss: str = INTRODUCED["jumprelu_loss"]
    l0_coeff: float = INTRODUCED["l0_coeff"]
    bandwidth: float = INTRODUCED["bandwidth"]
    threshold_init: float = INTRODUCED["threshold_init"]
    tanh_coeff: float = INTRODUCED["tanh_coeff"]
    tanh_scale: float = INTRODUCED["tanh_scale"]
    pre_act_coeff: float = INTRODUCED["pre_act_coeff"]
    gate_l1_coeff: float = INTRODUCED["gate_l1_coeff"]
    gated_loss: str = INTRODUCED["gated_loss"]
    target_l0_coeff: float = INTRODUCED["target_l0_coeff"]
    topk_warmup_frac: float = INTRODUCED["topk_warmup_frac"]
    threshold_lr_scale: float = INTRODUCED["threshold_lr_scale"]
    gate_bias_lr_scale: float = INTRODUCED["gate_bias_lr_scale"]
    target: str | None = INTRODUCED["target"]  # a transcoder's target shard hash (train_shards' pair); None: an SAE
    val_target: str | None = INTRODUCED["val_target"]  # the target shard hash paired with val_shards
    skip: bool = INTRODUCED["skip"]  # a transcoder's learned linear skip path (d_in x d_out)
    shape: str = INTRODUCED["shape"]  # "clt": a cross-layer transcoder (training/shapes.py); "auto": by target


    @property
    def transcoder(self) -> bool:
        """A transcoder (it predicts `target` from `train_shards`), not an SAE (which reconstructs its input)."""
        return self.target is not None

    @classmethod
    def from_dict(cls, obj: dict, where: str) -> "TrainConfig":
        """From a run's config.json (or a planned point); an introduced key it lacks takes its introduction value,
        so a config written before the key existed loads as the run it always was."""
        names = {f.name for f in dataclasses.fields(cls)}
        obj = {**{key: INTRODUCED[key] for key in INTRODUCED.keys() - obj.keys()}, **obj}
        missing, extra = sorted(names - obj.keys()), sorted(obj.keys() - names)
        if missing or extra:
            raise SaeflowError(f"{where}: training config keys differ: missing {missing}, unexpected {extra}")
        check_trainer(obj, where)
        if obj["shape"] in ("sae", "transcoder"):  # a spec's shape other than a CLT: what `target` says
            obj = {**obj, "shape": "auto"}
        per_layer = PER_LAYER if obj.get("shape") == "clt" else ()
        swept = [k for k, v in obj.items() if is_sweep(k, v) and k not in per_layer]
        if swept:
            raise SaeflowError(f"{where}: {swept} are still lists; a run holds one point of a sweep")
        lists = {key: tuple(obj[key]) for key in per_layer if isinstance(obj[key], list)}
        return cls(**{**obj, "matryoshka": tuple(obj["matryoshka"]), **lists})

    def to_dict(self) -> dict:
        """The run's config.json, whose hash is the run id: values as the config gave them, matryoshka a list, the
        introduced keys at their introduction value left out (`INTRODUCED`)."""
        return canonical_spec(self._values())

    def _values(self) -> dict:
        values = dataclasses.asdict(self)
        lists = {key: list(values[key]) for key in PER_LAYER if isinstance(values[key], tuple)}  # a CLT's
        return {**values, "matryoshka": list(self.matryoshka), **lists}

    def read_keys(self) -> tuple[str, ...]:
        """The keys this run reads: the common ones and its architecture's in its mode (`Arch.reads`)."""
        return (*COMMON, *archs.get(self.arch).reads(self))

    def canonical(self, unread_values: typing.Mapping[str, typing.Any]) -> "TrainConfig":
        """This run with every key its architecture does not read at its value in `unread_values`
        (`SAESpec.unread_values`) and its Matryoshka prefixes sorted, each once (as `sae_config` trains them; a
        sorted list of distinct ones is as it was): what planning hashes, so points that differ only there are one
        run."""
        read = self.read_keys()
        unread = {key: value for key, value in unread_values.items() if key not in read}
        return dataclasses.replace(self, matryoshka=tuple(sorted(set(self.matryoshka))), **unread)

    def readable(self) -> dict:
        """The run as a person reads it (checkpoint/hyperparameters.json, summary.csv's config.* columns): every key
        it reads at the value it trained with, the introduced keys included, and `not_read`, the keys it does not
        read (their values mean nothing to it). Never hashed."""
        read = self.read_keys()
        values = self._values()
        return {**{key: values[key] for key in read}, "not_read": sorted(values.keys() - set(read))}

    def sae_config(self, d_model: int, d_out: int | None = None) -> "SAEConfig":
        """The SAE this run trains on vectors of width `d_model`: d_sae = expansion x d_model, the Matryoshka
        fractions of d_sae as latent counts; a transcoder's outputs are `d_out` wide (its target's width). SAEConfig
        refuses a k above d_sae (planning finds it before any job)."""
        d_sae = self.expansion * d_model
        prefixes = tuple(sorted({max(1, int(f * d_sae)) for f in self.matryoshka}))
        if self.arch in ARCHS:
            archs.check(self)  # its own hyper-parameters (e.g. a JumpReLU bandwidth), a transcoder where it has one
            shapes.check(shapes.of(self), self.arch, self.matryoshka, self.skip)
        d_out = (d_model if d_out is None else d_out) if self.transcoder else None
        try:
            return SAEConfig(d_model=d_model, d_sae=d_sae, arch=self.arch, k=self.k, matryoshka=prefixes, d_out=d_out,
                             skip=self.skip)  # fmt: skip
        except SaeflowError as err:
            raise SaeflowError(f"{err} (d_sae = expansion {self.expansion} x d_model {d_model})") from None


@dataclasses.dataclass(frozen=True)
class SAEConfig:
    """Everything needed to rebuild the module (not how it was trained)."""

    d_model: int
    d_sae: int
    arch: str  # one of ARCHS
    k: int  # active latents per vector (topk) or on average per vector (batchtopk); unused where not Arch.uses_k
    matryoshka: tuple[int, ...] = ()  # nested prefix sizes, ascending, each < d_sae; () = plain SAE
    d_out: int | None = None  # a transcoder's output width (its target's); None: an SAE, whose output is its input
    skip: bool = False  # a transcoder's learned linear skip path, d_model x d_out

    @property
    def transcoder(self) -> bool:
        return self.d_out is not None

    @property
    def d_target(self) -> int:
        """The width of what the decoder writes: the target's (a transcoder) or the input's (an SAE)."""
        return self.d_model if self.d_out is None else self.d_out

    def __post_init__(self):
        """Refuse what the SAE cannot compute; each message starts with the key at fault (planning prefixes it
        with `config_key`, `saes.<name>[<index>].`)."""
        object.__setattr__(self, "matryoshka", tuple(int(m) for m in self.matryoshka))
        if self.arch not in ARCHS:
            raise SaeflowError(f"arch: unknown SAE architecture {self.arch!r}; choose one of {ARCHS}")
        if self.d_model < 1 or self.d_sae < 1 or self.d_target < 1:
            raise SaeflowError(f"d_model, d_out and d_sae must be positive, got {self.d_model}, {self.d_out}, "
                               f"{self.d_sae}")  # fmt: skip
        if self.skip and not self.transcoder:
            raise SaeflowError("skip: the linear skip path is a transcoder's; an SAE has no d_out")
        if archs.get(self.arch).uses_k and not 1 <= self.k <= self.d_sae:
            raise SaeflowError(f"k: k={self.k} must be in [1, d_sae={self.d_sae}] for {self.arch}")
        prefixes = list(self.matryoshka)
        if prefixes != sorted(set(prefixes)) or any(not 0 < m < self.d_sae for m in prefixes):
            raise SaeflowError(
                f"matryoshka: prefixes must be strictly ascending and inside (0, d_sae={self.d_sae}), got {prefixes}"
            )

    def n_kept(self, n_vectors: int) -> int:
        """The codes a batch of `n_vectors` keeps: topk each vector's k largest (`n_kept(1)` a vector), batchtopk
        the batch's k x n_vectors largest (k a vector on average); never more than the batch holds."""
        return min(self.k, self.d_sae) * n_vectors

    @property
    def prefixes(self) -> tuple[int, ...]:
        """The latent prefixes whose reconstructions are trained (always ends with d_sae)."""
        return (*self.matryoshka, self.d_sae)
