"""Sweep planning: the runs of the `saes` config entries, each a training config of one run (training.specs:
`TrainConfig` and the SAE it trains). No torch, no data.

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

from saeflow.errors import SaeflowError
from saeflow.extraction import tokenization
from saeflow.store import runs
from saeflow.training import archs, shapes
from saeflow.training.keys import ARCH_KEYS, INTRODUCED, same_value
from saeflow.training.specs import NOT_SWEPT, TrainConfig, is_sweep, trainer_of, trains

SEED_KEYS = ("seed", "data_seed")  # what may differ between the runs of one seed group (saeflow.analysis.stability)


# The value a run hashes a first-release key its architecture does not read at (an INTRODUCED key's is its
# introduction value, so it is left out): the schema defaults when unread keys stopped naming runs, so every run
# planned with them there kept its id. Fixed, as INTRODUCED is: a schema default may change later, these never do.
UNREAD: dict[str, typing.Any] = {"k": 32, "l1_coeff": 3.0, "sparsity_warmup_frac": 0.05}


def unread_value(key: str):
    """The fixed value an architecture's key is hashed at by a run that does not read it (`UNREAD`, `INTRODUCED`)."""
    return INTRODUCED[key] if key in INTRODUCED else UNREAD[key]


def swept_keys(spec: dict, whole: tuple[str, ...] = ()) -> list[str]:
    """The keys of a spec that are swept (list-valued, but those in `whole`: a CLT's `layer`), in its key order."""
    return [key for key, value in spec.items() if is_sweep(key, value) and key not in whole]


def expand_sweep(spec: dict, whole: tuple[str, ...] = ()) -> list[dict]:
    """The cartesian product of every list-valued key but `whole`'s (in the spec's key order; the last key varies
    fastest)."""
    keys = swept_keys(spec, whole)
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
    shape: str = "sae"  # training/shapes.py: sae, transcoder or clt (`shape: auto` resolved by `target`)

    @classmethod
    def from_dict(cls, name: str, obj: typing.Mapping[str, typing.Any]) -> "SAESpec":
        """From a schema-validated entry (the schema fills the defaults); refuses, in one line naming the key, a
        `skip` or `val_target` without a `target`, a transcoder of its own input (`target` the `train` activation,
        `val_target` the `val` one), and a transcoder validated on another activation without the target of it
        (`val_target`)."""
        hyper = {key: value for key, value in obj.items() if key not in (*NOT_SWEPT, "shape")}
        shape = _resolve_shape(obj.get("shape", "auto"), obj.get("target"), hyper.get("layer"))
        spec = cls(name=name, train=obj["train"], val=obj.get("val"), hyper=hyper, target=obj.get("target"),
                   val_target=obj.get("val_target"), shape=shape)  # fmt: skip
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

    @property
    def whole(self) -> tuple[str, ...]:
        """The list-valued keys that are one run's value, not a sweep: a CLT's `layer`."""
        return ("layer",) if shapes.get(self.shape).cross_layer else ()

    def points(self) -> list[dict]:
        """The hyper-parameters of each run of the sweep, in run-index order."""
        return expand_sweep(self.hyper, self.whole)

    def varying(self, point: dict) -> dict:
        """What names a point of the sweep: its values of the swept keys."""
        return {key: point[key] for key in swept_keys(self.hyper, self.whole)}

    def values(self, key: str) -> list:
        """The values the sweep gives `key` (one when not swept, none when not given)."""
        if key not in self.hyper:
            return []
        swept = is_sweep(key, self.hyper[key]) and key not in self.whole
        return list(self.hyper[key]) if swept else [self.hyper[key]]

    def unread_values(self) -> dict[str, typing.Any]:
        """Architecture key -> the value a point of this sweep that does not read it is hashed at
        (`TrainConfig.canonical`). A key none of the sweep's architectures declares: its fixed value
        (`unread_value`), so it names no run. A key one of them reads (another architecture of the sweep, or this one
        in another mode where its runs hashed it before: JumpReLU's l0_coeff under tanh, `Arch.hashed_unread`): one
        of the sweep's values, the fixed one when among them,
        else the smallest, so a point keeps the id it had when such keys named runs, and a sweep of it is one run."""
        declared = {key for arch in self.values("arch") for key in archs.get(arch).hashed_unread}
        out = {}
        for key in ARCH_KEYS:
            fixed, values = unread_value(key), self.values(key)
            if key not in declared or not values or any(same_value(value, fixed) for value in values):
                out[key] = fixed
            else:
                out[key] = min(values)
        return out


def _resolve_shape(shape: str, target: str | None, layer) -> str:
    """The spec's dictionary shape (`auto`: by `target`), refused in one line where the keys contradict it: a
    transcoder or CLT without a target, an SAE with one, a CLT whose `layer` is not ascending layers."""
    if shape == "auto":
        return "sae" if target is None else "transcoder"
    if shapes.get(shape).transcodes != (target is not None):
        if target is None:
            raise SaeflowError(f"shape: a {shape} predicts another activation; set target: <activation>")
        raise SaeflowError(f"shape: an sae reconstructs its own input; leave target out, or set shape: transcoder "
                           f"(or clt) to predict {target!r}")  # fmt: skip
    if shapes.get(shape).cross_layer:
        layers = layer if isinstance(layer, list) else [layer]
        if layers != sorted(set(layers)):
            raise SaeflowError(f"layer: a cross-layer transcoder's layers are ascending and each once, got {layers}")
    return shape


def readable_config(run_config: dict, where: str) -> dict:
    """A run's config (its config.json, at `where`) as a person reads it: a run this saeflow trains as
    `TrainConfig.readable` (what the run's readable file holds, computed again, so a run made before that file
    existed reads the same); any other (an import, an earlier trainer) as it is."""
    if not trains(run_config):
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
        """The shard directories the run reads (its layer's; a CLT's, of every layer), in `read_activations`' order,
        each once."""
        cfg = self.train_config
        keys = ("train_shards", "val_shards", "target", "val_target")
        return tuple(dict.fromkeys(h for key in keys if getattr(cfg, key) for h in cfg.per_layer(key)))

    @property
    def val_shards(self) -> tuple[str, ...]:
        """The shard directories its validation (and inference) reads: the validation one, then a transcoder's
        target of it."""
        cfg = self.train_config
        keys = ("val_shards",) if cfg.val_target is None else ("val_shards", "val_target")
        return tuple(h for key in keys for h in cfg.per_layer(key))


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

            def shards_of(role: str, name: str, layer=hyper["layer"], where=where) -> str | list[str]:
                if isinstance(layer, list):  # a CLT's: a directory per layer
                    return [shards_of(role, name, one) for one in layer]
                return layer_shards(layer_hashes[name], layer, f"{where}.layer: layer {layer} is not extracted "
                                    f"by the {role} activation {name!r} (activations.{name}.layers resolve to")

            targets = {} if spec.target is None else {"target": shards_of("target", spec.target),
                                                      "val_target": shards_of("val_target",
                                                                              spec.val_target_activation)}  # fmt: skip
            obj = {
                "trainer": trainer_of(hyper["arch"]),
                "train_shards": shards_of("train", spec.train),
                "val_shards": shards_of("val", spec.val_activation),
                **hyper,
                **targets,  # none for an SAE, whose config then has no target key (INTRODUCED)
                **({"shape": spec.shape} if shapes.get(spec.shape).cross_layer else {}),  # else `target` says
            }
            if obj.get("tokens") == "auto":
                obj["tokens"] = auto_tokens[spec.train]
            if not trains(obj):  # a `trainer:` pin this saeflow does not compute for the architecture
                arch = archs.get(obj["arch"])
                raise SaeflowError(f"{where}.trainer: this saeflow does not train {arch.name} as {obj['trainer']!r}; "
                                   f"choose one of {', '.join((arch.trainer, *arch.earlier_trainers))}")  # fmt: skip
            train_config = TrainConfig.from_dict(obj, where).canonical(unread)
            if "trainer" not in hyper:  # the latest version whose maths differ for this run (`Arch.trainer_for`)
                arch = archs.get(train_config.arch)
                train_config = dataclasses.replace(train_config, trainer=arch.trainer_for(train_config))
            try:  # what its shape cannot train (a CLT's skip path, say), before any metadata
                shapes.check(shapes.of(train_config), train_config.arch, train_config.matryoshka, train_config.skip)
            except SaeflowError as err:
                raise SaeflowError(f"{where}.{err}") from None
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


def auto_tokens_of(md) -> str:
    """What `tokens: auto` means for a shard directory: `no_special` when its metadata records the special ids of
    a text packing (text saeflow extracted), else `content`."""
    return "content" if tokenization.recorded_packing(md) is None else "no_special"


def transcoder_sets(plan) -> dict[str, dict[int, str]]:
    """Whole-model transcoder sets: a spec's transcoder runs that differ only in `layer` (a sweep over layers), as
    {set name (its point's name without the layer): {layer: run id}}, for two layers or more. What `saeflow evaluate
    --run ... --out` splices whole and `export-checkpoint --format circuit-tracer` writes as one set."""
    groups: dict[str, dict[int, str]] = {}
    for run_id, run in plan.runs.items():
        cfg = run.train_config
        if cfg.target is None or cfg.cross_layer:
            continue
        name = point_name(run.sae_name, {k: v for k, v in run.varying.items() if k != "layer"})
        groups.setdefault(name, {})[cfg.layer] = run_id
    return {name: dict(sorted(members.items())) for name, members in groups.items() if len(members) > 1}
