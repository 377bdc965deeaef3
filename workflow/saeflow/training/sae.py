"""The SAE family (every architecture of training/archs, each optionally Matryoshka) and its self-describing `sae.pt`.

All SAEs share one parameterization in *normalized* space, where inputs are scaled by `scale` so that their mean
squared norm is d_model (so hyper-parameters transfer across models and layers):

    x_n   = x_bd * scale
    pre   = (x_n - b_dec) @ W_enc + b_enc                    (b, s)
    f_bs  = activation(pre)                                   non-negative codes
    x_hat = (f_bs @ W_dec + b_dec) / scale                    back in RAW activation space

`encode`/`decode`/`forward` take and return RAW activations; the `*_normed` methods are what training uses.
`sae.pt` holds the architecture, the weights and the normalization, so `load_sae` needs nothing else.
"""

import dataclasses
import errno
import os
import pathlib
import shutil
import warnings

import torch

from saeflow.errors import SaeflowError, unreadable
from saeflow.store import atomic
from saeflow.training import archs
from saeflow.training.sweeps import SAEConfig

FORMAT = "saeflow-sae"
FORMAT_VERSION = 1


class SAE(torch.nn.Module):
    """A sparse autoencoder; see the module docstring for the maths."""

    def __init__(self, cfg: SAEConfig):
        super().__init__()
        self.cfg = cfg
        self.d_model, self.d_sae = cfg.d_model, cfg.d_sae
        self.W_enc = torch.nn.Parameter(torch.zeros(cfg.d_model, cfg.d_sae))
        self.b_enc = torch.nn.Parameter(torch.zeros(cfg.d_sae))
        self.W_dec = torch.nn.Parameter(torch.zeros(cfg.d_sae, cfg.d_model))
        self.b_dec = torch.nn.Parameter(torch.zeros(cfg.d_model))
        # Raw -> normalized multiplier; an inference threshold (Arch.has_threshold), in normalized pre-activation units.
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("threshold", torch.zeros(()))
        for name, zeros in self.arch.parameters(cfg.d_sae).items():  # e.g. JumpReLU's thresholds (training/archs)
            self.register_parameter(name, torch.nn.Parameter(zeros))

    @classmethod
    def from_weights(
        cls,
        W_enc_ds: torch.Tensor,
        b_enc_s: torch.Tensor,
        W_dec_sd: torch.Tensor,
        b_dec_d: torch.Tensor,
        arch: str,
        k: int,
        scale: float = 1.0,
        threshold: float = 0.0,
        matryoshka: tuple[int, ...] = (),
        extra: dict | None = None,
    ) -> "SAE":
        """An SAE with given weights (normalized space), e.g. for tests with known codes; `extra`: the architecture's
        own parameters (`Arch.parameters`, e.g. JumpReLU's log_threshold)."""
        d_model, d_sae = W_enc_ds.shape
        sae = cls(SAEConfig(d_model=d_model, d_sae=d_sae, arch=arch, k=k, matryoshka=matryoshka))
        state = {
            "W_enc": W_enc_ds,
            "b_enc": b_enc_s,
            "W_dec": W_dec_sd,
            "b_dec": b_dec_d,
            "scale": torch.tensor(float(scale)),
            "threshold": torch.tensor(float(threshold)),
            **(extra or {}),
        }
        sae.load_state_dict({k: torch.as_tensor(v, dtype=torch.float32) for k, v in state.items()})
        return sae.eval()

    # -- normalized space (training) ------------------------------------------------------------------------

    def pre_acts_normed(self, xn_bd: torch.Tensor) -> torch.Tensor:
        """(x_n - b_dec) @ W_enc + b_enc, written so b_dec's gradient costs a vector product, not a third matmul."""
        return xn_bd @ self.W_enc + (self.b_enc - self.b_dec @ self.W_enc)

    @property
    def arch(self) -> archs.Arch:
        """This SAE's architecture (training/archs): its activation, losses, decoder policy and formats."""
        return archs.get(self.cfg.arch)

    def activate(self, pre_bs: torch.Tensor) -> torch.Tensor:
        """Pre-activations -> non-negative sparse codes (the architecture's `activate`; BatchTopK uses the batch in
        training, a threshold in eval)."""
        return self.arch.activate(self, pre_bs)

    def decode_normed(self, f_bs: torch.Tensor, n_latents: int | None = None) -> torch.Tensor:
        """Reconstruction in normalized space from the first `n_latents` latents (all by default)."""
        if n_latents is None:
            return f_bs @ self.W_dec + self.b_dec
        return f_bs[:, :n_latents] @ self.W_dec[:n_latents] + self.b_dec

    def decode_sparse_normed(
        self, vals_bk: torch.Tensor, idx_bk: torch.Tensor, n_latents: int | None = None
    ) -> torch.Tensor:
        """`decode_normed` from k (value, latent index) pairs per vector: O(b k d) instead of a dense O(b s d)."""
        if n_latents is not None:
            vals_bk = vals_bk * (idx_bk < n_latents)
        return (
            torch.nn.functional.embedding_bag(idx_bk, self.W_dec, per_sample_weights=vals_bk, mode="sum") + self.b_dec
        )

    # -- raw space (the public API) -------------------------------------------------------------------------

    def encode(self, x_bd: torch.Tensor) -> torch.Tensor:
        """RAW activations (b, d_model) -> non-negative codes (b, d_sae)."""
        return self.activate(self.pre_acts_normed(x_bd * self.scale))

    def decode(self, f_bs: torch.Tensor) -> torch.Tensor:
        """Codes (b, d_sae) -> reconstruction (b, d_model) in RAW activation space."""
        return self.decode_normed(f_bs) / self.scale

    def forward(self, x_bd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f_bs = self.encode(x_bd)
        return self.decode(f_bs), f_bs

    # -- decoder geometry -----------------------------------------------------------------------------------

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        """Unit-norm decoder rows (so sparsity penalties and codes cannot be gamed by rescaling)."""
        self.W_dec.div_(self.W_dec.norm(dim=-1, keepdim=True).clamp_min(1e-8))

    @torch.no_grad()
    def fold_decoder_norms(self) -> None:
        """Unit decoder rows without changing the function: row j's norm moves into latent j's encoder column and
        bias; exact only where the architecture says so (`Arch.foldable`: a per-vector TopK or threshold would
        re-rank)."""
        if not self.arch.foldable():
            raise SaeflowError(f"fold_decoder_norms is not exact for {self.cfg.arch} SAEs")
        norms_s = self.W_dec.norm(dim=-1).clamp_min(1e-8)
        self.W_dec.div_(norms_s[:, None])
        self.W_enc.mul_(norms_s)
        self.b_enc.mul_(norms_s)
        self.arch.fold_parameters(self, norms_s)

    @torch.no_grad()
    def remove_parallel_grad(self) -> None:
        """Drop the gradient component along each (unit) decoder row: it would only change the row's norm."""
        if self.W_dec.grad is None:
            return
        parallel_s1 = (self.W_dec.grad * self.W_dec).sum(dim=-1, keepdim=True)
        self.W_dec.grad.sub_(parallel_s1 * self.W_dec)


# ---------------------------------------------------------------------------------------------------------------
# sae.pt
# ---------------------------------------------------------------------------------------------------------------


def save_sae(sae: SAE, fpath: str | os.PathLike, readonly: bool = False) -> None:
    """Write `sae.pt` atomically (read-only when `readonly`): weights + architecture + normalization."""
    obj = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "config": dataclasses.asdict(sae.cfg),
        "state_dict": {name: t.detach().cpu().clone() for name, t in sae.state_dict().items()},
    }
    save_atomic(obj, fpath, readonly=readonly)


def save_atomic(obj, fpath: str | os.PathLike, readonly: bool = False) -> None:
    """`torch.save` through a temporary sibling, fsync and rename: a crash leaves the old file or the new one.

    torch streams the archive to disk (a large SAE's resume state is never held twice in memory). Its writer reports
    a full disk only as "enforce fail at inline_container.cc"; when the filesystem then has less room than the
    tensors need, that is turned into the OSError(ENOSPC) `atomic.replacing` reports in one line.
    """
    fpath = pathlib.Path(fpath)
    with atomic.replacing(fpath) as tmp_fpath:
        try:
            torch.save(obj, tmp_fpath)
        except RuntimeError as err:
            if shutil.disk_usage(tmp_fpath.parent).free < _tensor_bytes(obj):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_fpath)) from err
            raise
        if readonly:
            os.chmod(tmp_fpath, atomic.READONLY_FILE_MODE)


def _tensor_bytes(obj) -> int:
    """Bytes of every tensor in a (nested) state: what torch.save must write at least."""
    if isinstance(obj, torch.Tensor):
        return obj.nelement() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def load_sae(fpath: str | os.PathLike) -> SAE:
    """Load `sae.pt` into an SAE in eval mode on CPU. Only tensors and plain data are unpickled."""
    fpath = pathlib.Path(fpath)
    try:
        with warnings.catch_warnings():  # torch warns about odd pickle protocols before failing on a damaged file
            warnings.simplefilter("ignore")
            obj = torch.load(fpath, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise SaeflowError(f"{fpath}: no such SAE checkpoint") from None
    except OSError as err:
        raise unreadable(fpath, err) from None
    except Exception as err:  # torch raises many types (and long messages) for a damaged file
        raise SaeflowError(
            f"{fpath}: not a readable SAE checkpoint (damaged, or not written by torch.save: {type(err).__name__})"
        ) from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise SaeflowError(f"{fpath}: not a saeflow SAE checkpoint (no format={FORMAT!r} marker)")
    if obj.get("version") != FORMAT_VERSION:
        raise SaeflowError(f"{fpath}: checkpoint version {obj.get('version')}, this saeflow reads {FORMAT_VERSION}")
    try:
        sae = SAE(SAEConfig(**obj["config"]))
        sae.load_state_dict(obj["state_dict"])
    except (TypeError, KeyError, RuntimeError) as err:
        raise SaeflowError(f"{fpath}: damaged SAE checkpoint ({err})") from None
    return sae.eval()
