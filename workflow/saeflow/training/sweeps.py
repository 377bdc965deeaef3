"""Sweep planning: the runs of the `saes` config entries, the training config of one run and the SAE it trains
(`TrainConfig.sae_config`: d_sae and the check that k fits it live there), and what training would refuse of the
planned shard metadata (`check_run`). No torch, no data.

Snakemake imports this at parse time (and in every Slurm job), so it stays cheap: `plan_runs` turns typed SAE specs
and the shard hashes of the activations into `RunPlan`s, each with its `TrainConfig` and run id. The run id is the
sha256 of `TrainConfig.to_dict()` (`runs.run_id`): the train/val shard hashes, the trainer version and every
hyper-parameter exactly as the config spells it, so the same config and data always name the same run directory;
a key the run's architecture does not read is hashed at a fixed value (`TrainConfig.canonical`), so it names no run.

    specs = {name: SAESpec.from_dict(name, obj) for name, obj in validated_config["saes"].items()}
    plans = plan_runs(specs, {"vit": {11: shard_hash}}, {"vit": "content"})  # activation -> {layer: its directory}
    plans = plan_runs(specs, {"vit": shard_hash}, {"vit": "content"})  # or -> one directory of every layer
"""

import dataclasses
import itertools
import json
import typing

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.extraction import tokenization
from saeflow.store import runs
from saeflow.training import archs
from saeflow.training.keys import ARCH_KEYS, COMMON, INTRODUCED, canonical_spec, same_value

ARCHS = config.enum("sae_spec", "arch")  # the SAE architectures (each one module of training/archs)
TRAINER = "saeflow-train-3"  # bump when the training maths change, so old run ids are not reused
NOT_SWEPT = ("train", "val", "target", "val_target")  # activation names (a run config holds their shard hashes)
SEED_KEYS = ("seed", "data_seed")  # what may differ between the runs of one seed group (saeflow.analysis.stability)


# The value a run hashes a first-release key its architecture does not read at (an INTRODUCED key's is its
# introduction value, so it is left out): the schema defaults when unread keys stopped naming runs, so every run
# planned with them there kept its id. Fixed, as INTRODUCED is: a schema default may change later, these never do.
UNREAD: dict[str, typing.Any] = {"k": 32, "l1_coeff": 3.0, "sparsity_warmup_frac": 0.05}


def unread_value(key: str):
    """The fixed value an architecture's key is hashed at by a run that does not read it (`UNREAD`, `INTRODUCED`)."""
    return INTRODUCED[key] if key in INTRODUCED else UNREAD[key]


def _is_sweep(key: str, value) -> bool:
    if key in NOT_SWEPT or not isinstance(value, list):
        return False
    return key != "matryoshka" or (bool(value) and all(isinstance(v, list) for v in value))


def swept_keys(spec: dict) -> list[str]:
    """The keys of a spec that are swept (list-valued), in its key order."""
    return [key for key, value in spec.items() if _is_sweep(key, value)]


def expand_sweep(spec: dict) -> list[dict]:
    """The cartesian product of every list-valued key (in the spec's key order; the last key varies fastest)."""
    keys = swept_keys(spec)
    combos = itertools.product(*(spec[key] for key in keys))
    return [{**spec, **dict(zip(keys, combo))} for combo in combos]


def point_name(sae_name: str, varying: typing.Mapping[str, typing.Any]) -> str:
    """A sweep point's readable name: its SAE spec's name and the values of the swept keys, alphabetically with the
    seeds last (whatever the config's key order), `clip-topk[k=32,seed=1]`; `clip-topk` when nothing is swept. The one
    naming of runs for people (`saeflow plan`, the summary, its plots and the report); nothing hashes it: the run id
    stays the identity."""
    if not varying:
        return sae_name
    keys = [*sorted(key for key in varying if key not in SEED_KEYS), *(key for key in SEED_KEYS if key in varying)]
    text = {key: varying[key] if isinstance(varying[key], str) else json.dumps(varying[key], separators=(",", ":"))
            for key in keys}  # fmt: skip
    return f"{sae_name}[{','.join(f'{key}={value}' for key, value in text.items())}]"


@dataclasses.dataclass(frozen=True)
class SAESpec:
    """One `saes.<name>` entry of a validated config: the activations it reads and its (swept) hyper-parameters."""

    name: str  # the key under `saes`
    train: str  # activation name (under `activations`) trained on
    val: str | None  # activation name validated on; None: the training one
    hyper: dict[str, typing.Any]  # every other key, in the spec's order (the sweep order); list values are swept
    target: str | None = None  # a transcoder's: the activation it predicts from `train`'s; None: an SAE
    val_target: str | None = None  # the target validated on, paired with `val`; None: `target`

    @classmethod
    def from_dict(cls, name: str, obj: typing.Mapping[str, typing.Any]) -> "SAESpec":
        """From a schema-validated entry (the schema fills the defaults); refuses, in one line naming the key, a
        `skip` or `val_target` without a `target`, a transcoder of its own input (`target` the `train` activation,
        `val_target` the `val` one), and a transcoder validated on another activation without the target of it
        (`val_target`)."""
        hyper = {key: value for key, value in obj.items() if key not in NOT_SWEPT}
        spec = cls(name=name, train=obj["train"], val=obj.get("val"), hyper=hyper, target=obj.get("target"),
                   val_target=obj.get("val_target"))  # fmt: skip
        skips = hyper.get("skip", False)
        if spec.target is None and (skips is True or (isinstance(skips, list) and True in skips)):
            raise SaeflowError("skip: the linear skip path is a transcoder's (set target: <activation>); a plain SAE "
                               "reconstructs its own input")  # fmt: skip
        if spec.target is None and spec.val_target is not None:
            raise SaeflowError("val_target: a plain SAE has no target (set target: <activation> for a transcoder)")
        for key, target, source in (("target", spec.target, spec.train),
                                    ("val_target", spec.val_target, spec.val_activation)):  # fmt: skip
            if target is not None and target == source:
                raise SaeflowError(f"{key}: {target!r} is the activation the transcoder reads; a transcoder predicts "
                                   "another one (leave target out for an SAE of it)")  # fmt: skip
        if spec.target is not None and spec.val not in (None, spec.train) and spec.val_target is None:
            raise SaeflowError(f"val_target: the transcoder validates on {spec.val!r}; name the activation it "
                               "predicts there (val_target: <activation>)")  # fmt: skip
        return spec

    @property
    def val_activation(self) -> str:
        return self.val or self.train

    @property
    def val_target_activation(self) -> str | None:
        """The target paired with `val_activation` (None: an SAE)."""
        return self.val_target or self.target

    def points(self) -> list[dict]:
        """The hyper-parameters of each run of the sweep, in run-index order."""
        return expand_sweep(self.hyper)

    def varying(self, point: dict) -> dict:
        """What names a point of the sweep: its values of the swept keys."""
        return {key: point[key] for key in swept_keys(self.hyper)}

    def values(self, key: str) -> list:
        """The values the sweep gives `key` (one when not swept, none when not given)."""
        if key not in self.hyper:
            return []
        return list(self.hyper[key]) if _is_sweep(key, self.hyper[key]) else [self.hyper[key]]

    def unread_values(self) -> dict[str, typing.Any]:
        """Architecture key -> the value a point of this sweep that does not read it is hashed at
        (`TrainConfig.canonical`). A key none of the sweep's architectures declares: its fixed value
        (`unread_value`), so it names no run. A key one of them reads (another architecture of the sweep, or this one
        in another mode: JumpReLU's l0_coeff under tanh): one of the sweep's values, the fixed one when among them,
        else the smallest, so a point keeps the id it had when such keys named runs, and a sweep of it is one run."""
        declared = {key for arch in self.values("arch") for key in archs.get(arch).hyper}
        out = {}
        for key in ARCH_KEYS:
            fixed, values = unread_value(key), self.values(key)
            if key not in declared or not values or any(same_value(value, fixed) for value in values):
                out[key] = fixed
            else:
                out[key] = min(values)
        return out


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The hyper-parameters of one run (exactly the keys of the run's config.json; defaults live in the schema)."""

    trainer: str
    train_shards: str
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
    lr: float | None  # None: train.auto_lr(d_sae)
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
    threshold_lr_scale: float = INTRODUCED["threshold_lr_scale"]
    gate_bias_lr_scale: float = INTRODUCED["gate_bias_lr_scale"]
    target: str | None = INTRODUCED["target"]  # a transcoder's target shard hash (train_shards' pair); None: an SAE
    val_target: str | None = INTRODUCED["val_target"]  # the target shard hash paired with val_shards
    skip: bool = INTRODUCED["skip"]  # a transcoder's learned linear skip path (d_in x d_out)

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
        if obj["trainer"] != TRAINER:
            raise SaeflowError(f"{where}: made by trainer {obj['trainer']!r}; this saeflow is {TRAINER!r}")
        swept = [k for k, v in obj.items() if _is_sweep(k, v)]
        if swept:
            raise SaeflowError(f"{where}: {swept} are still lists; a run holds one point of a sweep")
        return cls(**{**obj, "matryoshka": tuple(obj["matryoshka"])})

    def to_dict(self) -> dict:
        """The run's config.json, whose hash is the run id: values as the config gave them, matryoshka a list, the
        introduced keys at their introduction value left out (`INTRODUCED`)."""
        return canonical_spec(self._values())

    def _values(self) -> dict:
        return {**dataclasses.asdict(self), "matryoshka": list(self.matryoshka)}

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
        d_out = (d_model if d_out is None else d_out) if self.transcoder else None
        try:
            return SAEConfig(d_model=d_model, d_sae=d_sae, arch=self.arch, k=self.k, matryoshka=prefixes, d_out=d_out,
                             skip=self.skip)  # fmt: skip
        except SaeflowError as err:
            raise SaeflowError(f"{err} (d_sae = expansion {self.expansion} x d_model {d_model})") from None

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
        )


def readable_config(run_config: dict, where: str) -> dict:
    """A run's config (its config.json, at `where`) as a person reads it: this trainer's runs as
    `TrainConfig.readable` (what the run's readable file holds, computed again, so a run made before that file
    existed reads the same); any other (an import, an earlier trainer) as it is."""
    if run_config.get("trainer") != TRAINER:
        return run_config
    return TrainConfig.from_dict(run_config, where).readable()


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """One point of one SAE sweep, planned without touching data."""

    sae_name: str  # the key under `saes`
    index: int  # position in the sweep of `sae_name`
    run_id: str  # sha256 of `train_config.to_dict()`: the run directory's name
    train_config: TrainConfig
    train_activation: str  # activation name trained on
    val_activation: str  # activation name validated on
    varying: dict = dataclasses.field(default_factory=dict)  # the point's values of the swept keys it reads (its name)
    target_activation: str | None = None  # a transcoder's target activation name (paired with train)
    val_target_activation: str | None = None  # and the one paired with val
    # the later points of the sweep that are this run: they differ from it only in keys its architecture does not read
    same_points: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        """The point's readable name (`point_name`): `clip-topk[k=32,seed=1]`."""
        return point_name(self.sae_name, self.varying)

    @property
    def group_name(self) -> str:
        """The name of its seed group (the runs that differ from it only in SEED_KEYS): its name without the seeds."""
        return point_name(self.sae_name, {k: v for k, v in self.varying.items() if k not in SEED_KEYS})

    @property
    def activations(self) -> tuple[str, str]:
        """(trained on, validated on)."""
        return self.train_activation, self.val_activation

    @property
    def val_activations(self) -> tuple[str, ...]:
        """What its validation (and inference) reads: the validation activation, and a transcoder's target of it."""
        return (self.val_activation,) if self.val_target_activation is None else (self.val_activation,
                                                                                    self.val_target_activation)

    @property
    def read_activations(self) -> tuple[str, ...]:
        """Every activation the run reads: trained and validated on, then a transcoder's targets of them."""
        targets = (self.target_activation, self.val_target_activation)
        return (*self.activations, *(name for name in targets if name is not None))

    @property
    def read_shards(self) -> tuple[str, ...]:
        """The shard directories the run reads (its layer's), in `read_activations`' order, each once."""
        cfg = self.train_config
        return tuple(dict.fromkeys(h for h in (cfg.train_shards, cfg.val_shards, cfg.target, cfg.val_target) if h))

    @property
    def val_shards(self) -> tuple[str, ...]:
        """The shard directories its validation (and inference) reads: the validation one, then a transcoder's
        target of it."""
        cfg = self.train_config
        return (cfg.val_shards,) if cfg.val_target is None else (cfg.val_shards, cfg.val_target)


def config_key(sae_name: str, index: int, swept: bool) -> str:
    """A run's place in the config, for errors: `saes.<name>[<sweep index>]`, or `saes.<name>` when nothing of the
    spec is swept (an index the user never wrote names nothing)."""
    return f"saes.{sae_name}[{index}]" if swept else f"saes.{sae_name}"


def plan_runs(
    saes: typing.Mapping[str, SAESpec],
    layer_hashes: typing.Mapping[str, str | typing.Mapping[int, str]],
    auto_tokens: typing.Mapping[str, str],
) -> list[RunPlan]:
    """Every run of every SAE spec; `layer_hashes` maps activation names to {layer: the shard hash of the directory
    holding it} (the workflow's: a directory per layer), or to the hash of one directory holding every layer (which
    `check_run` then checks), `auto_tokens` to what `tokens: auto` means for their shards (`no_special` for text
    saeflow extracted, else `content`). The run config holds the resolved choice, so `auto` and the choice it stands
    for name the same run."""
    plans = []
    for sae_name, spec in saes.items():
        roles = {"train": spec.train, "val": spec.val_activation, "target": spec.target,
                 "val_target": spec.val_target_activation}  # fmt: skip
        for role, name in roles.items():
            if name is not None and name not in layer_hashes:
                key = f"saes.{sae_name}" + (f".{role}" if "target" in role else "")  # as before transcoders
                raise SaeflowError(f"{key}: activation {name!r} is not defined; known: "
                                   f"{', '.join(layer_hashes) or 'none'}")  # fmt: skip
        unread, planned = spec.unread_values(), {}  # planned: run id -> its position in plans
        for index, hyper in enumerate(spec.points()):
            where = config_key(sae_name, index, bool(spec.varying(hyper)))

            def shards_of(role: str, name: str, layer=hyper["layer"], where=where) -> str:
                return layer_shards(layer_hashes[name], layer, f"{where}.layer: layer {layer} is not extracted "
                                    f"by the {role} activation {name!r} (activations.{name}.layers resolve to")

            targets = {} if spec.target is None else {"target": shards_of("target", spec.target),
                                                      "val_target": shards_of("val_target",
                                                                              spec.val_target_activation)}  # fmt: skip
            obj = {
                "trainer": TRAINER,
                "train_shards": shards_of("train", spec.train),
                "val_shards": shards_of("val", spec.val_activation),
                **hyper,
                **targets,  # none for an SAE, whose config then has no target key (INTRODUCED)
            }
            if obj.get("tokens") == "auto":
                obj["tokens"] = auto_tokens[spec.train]
            train_config = TrainConfig.from_dict(obj, where).canonical(unread)
            run_id = runs.run_id(train_config.to_dict())
            if run_id in planned:  # an earlier point differs from it only in keys the architecture does not read
                first = plans[planned[run_id]]
                plans[planned[run_id]] = dataclasses.replace(first, same_points=(*first.same_points, index))
                continue
            planned[run_id] = len(plans)
            varying = {key: value for key, value in spec.varying(hyper).items() if key in train_config.read_keys()}
            plans.append(RunPlan(sae_name, index, run_id, train_config, spec.train, spec.val_activation, varying,
                                 spec.target, spec.val_target_activation))  # fmt: skip
    return plans


def layer_shards(hashes: str | typing.Mapping[int, str], layer: int, refusal: str) -> str:
    """The shard hash of the directory holding `layer` (`hashes`: {layer: hash}, or one hash for every layer, which
    `check_run` checks); a layer none holds is `refusal` and the layers there are, in one line."""
    if isinstance(hashes, str):
        return hashes
    if layer not in hashes:
        raise SaeflowError(f"{refusal} {sorted(hashes)})")
    return hashes[layer]


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


def auto_tokens_of(md) -> str:
    """What `tokens: auto` means for a shard directory: `no_special` when its metadata records the special ids of
    a text packing (text saeflow extracted), else `content`."""
    return "content" if tokenization.recorded_packing(md) is None else "no_special"
