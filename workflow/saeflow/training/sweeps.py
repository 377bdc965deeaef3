"""Sweep planning: the runs of the `saes` config entries, the training config of one run and the SAE it trains
(`TrainConfig.sae_config`: d_sae and the check that k fits it live there), and what training would refuse of the
planned shard metadata (`check_run`). No torch, no data.

Snakemake imports this at parse time (and in every Slurm job), so it stays cheap: `plan_runs` turns typed SAE specs
and the shard hashes of the activations into `RunPlan`s, each with its `TrainConfig` and run id. The run id is the
sha256 of `TrainConfig.to_dict()` (`runs.run_id`): the train/val shard hashes, the trainer version and every
hyper-parameter exactly as the config spells it, so the same config and data always name the same run directory.

    specs = {name: SAESpec.from_dict(name, obj) for name, obj in validated_config["saes"].items()}
    plans = plan_runs(specs, {"vit": shard_hash}, {"vit": "content"})
"""

import dataclasses
import itertools
import json
import typing

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.extraction import hooks, tokenization
from saeflow.store import runs
from saeflow.training import archs

ARCHS = config.enum("sae_spec", "arch")  # the SAE architectures (each one module of training/archs)
TRAINER = "saeflow-train-3"  # bump when the training maths change, so old run ids are not reused
NOT_SWEPT = ("train", "val", "target", "val_target")  # activation names (a run config holds their shard hashes)
SEED_KEYS = ("seed", "data_seed")  # what may differ between the runs of one seed group (saeflow.analysis.stability)
# Keys added to the training config after saeflow-train-3's first release, each with the value it was introduced at
# (docs/contracts.md, "Identities that outlive upgrades"). The canonical form (config.json, whose sha256 is the run
# id) leaves out a key at that value, and a config.json that lacks it reads as that value, so adding a key with a
# default changes no run id and every earlier run still loads and trains. The one table of these values: a key's
# schema default may change later (it then names new runs), its introduction value never does.
INTRODUCED: dict[str, typing.Any] = {
    # JumpReLU (issue 34): its sparsity term and the straight-through estimator's kernel
    "jumprelu_loss": "step",
    "l0_coeff": 2.0,
    "bandwidth": 1.0,
    "threshold_init": 2.0,
    "tanh_coeff": 0.35,
    "tanh_scale": 4.0,
    "pre_act_coeff": 3.0e-6,
    # Gated (issue 34): the L1 on its gate
    "gate_l1_coeff": 7.0,
    # JumpReLU and Gated (issue 34, where codes switch on): their thresholds' learning rate, a multiple of the run's
    "threshold_lr_scale": 4.0,
    "gate_bias_lr_scale": 4.0,
    # Transcoders (issue 35): the target activation's shard hash (train and validation) and the linear skip path;
    # at these values the run is a plain SAE
    "target": None,
    "val_target": None,
    "skip": False,
}


def at_introduction(key: str, value) -> bool:
    """True when `key` is an introduced key and `value` is the value it was introduced at (left out when hashed)."""
    if key not in INTRODUCED:
        return False
    default = INTRODUCED[key]
    return value == default and isinstance(value, bool) == isinstance(default, bool)


def canonical_spec(obj: typing.Mapping[str, typing.Any]) -> dict:
    """An `saes.<name>` entry (or a run's hyper-parameters) without the introduced keys at their introduction value:
    what a per-job config holds, so an upgrade that adds a key with a default leaves it byte for byte unchanged."""
    return {key: value for key, value in obj.items() if not at_introduction(key, value)}


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
        `skip` or `val_target` without a `target`, and a transcoder validated on another activation without the
        target of it (`val_target`)."""
        hyper = {key: value for key, value in obj.items() if key not in NOT_SWEPT}
        spec = cls(name=name, train=obj["train"], val=obj.get("val"), hyper=hyper, target=obj.get("target"),
                   val_target=obj.get("val_target"))  # fmt: skip
        skips = hyper.get("skip", False)
        if spec.target is None and (skips is True or (isinstance(skips, list) and True in skips)):
            raise SaeflowError("skip: the linear skip path is a transcoder's (set target: <activation>); a plain SAE "
                               "reconstructs its own input")  # fmt: skip
        if spec.target is None and spec.val_target is not None:
            raise SaeflowError("val_target: a plain SAE has no target (set target: <activation> for a transcoder)")
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
        return canonical_spec({**dataclasses.asdict(self), "matryoshka": list(self.matryoshka)})

    def sae_config(self, d_model: int, d_out: int | None = None) -> "SAEConfig":
        """The SAE this run trains on vectors of width `d_model`: d_sae = expansion x d_model, the Matryoshka
        fractions of d_sae as latent counts; a transcoder's outputs are `d_out` wide (its target's width). SAEConfig
        refuses a k above d_sae (planning finds it before any job)."""
        d_sae = self.expansion * d_model
        prefixes = tuple(sorted({max(1, int(f * d_sae)) for f in self.matryoshka}))
        if self.arch in ARCHS:
            archs.get(self.arch).check(self)  # its own hyper-parameters (e.g. a JumpReLU bandwidth)
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


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """One point of one SAE sweep, planned without touching data."""

    sae_name: str  # the key under `saes`
    index: int  # position in the sweep of `sae_name`
    run_id: str  # sha256 of `train_config.to_dict()`: the run directory's name
    train_config: TrainConfig
    train_activation: str  # activation name trained on
    val_activation: str  # activation name validated on
    varying: dict = dataclasses.field(default_factory=dict)  # the point's values of the swept keys (its name)
    target_activation: str | None = None  # a transcoder's target activation name (paired with train)
    val_target_activation: str | None = None  # and the one paired with val

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


def config_key(sae_name: str, index: int, swept: bool) -> str:
    """A run's place in the config, for errors: `saes.<name>[<sweep index>]`, or `saes.<name>` when nothing of the
    spec is swept (an index the user never wrote names nothing)."""
    return f"saes.{sae_name}[{index}]" if swept else f"saes.{sae_name}"


def plan_runs(
    saes: typing.Mapping[str, SAESpec], shard_hashes: typing.Mapping[str, str], auto_tokens: typing.Mapping[str, str]
) -> list[RunPlan]:
    """Every run of every SAE spec; `shard_hashes` maps activation names to shard hashes, `auto_tokens` to what
    `tokens: auto` means for their shards (`no_special` for text saeflow extracted, else `content`). The run config
    holds the resolved choice, so `auto` and the choice it stands for name the same run."""
    plans = []
    for sae_name, spec in saes.items():
        roles = {"train": spec.train, "val": spec.val_activation, "target": spec.target,
                 "val_target": spec.val_target_activation}  # fmt: skip
        for role, name in roles.items():
            if name is not None and name not in shard_hashes:
                key = f"saes.{sae_name}" + (f".{role}" if "target" in role else "")  # as before transcoders
                raise SaeflowError(f"{key}: activation {name!r} is not defined; known: "
                                   f"{', '.join(shard_hashes) or 'none'}")  # fmt: skip
        targets = {} if spec.target is None else {"target": shard_hashes[spec.target],
                                                  "val_target": shard_hashes[spec.val_target_activation]}  # fmt: skip
        for index, hyper in enumerate(spec.points()):
            obj = {
                "trainer": TRAINER,
                "train_shards": shard_hashes[spec.train],
                "val_shards": shard_hashes[spec.val_activation],
                **hyper,
                **targets,  # none for an SAE, whose config then has no target key (INTRODUCED)
            }
            if obj.get("tokens") == "auto":
                obj["tokens"] = auto_tokens[spec.train]
            train_config = TrainConfig.from_dict(obj, config_key(sae_name, index, bool(spec.varying(hyper))))
            run_id = runs.run_id(train_config.to_dict())
            plans.append(RunPlan(sae_name, index, run_id, train_config, spec.train, spec.val_activation,
                                 spec.varying(hyper), spec.target, spec.val_target_activation))  # fmt: skip
    return plans


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


def check_run(plan: RunPlan, train_md, val_md, train_settings: typing.Mapping[str, typing.Any] | None = None,
              targets: tuple | None = None) -> None:  # fmt: skip
    """What training would refuse, found at plan time from the shard metadata (no extraction has to run first):
    a layer the activation does not extract, k above d_sae, CLS tokens the model has none of, train and
    validation activations of different widths, a parallel mode the architecture does not train in (`check_parallel`,
    given the `train` settings), a transcoder's target that is not the same examples and tokens as its input
    (`targets`: the metadata of the target and of the validation target; `check_pairs`). The error names the key,
    as `saes.<name>[<sweep index>].<key>` (`config_key`)."""
    cfg, where = plan.train_config, config_key(plan.sae_name, plan.index, bool(plan.varying))
    if targets is not None:
        check_pairs(plan, (train_md, val_md), targets)
    for role, name, md in (("train", plan.train_activation, train_md), ("val", plan.val_activation, val_md)):
        if cfg.layer not in md.layers:
            raise SaeflowError(f"{where}.layer: layer {cfg.layer} is not extracted by the {role} activation "
                               f"{name!r} (activations.{name}.layers resolve to {list(md.layers)})")  # fmt: skip
        if cfg.tokens == "cls" and not md.cls_token:
            raise SaeflowError(f"{where}.tokens: 'cls' asked for, but the {role} activation {name!r} has no CLS token")
        if cfg.tokens == "no_special" and auto_tokens_of(md) != "no_special":
            raise SaeflowError(f"{where}.tokens: 'no_special' (what auto means for text) needs the special ids of a "
                               f"text packing, but the {role} activation {name!r} records none (not text saeflow "
                               "extracted); set tokens: content")  # fmt: skip
    if train_md.d_model != val_md.d_model:
        raise SaeflowError(f"{where}.val: activation {plan.val_activation!r} has d_model {val_md.d_model}, but the "
                           f"train activation {plan.train_activation!r} has {train_md.d_model}")  # fmt: skip
    try:
        cfg.sae_config(train_md.d_model, targets[0].d_model if targets else None)  # k must fit d_sae
    except SaeflowError as err:
        raise SaeflowError(f"{where}.{err}") from None
    if train_settings is not None:
        check_parallel(plan, train_settings)


def check_parallel(plan: RunPlan, train_settings: typing.Mapping[str, typing.Any]) -> None:
    """Refuse at plan time, in one line, a parallel mode (`train.parallel`) the run's architecture (as an SAE or as a
    transcoder) does not train in, when the job has several ranks (`train.gpus` x `train.nodes`; one process trains
    every architecture)."""
    if train_settings["gpus"] * train_settings["nodes"] > 1:
        where = f"{config_key(plan.sae_name, plan.index, bool(plan.varying))}.arch"
        cfg = plan.train_config
        archs.check_mode(cfg.arch, train_settings["parallel"], where, cfg.transcoder)


def _pair_identity(md) -> dict:
    """What a transcoder's input and target must share to be the same examples and tokens: all of their metadata
    but the hook point (and the width, which a hook may change)."""
    obj = md.to_dict()
    obj["data"] = {key: value for key, value in obj["data"].items() if key != hooks.HOOK_KEY}
    return {key: value for key, value in obj.items() if key != "d_model"}


def check_pairs(plan: RunPlan, inputs: tuple, targets: tuple) -> None:
    """Refuse, in one line, a transcoder whose target (or validation target) is not its input's examples and tokens:
    another model, checkpoint, dataset, example count, token layout, layers or shard layout. One forward pass of
    specs that differ in `hook` alone (`ActivationSpec.shares_pass`) always pairs."""
    where = config_key(plan.sae_name, plan.index, bool(plan.varying))
    roles = (("target", plan.train_activation, plan.target_activation),
             ("val_target", plan.val_activation, plan.val_target_activation))  # fmt: skip
    for (key, source, target), source_md, target_md in zip(roles, inputs, targets):
        a, b = _pair_identity(source_md), _pair_identity(target_md)
        if a != b:
            differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            raise SaeflowError(f"{where}.{key}: activation {target!r} is not the same examples and tokens as "
                               f"{source!r} (their shard metadata differ in {', '.join(differ)} beyond the hook); a "
                               "transcoder's target comes from the same model, dataset and tokens (e.g. one spec "
                               "with another hook)")  # fmt: skip


def auto_tokens_of(md) -> str:
    """What `tokens: auto` means for a shard directory: `no_special` when its metadata records the special ids of
    a text packing (text saeflow extracted), else `content`."""
    return "content" if tokenization.recorded_packing(md) is None else "no_special"
