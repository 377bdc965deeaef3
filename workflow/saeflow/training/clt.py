"""A cross-layer transcoder (CLT; Ameisen et al. 2025, "Circuit Tracing"): an encoder per layer, and each layer's
latents decoding into that layer's target and every later one's.

    xn_l    = x_l * scale_l                                       l = 0..L-1 (the CLT's layers, ascending)
    f_l     = activation(xn_l @ W_enc_l + b_enc_l)                 (b, s)
    yhat_j  = (sum_{l <= j} f_l @ W_dec_l[:, j - l] + b_dec_j) / target_scale_j

Layer l's encoder and its decoders are one transcoder (training/sae.py `SAE`, d_out = (L - l) x d_target: W_dec_l
is circuit-tracer's (s, L - l, d) flattened), so every architecture's activation, selection, sparsity terms and
AuxK run on it unchanged (training/objectives.py), and the decoder norm a sparsity term weighs is the norm of the
latent's decoders across every layer it writes, as in the paper. Each encoder's b_dec covers the layers it writes;
b_dec_j is their sum at j (`output_bias`). Targets are normalized per layer (`target_scale`, held here; the
encoders' own stay 1), inputs by each encoder's `scale`.

The loss sums the layers' squared errors (normalized space) and every encoder's sparsity and AuxK terms; an
encoder's terms aim at what it alone should decode (its layers' targets less the other encoders' decodes, without
gradient), and AuxK at the error left in its layers. `sae.pt` of a CLT run is this module's (`FORMAT`); `load_clt`.

Shapes: b batch, d width, s latents per layer, L layers, o a layer's outputs ((L - l) d).
"""

import dataclasses
import os
import pathlib

import torch

from saeflow.errors import SaeflowError
from saeflow.training import objectives
from saeflow.training.objectives import DeadLatents, aux_k_loss, encode, loss_terms, pick_dead, pre_acts
from saeflow.training.sae import SAE, init_transcoder, norm_scale, randn_rows, read_checkpoint, save_atomic
from saeflow.training.specs import SAEConfig, TrainConfig

FORMAT, FORMAT_VERSION = "saeflow-clt", 1


@dataclasses.dataclass(frozen=True)
class CLTConfig:
    """Everything that rebuilds a CLT: its layers and its layer-0 encoder's transcoder (`sae`: widths, architecture,
    latents per layer; its d_out is one layer's target width)."""

    layer_ids: tuple[int, ...]  # the layers it spans, ascending
    sae: SAEConfig

    def __post_init__(self):
        object.__setattr__(self, "layer_ids", tuple(int(layer) for layer in self.layer_ids))
        if isinstance(self.sae, dict):  # as save_clt writes it
            object.__setattr__(self, "sae", SAEConfig(**{**self.sae, "matryoshka": tuple(self.sae["matryoshka"])}))

    @property
    def d_out(self) -> int:
        return self.sae.d_target

    @property
    def d_sae(self) -> int:
        return self.sae.d_sae

    def encoder(self, i: int) -> SAEConfig:
        """The transcoder of layer index `i`: its latents write the targets of layers i..L-1."""
        return dataclasses.replace(self.sae, d_out=(len(self.layer_ids) - i) * self.d_out)

    @classmethod
    def of_run(cls, cfg: TrainConfig, d_model: int, d_out: int) -> "CLTConfig":
        return cls(cfg.spanned_layers, cfg.sae_config(d_model, d_out))  # what the run's keys must satisfy: k, the shape


class CLT(torch.nn.Module):
    """The encoders (one transcoder per layer) and the targets' per-layer normalization."""

    def __init__(self, cfg: CLTConfig):
        super().__init__()
        self.cfg = cfg
        self.encoders = torch.nn.ModuleList(SAE(cfg.encoder(i)) for i in range(len(cfg.layer_ids)))
        self.register_buffer("target_scale", torch.ones(len(cfg.layer_ids)))
        self.d_sae = cfg.d_sae * len(cfg.layer_ids)  # every latent (what a degenerate result is judged against)

    @property
    def arch(self):
        return self.encoders[0].arch

    def latent_axes(self) -> dict:
        """No latent shards: a CLT trains on one process (training/shapes.py)."""
        return {}

    def output_bias(self, j: int) -> torch.Tensor:
        """b_dec_j (normalized): the encoders' biases at layer index j, summed."""
        d = self.cfg.d_out
        return sum(self.encoders[i].b_dec[(j - i) * d : (j - i + 1) * d] for i in range(j + 1))

    def outputs(self, decodes: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each layer's normalized prediction (b, d) from the encoders' decodes (b, o_i), biases included."""
        d = self.cfg.d_out
        return [sum(decodes[i][:, (j - i) * d : (j - i + 1) * d] for i in range(j + 1)) for j in range(len(decodes))]

    def predict(self, codes, j: int) -> torch.Tensor:
        """Layer index j's RAW prediction (b, d) from the codes (b, s) of layers 0..j (`codes[i]`: a list, or the
        dict a pass fills layer by layer): (b_dec_j + sum_{i <= j} f_i @ W_dec_i[:, j - i]) / target_scale_j."""
        d = self.cfg.d_out
        yn_bd = self.output_bias(j) + sum(codes[i] @ self.encoders[i].W_dec[:, (j - i) * d : (j - i + 1) * d]
                                          for i in range(j + 1))  # fmt: skip
        return yn_bd / self.target_scale[j]

    @torch.no_grad()
    def forward(self, xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """RAW inputs, a (b, d) per layer -> (RAW predictions per layer, codes (b, s) per layer)."""
        codes = [sae.encode(x_bd) for sae, x_bd in zip(self.encoders, xs)]
        return [self.predict(codes, j) for j in range(len(codes))], codes

    def weights(self) -> dict[str, torch.Tensor]:
        """circuit-tracer's CLT tensors in RAW space (interop/checkpoints/circuit_tracer.py): W_enc_i (s, d), b_enc_i,
        b_dec_i (d) and W_dec_i (s, L - i, d), the scales folded (the encoders read raw inputs, the decoders write
        raw targets)."""
        L, d, out = len(self.cfg.layer_ids), self.cfg.d_out, {}
        for i, sae in enumerate(self.encoders):
            scale_o = self.target_scale[i:].repeat_interleave(d)  # raw target j = normalized / target_scale_j
            out[f"W_enc_{i}"] = (sae.W_enc * sae.scale).T.contiguous()
            out[f"b_enc_{i}"] = sae.b_enc.clone()
            out[f"b_dec_{i}"] = self.output_bias(i) / self.target_scale[i]
            out[f"W_dec_{i}"] = (sae.W_dec / scale_o).reshape(self.cfg.d_sae, L - i, d).contiguous()
        return {name: t.detach().cpu() for name, t in out.items()}


@torch.no_grad()
def init_from_data(clt: CLT, xs: list[torch.Tensor], ys: list[torch.Tensor], seed: int, cfg: TrainConfig,
                   root) -> None:  # fmt: skip
    """The start of a CLT run from samples of every layer's inputs `xs` and targets `ys`: each encoder's input scale,
    each layer's target scale, b_dec_j = the mean normalized target of layer j (held by encoder j's own slot), and
    each encoder as a transcoder starts (`sae.init_transcoder`: random unit encoder columns, decoders at zero), the
    draws one after another from one generator seeded `seed`; then the architecture's own parameters."""
    gen = torch.Generator().manual_seed(seed)
    device = clt.target_scale.device
    for j, (sae, x_nd, y_nd) in enumerate(zip(clt.encoders, xs, ys)):
        x_nd, y_nd = x_nd.to(device, torch.float32), y_nd.to(device, torch.float32)
        sae.scale.fill_(norm_scale(x_nd, sae.d_model, root))
        clt.target_scale[j] = norm_scale(y_nd, clt.cfg.d_out, root)
        init_transcoder(sae, x_nd * sae.scale, randn_rows(gen, sae.d_sae, sae.d_model, 0, sae.d_sae), cfg)
        sae.b_dec.zero_()
        sae.b_dec[: clt.cfg.d_out] = (y_nd * clt.target_scale[j]).mean(0)
        sae.arch.init_parameters(sae, cfg)


@dataclasses.dataclass(frozen=True)
class CLTLoss:
    """One step's loss: the total, its terms summed over the encoders, each layer's normalized prediction and
    target, and each encoder's codes."""

    total: torch.Tensor
    terms: dict[str, torch.Tensor]
    preds: list[torch.Tensor]
    targets: list[torch.Tensor]
    codes: list[objectives.Codes]

    def nmse(self) -> float:
        """The batch's NMSE over every layer's target (errors and variances summed across layers)."""
        err = sum(float((p.detach() - t).double().square().sum()) for p, t in zip(self.preds, self.targets))
        var = sum(float((t.double() - t.double().mean(0)).square().sum()) for t in self.targets)
        return err / var if var > 0 else float("nan")

    def l0(self) -> float:
        """Active latents per token, summed over the layers (the CLT's L0)."""
        return sum(codes.l0() for codes in self.codes)


def clt_loss(clt: CLT, xs: list[torch.Tensor], ys: list[torch.Tensor], step: int, n_steps: int,
             deads: list[DeadLatents], cfg: TrainConfig) -> CLTLoss:  # fmt: skip
    """One step's loss on RAW inputs and targets (a (b, d) per layer); see the module docstring."""
    xns, pres, picks, codes, aux_pres, decodes = [], [], [], [], [], []
    for sae, x_bd, dead in zip(clt.encoders, xs, deads):
        xn_bd = x_bd * sae.scale
        pre = pre_acts(cfg, sae, xn_bd)
        dead_z, pick_bk = pick_dead(pre.pre_bs, dead.dead_s, cfg.aux_k)
        code, aux_pre_bk = encode(sae, xn_bd, pre, None if pick_bk is None else dead_z[pick_bk], cfg, (step, n_steps))
        xns.append(xn_bd), pres.append(pre.pre_bs), picks.append((dead_z, pick_bk)), codes.append(code)
        aux_pres.append(aux_pre_bk), decodes.append(code.decode(sae))
    yns = [y_bd * clt.target_scale[j] for j, y_bd in enumerate(ys)]
    preds = clt.outputs(decodes)
    mse = torch.stack([(p - t).square().sum(-1).mean() for p, t in zip(preds, yns)]).sum()
    terms: dict[str, torch.Tensor] = {}
    for i, sae in enumerate(clt.encoders):
        target_bo, pred_bo = torch.cat(yns[i:], 1), torch.cat(preds[i:], 1)
        own_bo = target_bo - (pred_bo - decodes[i]).detach()  # what encoder i alone should decode
        (dead_z, pick_bk), aux_pre_bk = picks[i], aux_pres[i]

        def aux_error(sae=sae, dead_z=dead_z, pick_bk=pick_bk, aux_pre_bk=aux_pre_bk, resid_bo=target_bo - pred_bo):
            if pick_bk is None:
                return None
            return aux_k_loss(sae, aux_pre_bk, dead_z, pick_bk, resid_bo, sae.arch.ghost_aux)

        zero = mse.new_zeros(())
        for name, term in loss_terms(cfg, sae, xns[i], pres[i], codes[i].f_bs, zero, aux_error, step, n_steps,
                                     None, deads[i].dead_s, own_bo).items():  # fmt: skip
            terms[name] = terms.get(name, zero) + term
    terms["mse"] = mse
    return CLTLoss(sum(terms.values()), terms, preds, yns, codes)


# ---------------------------------------------------------------------------------------------------------------
# sae.pt of a CLT run
# ---------------------------------------------------------------------------------------------------------------


def save_clt(clt: CLT, fpath: str | os.PathLike, readonly: bool = False) -> None:
    """Write the CLT atomically (read-only when `readonly`): its config and weights."""
    obj = {"format": FORMAT, "version": FORMAT_VERSION, "config": dataclasses.asdict(clt.cfg),
           "state_dict": {name: t.detach().cpu().clone() for name, t in clt.state_dict().items()}}  # fmt: skip
    save_atomic(obj, fpath, readonly=readonly)


def load_clt(fpath: str | os.PathLike) -> CLT:
    """A CLT written by `save_clt`, in eval mode on CPU; only tensors and plain data are unpickled."""
    fpath = pathlib.Path(fpath)
    obj = read_checkpoint(fpath, "CLT checkpoint")
    if not isinstance(obj, dict) or obj.get("format") != FORMAT or obj.get("version") != FORMAT_VERSION:
        raise SaeflowError(f"{fpath}: not a saeflow cross-layer transcoder (format {FORMAT!r} {FORMAT_VERSION})")
    try:
        clt = CLT(CLTConfig(**obj["config"]))
        clt.load_state_dict(obj["state_dict"])
    except (TypeError, KeyError, RuntimeError, SaeflowError) as err:
        raise SaeflowError(f"{fpath}: damaged CLT checkpoint ({err})") from None
    return clt.eval()
