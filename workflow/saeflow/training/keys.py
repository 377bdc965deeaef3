"""Which keys a run's training config holds, which of them its architecture reads, and how each is hashed.

The run id hashes `specs.TrainConfig.to_dict()`. Two rules keep published ids where they are (docs/contracts.md,
"Identities that outlive upgrades"): a key added later is left out at the value it was introduced at (`INTRODUCED`,
`canonical_spec`), and a key the run's architecture does not read (not `COMMON`, not its `Arch.reads`) is hashed
at a fixed value (`sweeps.unread_value`, `specs.TrainConfig.canonical`), so it names no run. No torch: planning
imports this at parse time.
"""

import typing

from saeflow.training import archs

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
    # JumpReLU (issue 42): the L0 steered to k (`jumprelu_loss: target`), and a TopK start whose firing rates set the
    # thresholds; at 0 a run starts with its thresholds
    "target_l0_coeff": 8.0,
    "topk_warmup_frac": 0.0,
    # Gated (issue 42): JumpReLU's mechanism for its gates (`gated_loss: target`); at "l1" the paper's L1 loss
    "gated_loss": "l1",
    # Transcoders (issue 35): the target activation's shard hash (train and validation) and the linear skip path;
    # at these values the run is a plain SAE
    "target": None,
    "val_target": None,
    "skip": False,
    # Dictionary shapes (issue 43, training/shapes.py): "clt" for a cross-layer transcoder, whose `layer`, shard and
    # target keys are then lists, a layer each; "auto": an SAE or a transcoder, as `target` says
    "shape": "auto",
}


# The keys every run reads, whatever its architecture (AuxK's too: the dense architectures revive latents through
# softplus). The others are read only by the architectures that declare them (`Arch.hyper`, `Arch.reads`).
COMMON = ("trainer", "train_shards", "val_shards", "layer", "tokens", "arch", "expansion", "matryoshka", "aux_k",
          "aux_alpha", "dead_after_vectors", "lr", "lr_warmup_frac", "batch_size", "n_epochs", "n_train_vectors",
          "n_val_vectors", "seed", "data_seed", "target", "val_target", "skip", "shape")  # fmt: skip
ARCH_KEYS = tuple(sorted({key for arch in archs.REGISTRY.values() for key in arch.hyper}))  # each read by some


def same_value(a, b) -> bool:
    """Equal as the run config holds them (`True` is not 1)."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def at_introduction(key: str, value) -> bool:
    """True when `key` is an introduced key and `value` is the value it was introduced at (left out when hashed)."""
    return key in INTRODUCED and same_value(value, INTRODUCED[key])


def job_spec(spec: typing.Mapping[str, typing.Any]) -> dict:
    """An `saes.<name>` entry as its run jobs' configs hold it (their rerun trigger): `canonical_spec`, less the
    introduced keys none of its architectures declares, so a default one architecture changes (JumpReLU's loss)
    leaves the other architectures' job configs byte for byte as they were."""
    names = spec.get("arch", ())
    declared = {key for name in ([names] if isinstance(names, str) else names) if name in archs.REGISTRY
                for key in archs.get(name).hyper}  # fmt: skip
    return {key: value for key, value in canonical_spec(spec).items()
            if key not in INTRODUCED or key not in ARCH_KEYS or key in declared}  # fmt: skip


def canonical_spec(obj: typing.Mapping[str, typing.Any]) -> dict:
    """An `saes.<name>` entry (or a run's hyper-parameters) without the introduced keys at their introduction value:
    what a per-job config holds, so an upgrade that adds a key with a default leaves it byte for byte unchanged."""
    return {key: value for key, value in obj.items() if not at_introduction(key, value)}
