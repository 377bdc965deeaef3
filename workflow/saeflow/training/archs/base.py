"""What an SAE architecture is to saeflow: one object (`Arch`) that every trainer, stage and format asks.

An architecture module (`relu.py`, `topk.py`, ...) defines one subclass and one instance, `ARCH`; the registry
(`training/archs/__init__.py`) lists them. Everything a trainer, the planner or an interop format needs to know about
an architecture is an attribute or method here; no code outside `training/archs/` compares an architecture's name
(tests/test_house.py).

Planning imports the registry at Snakemake parse time, which must not import torch: the architectures reach torch
through `torch` below, a module proxy that imports it on first use (inside a trainer, where it is loaded anyway).

Shapes: b batch, d d_model, s d_sae latents.
"""

import dataclasses
import enum
import importlib
import typing

from saeflow import config

# The training maths' version a run of an architecture records (config.json's `trainer`, so its run id): bumped per
# architecture when its maths change, so the bytes of the others keep their ids (DESIGN principle 12).
FIRST_TRAINER = "saeflow-train-3"


def trainer_number(trainer: str) -> int:
    """N of a trainer version `saeflow-train-N` (N counts up)."""
    return int(trainer.rsplit("-", 1)[1])


def made_since(cfg, trainer: str) -> bool:
    """Whether the run `cfg` was made by `trainer` or a later version: the maths that version introduced apply to
    it."""
    return trainer_number(cfg.trainer) >= trainer_number(trainer)


# The decoder's multiple of the run's learning rate in the architectures that name a `fast_decoder_since` trainer
# (issue 42; docs/training.md, "Learning rate"): its rows turn twice as fast. TopK on a planted dictionary (d 128, 512
# atoms, one pass): 93.8% / 94.5% / 28.9% recovered at 8 active Exp(1) / log-normal and 32 active, against 91.6% /
# 73.6% / 4.3% at 1x; on MiniLM NMSE 4-13% lower at each of six sites, with fewer dead latents. The encoder at 2x too
# recovered as much but left up to 27% of MiniLM's latents dead.
DECODER_LR_SCALE = 2.0
# Rare latents (objectives.DeadLatents with a rarity, in the runs `Arch.revives_rare` names): a latent that fires
# at under RARE_SHARE of the mean rate the run targets (k / d_sae) counts as dead too. JumpReLU's and Gated's latents
# that duplicate an atom another latent holds fire on ~1e-4 of the vectors, too often for a window of silence, and
# stay below their thresholds (issue 42: 15 at d 128, 8 active, with 42 atoms unrecovered; docs/training.md "Rare
# latents"). 1/50 caught them all but also up to 600 of MiniLM's 1,536, whose pull cost layer 2's MLP output 1.3x its
# NMSE; 1/200 left at most 1.0% silent on the planted grid and that site at 1.06x.
RARE_SHARE = 1 / 200
MODES = tuple(mode for mode in config.enum("train", "parallel") if mode != "auto")  # sweep, data, latents
# The parameters every SAE has, in its order (sae.SAE), and the axis along which each has one entry per latent;
# None: held whole (a latent shard keeps all of b_dec).
COMMON_AXES = {"W_enc": 1, "b_enc": 0, "W_dec": 0, "b_dec": None}


class _Torch:
    """`torch`, imported when an attribute is first asked for (never at parse time)."""

    def __getattr__(self, name: str):
        return getattr(importlib.import_module("torch"), name)


torch = _Torch()


class Selection(enum.Enum):
    """How an architecture chooses its active latents in training; each trainer implements each kind once.

    DENSE: an elementwise function of each latent's own pre-activation (and parameters), `Arch.activate`, which
    every trainer calls as it is (on a latent shard too). TOP_K: the k largest of each vector, decoded sparsely.
    BATCH_TOP_K: the k x batch largest of the batch (in data and latent modes: of the global batch).
    WHOLE_DICTIONARY: an encoder that reads every latent at once, from the input itself (`Arch.encode`; matching
    pursuit picks latents greedily against the residual), the same in training and inference. A latent shard holds
    only its own latents, so it trains in every mode but `latents` (`Arch.modes`).
    """

    DENSE = "dense"
    TOP_K = "top_k"
    BATCH_TOP_K = "batch_top_k"
    WHOLE_DICTIONARY = "whole_dictionary"

    @property
    def shards_latents(self) -> bool:
        """Whether a latent shard computes its own codes (with the other ranks' help: `training.ranks.sharded`)."""
        return self is not Selection.WHOLE_DICTIONARY


@dataclasses.dataclass(frozen=True)
class TermInputs:
    """What a sparsity term may read: one batch's training state, in the SAE's normalized space."""

    cfg: typing.Any  # specs.TrainConfig of the run
    model: typing.Any  # the SAE (or this rank's latent shard)
    xn_bd: typing.Any  # the inputs, normalized
    pre_bs: typing.Any  # pre-activations
    f_bs: typing.Any  # dense codes (None when the selection is TOP_K)
    step: int
    n_steps: int
    dead_s: typing.Any = None  # (s,) bool: the latents dead now (objectives.DeadLatents), where the trainer has them
    target_bd: typing.Any = None  # a transcoder's: what its latents decode to (normalized target less the skip path)
    # A (b, d) sum over the latents (a decode) made whole: the identity on one SAE; on a latent shard
    # (training.ranks.sharded) the sum over the ranks' parts, whose backward is the identity.
    over_latents: typing.Callable = lambda partial_bd: partial_bd  # noqa: E731
    # The mean over the whole batch of a per-vector value (b,), without gradient: this batch's in one process, the
    # ranks' slices' together in data-parallel training (a term not linear in the vectors needs it: JumpReLU's target)
    batch_mean: typing.Callable = lambda value_b: value_b.detach().mean()  # noqa: E731

    @property
    def recon_bd(self):
        """What the latents' decode is trained toward: the input (an SAE) or a transcoder's `target_bd`."""
        return self.xn_bd if self.target_bd is None else self.target_bd


class SAELensMapping:
    """How an architecture is saved as SAELens's (interop/checkpoints/sae_checkpoints.py; raw activation space, the
    scale folded), a part of `Arch`."""

    saelens: str | None = None  # the SAELens architecture it is saved as
    # The common tensors its SAELens file holds (`interop.checkpoints.sae_formats.from_saelens` reads these before
    # `saelens_import`, which computes the others: b_enc where the file names it otherwise, a tied encoder)
    saelens_tensors: tuple[str, ...] = ("W_enc", "W_dec", "b_dec")
    # cfg.json keys SAELens's config gives a default saeflow does not guess (TopK's k defaults to 100 there): refused
    # when missing (interop.checkpoints.checkpoint_files.check_cfg)
    saelens_required: tuple[str, ...] = ()
    # ... and as a transcoder (SAELens has ReLU and JumpReLU ones; `skip_` before `transcoder` names the skip variant)
    saelens_transcoder: str | None = None

    def saelens_export(self, sae, tensors: dict, threshold) -> tuple[dict, dict]:
        """(cfg.json keys beyond the common ones, the tensors of the weights file) from saeflow's raw-space tensors
        (W_enc, b_enc, W_dec, b_dec and this architecture's `parameters`)."""
        return {}, tensors

    def saelens_claims(self, cfg: dict) -> bool:
        """Among the architectures saved under one SAELens name, whether a cfg.json is this one's."""
        return True

    def saelens_import(self, cfg: dict, tensors: dict, weights: dict) -> dict:
        """`weights` (W_enc, b_enc, W_dec, b_dec, threshold and this architecture's `parameters`; `k` where its cfg.json
        names it otherwise) as saeflow computes them from the file's `tensors` (`weights` holds its `saelens_tensors`,
        None for an absent W_enc or b_enc); raise `Unsupported` for what saeflow cannot compute."""
        return weights


class RunPolicy:
    """What an architecture's training does for one run, asked with its config `cfg` (a specs.TrainConfig): the keys
    it reads, the terms it logs, its decoder rows' norms, its parameters' learning rates, the parallel modes and
    values it refuses. Mixed into `Arch`, whose class attributes it reads."""

    def reads(self, cfg) -> tuple[str, ...]:
        """The keys of `hyper` the run `cfg` (a specs.TrainConfig) reads: all of them, unless a mode of the
        architecture leaves some unread (JumpReLU's `jumprelu_loss`)."""
        return self.hyper

    def loss_reads(self, loss_keys: dict, loss: str) -> tuple[str, ...]:
        """The keys of `hyper` a run of the loss `loss` reads: all but those only another loss of `loss_keys` (loss ->
        its own keys) reads (JumpReLU's `jumprelu_loss`, Gated's `gated_loss`)."""
        other = {key for name, keys in loss_keys.items() if name != loss for key in keys}
        return tuple(key for key in self.hyper if key not in other)

    def logged_terms(self, cfg) -> tuple[str, ...]:
        """The loss terms a run `cfg` logs, in order: `term_names`, or those of its loss (Gated's `gated_loss`)."""
        return self.term_names

    def unit_decoder_for(self, cfg) -> bool:
        """Whether the run `cfg`'s SAE keeps its decoder rows at unit norm (`unit_decoder`); otherwise they train
        freely and are folded into the encoder when published (`foldable`)."""
        return self.unit_decoder

    def decoder_init_norm_for(self, cfg) -> float:
        """The norm the run `cfg`'s decoder rows start at (`decoder_init_norm`; a transcoder's encoder columns)."""
        return self.decoder_init_norm

    def unit_rows(self, sae_cfg, cfg) -> bool:
        """Whether the trainer keeps this SAE's decoder rows at unit norm (`unit_decoder_for` the run `cfg`); a
        transcoder's train freely from zero, as sparsify trains them (`sae.init_transcoder` has the measurements),
        whatever the architecture: its decoder maps into another space than its encoder reads, so no row norm is
        the encoder's."""
        return self.unit_decoder_for(cfg) and not sae_cfg.transcoder

    def auto_lr_scale(self, cfg) -> float:
        """The multiple of `rates.auto_lr` the run `cfg` trains at when its `lr` is null (the default); an `lr` the
        user sets is the rate."""
        return 1.0

    def lr_scales(self, cfg) -> dict:
        """Parameters that train at a multiple of the run's learning rate (name -> multiple; the others at 1), from
        the run's config `cfg` (e.g. JumpReLU's thresholds: `threshold_lr_scale`). The decoder's multiple is not
        here but in `decoder_lr_scales`, which `rates.lr_scales` merges with these for every architecture."""
        return {}

    def decoder_lr_scales(self, cfg) -> dict:
        """W_dec at DECODER_LR_SCALE in a run made since the architecture's `fast_decoder_since` trainer, else {}."""
        since = self.fast_decoder_since
        return {"W_dec": DECODER_LR_SCALE} if since is not None and made_since(cfg, since) else {}

    def revives_rare(self, cfg) -> bool:
        """Whether the run `cfg` counts rare latents as dead (RARE_SHARE of the k / d_sae it targets: `rare_rate`) and
        pulls them up (`sparsity_terms`): made since the architecture's `revives_rare_since` trainer, reading `k`."""
        since = self.revives_rare_since
        return since is not None and made_since(cfg, since) and "k" in self.reads(cfg)

    def rare_rate(self, cfg, d_sae: int) -> float | None:
        """The firing rate per vector under which the run `cfg`'s latents (`d_sae` of them) are rare: RARE_SHARE of
        the k / d_sae it targets, where it `revives_rare`; else None."""
        return RARE_SHARE * cfg.k / d_sae if self.revives_rare(cfg) else None

    def trainer_for(self, cfg) -> str:
        """The trainer a new run `cfg` records: `trainer`, or the version before it for a run whose maths that version
        leaves as they were (one that does not revive rare latents, where that is all it changed), so its id stays."""
        now = dataclasses.replace(cfg, trainer=self.trainer)
        if self.revives_rare_since == self.trainer and not self.revives_rare(now):
            return f"saeflow-train-{trainer_number(self.trainer) - 1}"
        return self.trainer

    def mode_refusal(self, cfg, mode: str) -> str | None:
        """Why the run `cfg` cannot train in the parallel `mode` (one of its `modes`), or None."""
        return None

    def batch_means(self, cfg) -> int:
        """How many `TermInputs.batch_mean`s the run `cfg`'s `sparsity_terms` take (each an all-reduce in
        data-parallel training, which a rank without rows of the batch joins with zeros)."""
        return 0

    def check(self, cfg) -> None:
        """Refuse hyper-parameters it cannot train with, as SaeflowError "<key>: <problem>" (plan and train time)."""


class Arch(SAELensMapping, RunPolicy):
    """One SAE architecture. Subclasses set the class attributes and override what differs from the defaults."""

    name: str = ""  # the schema's sae_spec.arch value
    selection: Selection = Selection.DENSE
    trainer: str = FIRST_TRAINER  # the version of its training maths its new runs record (`FIRST_TRAINER`)
    # Earlier versions whose maths it still computes: a run made by one resumes as it started (another is refused)
    earlier_trainers: tuple[str, ...] = ()
    # The trainer since which its decoder trains at DECODER_LR_SCALE (`decoder_lr_scales`); None: at the run's rate
    fast_decoder_since: str | None = None
    # The trainer since which a run that targets an L0 (reads `k`) revives its rare latents (`revives_rare`)
    revives_rare_since: str | None = None
    # The parallel modes it trains in (the plan refuses the others), set from its selection by `__init_subclass__`:
    # every mode, but `latents` for a selection a latent shard cannot compute (`Selection.shards_latents`). A
    # subclass may name fewer.
    modes: tuple[str, ...] = MODES
    # It trains as a transcoder (an input and a target: `SAEConfig.d_out`, optional skip path); one that does not
    # (its encoder is its decoder's transpose, say) is refused at plan time in one line (`SAEConfig`).
    transcodes: bool = True
    # ... in these parallel modes of its `modes`: every mode (a latent shard's decoder rows write the target's space,
    # its skip path is whole on every rank)
    transcoder_modes: tuple[str, ...] = MODES
    # The training keys it may read beyond the ones every run reads (`keys.COMMON`), in any mode: a key no
    # architecture of a run declares is hashed at a fixed value (`specs.TrainConfig.canonical`), so it names no run.
    hyper: tuple[str, ...] = ()
    # The keys of `hyper` its runs hash at the spec's value even in a mode that does not read them
    # (`SAESpec.unread_values`), so that runs they named before its modes read fewer keep their ids; None: all of
    # `hyper` (JumpReLU's). A key it leaves unread and that never named its runs is hashed at its fixed value.
    legacy_hashed: tuple[str, ...] | None = None
    # Decoder rows kept at unit norm (gradient along them removed, renormalized each step), and the norm they start
    # at: what `unit_decoder_for` and `decoder_init_norm_for` give every run of it, unless its loss decides
    unit_decoder: bool = True
    decoder_init_norm: float = 1.0
    ghost_aux: bool = False  # AuxK's dead latents act through softplus (their pre-activations are negative)
    term_names: tuple[str, ...] = ("mse", "aux")  # the loss terms it logs, in order (`logged_terms`: a run's)
    # Its sparsity terms computed from a whole decode (`TermInputs.over_latents`): the same on every latent shard.
    # The others are sums over the latents, of which a shard computes its own share (summed when logged).
    whole_terms: tuple[str, ...] = ()
    # The `threshold` buffer is its inference threshold (BatchTopK's, kept by `after_step`; matching pursuit's
    # residual norm at which it stops), which its SAELens export reads.
    has_threshold: bool = False
    # Its inference codes are k (value, latent) pairs per vector (`picks`), so inference decodes them from the picks
    # and never makes them dense (analysis.inference.encode_entries); a threshold's codes are not.
    k_sparse: bool = False
    sparsify: str | None = None  # the sparsify activation it is saved as; None: sparsify cannot represent it

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "modes" not in cls.__dict__:
            cls.modes = tuple(mode for mode in MODES if mode != "latents" or cls.selection.shards_latents)

    @property
    def hashed_unread(self) -> tuple[str, ...]:
        """`legacy_hashed`, or all of `hyper`."""
        return self.hyper if self.legacy_hashed is None else self.legacy_hashed

    @property
    def uses_k(self) -> bool:
        """k is its active latents per vector (SAEConfig checks 1 <= k <= d_sae)."""
        return "k" in self.hyper

    def activate(self, sae, pre_bs):
        """Pre-activations (b, s) -> non-negative codes (b, s): inference, and training when DENSE."""
        raise NotImplementedError(self.name)

    def picks(self, sae, pre_bs):
        """Its codes as k (value, latent) pairs per vector (vals_bk, idx_bk): what `activate` scatters (values may be
        0). Only where `k_sparse`."""
        raise NotImplementedError(self.name)

    def encode(self, sae, xn_bd):
        """Normalized inputs (b, d) -> codes (b, s), what `SAE.encode` and `forward` compute: the activation of the
        pre-activations; a WHOLE_DICTIONARY selection computes them from the inputs (in training too)."""
        return self.activate(sae, sae.pre_acts_normed(xn_bd))

    def train_activate(self, sae, pre_bs, cfg, step: int, n_steps: int):
        """`activate` in training (DENSE), at `step` of the run's `n_steps`: the same values, with the gradient the
        run's config (`cfg`) asks for (or another selection early in the run: JumpReLU's TopK warm-up)."""
        return self.activate(sae, pre_bs)

    def parameters(self, d_sae: int) -> dict:
        """Parameters beyond W_enc, b_enc, W_dec, b_dec (name -> zeros of their shape), added after them."""
        return {}

    def latent_axes(self) -> dict:
        """Every parameter, in the SAE's order (the Adam state's indices), -> the axis along which it has one entry
        per latent, or None when it is held whole. A latent-sharded rank holds [lo, hi) along that axis
        (training.ranks.sharded, training.resume), so no trainer names a parameter. The architecture's own `parameters`
        are per-latent vectors (axis 0); one that is not overrides this."""
        return {**COMMON_AXES, **dict.fromkeys(self.parameters(0), 0)}

    def init_parameters(self, sae, cfg) -> None:
        """Set those parameters at the start of training (after the data-based init of the common ones)."""

    def sparsity_terms(self, batch: TermInputs) -> dict:
        """The loss terms beyond reconstruction and AuxK (name -> scalar, weights applied), per vector averaged."""
        return {}

    def after_step(self, sae, acts, step: int, reduce) -> None:
        """After each optimizer step (every trainer calls it once a step, every rank, under no_grad): what the SAE
        keeps beside its gradients, e.g. BatchTopK's inference threshold, or matching pursuit's encoder tied to its
        decoder. `sae` is the SAE or a rank's latent shard; `acts` the step's activations as its codes hold them
        (dense (b, s), or the picks' values); `reduce(t, op)`: `t` reduced elementwise over every rank by op "min",
        "max" or "sum" (`objectives.one_process` in one process; over a latent shard's ranks, a one-element tensor)."""

    def foldable(self) -> bool:
        """Decoder row norms can move into the encoder without changing the codes (`SAE.fold_decoder_norms`)."""
        return False

    def fold_parameters(self, sae, norms_s) -> None:
        """Its own parameters' share of `SAE.fold_decoder_norms` (W_enc's columns and b_enc are scaled by norms_s)."""


class Unsupported(Exception):
    """A checkpoint or pairing saeflow cannot compute; the caller names the file or key."""
