"""The SAE family (every architecture of training/archs, each optionally Matryoshka) and its self-describing `sae.pt`.

All SAEs share one parameterization in *normalized* space, where inputs are scaled by `scale` so that their mean
squared norm is d_model (so hyper-parameters transfer across models and layers):

    x_n   = x_bd * scale
    pre   = (x_n - b_dec) @ W_enc + b_enc                    (b, s)
    f_bs  = activation(pre)                                   non-negative codes
    x_hat = (f_bs @ W_dec + b_dec) / scale                    back in RAW activation space

`encode`/`decode`/`forward` take and return RAW activations; the `*_normed` methods are what training uses.
`sae.pt` holds the architecture, the weights and the normalization, so `load_sae` needs nothing else.

A transcoder (`SAEConfig.d_out`: Dunefsky et al. 2024) predicts a target y (d_out wide, e.g. an MLP's output) from its
input x (d_model wide, e.g. the MLP's input). Input and target are normalized separately (`scale`, `target_scale`:
each to mean squared norm = its width), so hyper-parameters transfer as they do for SAEs; the input is not centred
by b_dec (which lives in the target's space), and a skip transcoder (`SAEConfig.skip`, Paulo et al. 2025) adds a
learned linear path:

    pre   = x_n @ W_enc + b_enc                                   (b, s)
    y_hat = (f_bs @ W_dec + b_dec + x_n @ W_skip) / target_scale  back in RAW target space

`decode` is the latents' part (no skip path, which needs x); `forward` is the whole prediction.
"""

import dataclasses
import errno
import math
import os
import pathlib
import shutil
import warnings

import numpy as np
import torch

from saeflow.errors import SaeflowError, unreadable
from saeflow.store import atomic
from saeflow.training import archs
from saeflow.training.specs import SAEConfig

FORMAT = "saeflow-sae"
FORMAT_VERSION = 1  # what an SAE's sae.pt says (unchanged since the first release: every earlier file loads)
TRANSCODER_VERSION = 2  # a transcoder's (its config has d_out and skip, which a version-1 reader would refuse)
READ_VERSIONS = (FORMAT_VERSION, TRANSCODER_VERSION)


def sae_from_weights(
    cls: type,
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
    transcoder: bool = False,
    target_scale: float = 1.0,
    W_skip_dd: torch.Tensor | None = None,
) -> "SAE":
    """`SAE.from_weights`: an SAE (class `cls`) with given weights (normalized space), e.g. for tests with known
    codes; `extra`: the architecture's own parameters (`Arch.parameters`, e.g. JumpReLU's log_threshold). A
    `transcoder` outputs W_dec's width, normalized by `target_scale`, with a skip path when `W_skip_dd` is given."""
    d_model, d_sae = W_enc_ds.shape
    d_out = W_dec_sd.shape[1] if transcoder else None
    sae = cls(SAEConfig(d_model=d_model, d_sae=d_sae, arch=arch, k=k, matryoshka=matryoshka, d_out=d_out,
                        skip=W_skip_dd is not None))  # fmt: skip
    if transcoder:
        extra = {**(extra or {}), "target_scale": torch.tensor(float(target_scale))}
        if W_skip_dd is not None:
            extra["W_skip"] = W_skip_dd
    elif W_skip_dd is not None:
        raise SaeflowError("W_skip: the linear skip path is a transcoder's")
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


class SAE(torch.nn.Module):
    """A sparse autoencoder; see the module docstring for the maths."""

    def __init__(self, cfg: SAEConfig):
        super().__init__()
        self.cfg = cfg
        self.d_model, self.d_sae, self.d_out = cfg.d_model, cfg.d_sae, cfg.d_target
        self.W_enc = torch.nn.Parameter(torch.zeros(cfg.d_model, cfg.d_sae))
        self.b_enc = torch.nn.Parameter(torch.zeros(cfg.d_sae))
        self.W_dec = torch.nn.Parameter(torch.zeros(cfg.d_sae, self.d_out))
        self.b_dec = torch.nn.Parameter(torch.zeros(self.d_out))
        # Raw -> normalized multiplier; an inference threshold (Arch.has_threshold), in normalized pre-activation units.
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("threshold", torch.zeros(()))
        for name, zeros in self.arch.parameters(cfg.d_sae).items():  # e.g. JumpReLU's thresholds (training/archs)
            self.register_parameter(name, torch.nn.Parameter(zeros))
        if cfg.transcoder:  # after everything an SAE has, so an SAE's state and Adam's parameter order are unchanged
            self.register_buffer("target_scale", torch.ones(()))  # raw target -> normalized
        if cfg.skip:
            self.W_skip = torch.nn.Parameter(torch.zeros(cfg.d_model, self.d_out))

    @property
    def out_scale(self) -> torch.Tensor:
        """Raw -> normalized multiplier of what the SAE outputs: its input's (an SAE) or its target's."""
        return self.target_scale if self.cfg.transcoder else self.scale

    from_weights = classmethod(sae_from_weights)

    # -- normalized space (training) ------------------------------------------------------------------------

    def pre_acts_normed(self, xn_bd: torch.Tensor) -> torch.Tensor:
        """(x_n - b_dec) @ W_enc + b_enc, written so b_dec's gradient costs a vector product, not a third matmul; a
        transcoder's b_dec is in its target's space, so its input is not centred by it: x_n @ W_enc + b_enc. The bias
        is added in place (the matmul's output is no input of its backward): the values and gradients of
        `xn_bd @ W_enc + bias`, without a second (b, s) tensor, whose fresh pages cost a tenth of a large step."""
        bias_s = self.b_enc if self.cfg.transcoder else self.b_enc - self.b_dec @ self.W_enc
        return (xn_bd @ self.W_enc).add_(bias_s)

    def skip_normed(self, xn_bd: torch.Tensor) -> torch.Tensor | None:
        """A skip transcoder's linear path x_n @ W_skip (normalized target space); None without one."""
        return xn_bd @ self.W_skip if self.cfg.skip else None

    def latent_axes(self) -> dict:
        """Each parameter, in this SAE's order, -> its latent axis (`Arch.latent_axes`), a skip transcoder's W_skip
        (held whole, after the architecture's own) included: what a latent shard and a resume checkpoint cut."""
        return {**self.arch.latent_axes(), **({"W_skip": None} if self.cfg.skip else {})}

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

    def decode_sparse_normed(self, vals_bk, idx_bk, n_latents: int | None = None, offsets_b=None) -> torch.Tensor:
        """`decode_normed` from k (value, latent index) pairs per vector (b, k), or from CSR entries (n,) whose
        vector i starts at `offsets_b[i]`: O(b k d) instead of a dense O(b s d)."""
        if n_latents is not None:
            vals_bk = vals_bk * (idx_bk < n_latents)
        return torch.nn.functional.embedding_bag(idx_bk, self.W_dec, offsets_b, per_sample_weights=vals_bk,
                                                 mode="sum") + self.b_dec  # fmt: skip

    # -- raw space (the public API) -------------------------------------------------------------------------

    def encode(self, x_bd: torch.Tensor) -> torch.Tensor:
        """RAW activations (b, d_model) -> non-negative codes (b, d_sae) (the architecture's `encode`)."""
        return self.arch.encode(self, x_bd * self.scale)

    def decode(self, f_bs: torch.Tensor) -> torch.Tensor:
        """Codes (b, d_sae) -> reconstruction (b, d_out) in RAW activation space (a skip transcoder's latents' part)."""
        return self.decode_normed(f_bs) / self.out_scale

    def forward(self, x_bd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(reconstruction or a transcoder's prediction, skip path included; codes), in RAW space."""
        xn_bd = x_bd * self.scale
        f_bs = self.arch.encode(self, xn_bd)
        yn_hat_bd = self.decode_normed(f_bs)
        skip_bd = self.skip_normed(xn_bd)
        if skip_bd is not None:
            yn_hat_bd = yn_hat_bd + skip_bd
        return yn_hat_bd / self.out_scale, f_bs

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


RANDN_CHUNK_ELEMS = 1 << 20  # the decoder's random init is drawn in chunks this large (multiples of 16 values)


@torch.no_grad()
def forward_picks(sae: SAE, x_bd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`SAE.forward` of codes that are k-sparse (`Arch.k_sparse`): (the prediction, raw space; vals_bk, idx_bk: the
    codes forward would scatter), decoded from the k picks (O(b k d), not a dense O(b s d))."""
    xn_bd = x_bd * sae.scale
    vals_bk, idx_bk = sae.arch.picks(sae, sae.pre_acts_normed(xn_bd))
    yn_hat_bd = sae.decode_sparse_normed(vals_bk, idx_bk)
    skip_bd = sae.skip_normed(xn_bd)
    if skip_bd is not None:
        yn_hat_bd = yn_hat_bd + skip_bd
    return yn_hat_bd / sae.out_scale, vals_bk, idx_bk


@torch.no_grad()
def init_from_data(sae: SAE, x_nd: torch.Tensor, y_nd: torch.Tensor | None, cfg, root, lo: int = 0) -> None:
    """The start of every run, the one definition every trainer uses: `sae` is a whole SAE (one process, each
    data-parallel replica) or the latents [lo, lo + sae.d_sae) of one (training.ranks.sharded), which gets its rows of
    the same draws. Scales and b_dec from the sample `x_nd` (`init_normalization`; a transcoder, `y_nd` its targets: the
    targets' scale and mean), random decoder rows (seed `cfg.seed`) at the architecture's initial norm, the encoder
    their transpose (a transcoder's: `init_transcoder`, whose draw follows the decoder's, made and dropped), then the
    architecture's own parameters (`Arch.init_parameters`, from the run's config `cfg`).

    TopK/BatchTopK decoder rows are unit vectors and stay so (the top-k choice keeps codes honest). ReLU rows
    start at norm 0.1 and their norms train freely (the L1 term weighs each code by its row's norm, so
    rescaling games nothing), as in Anthropic's April 2024 update and sae-lens: with unit rows, pre-activations
    start at the data's own scale (about 1 in normalized space) and Adam, which moves each weight by about lr
    per step, cannot bring the encoder biases down far enough to sparsify in a short run; the codes stay dense
    and the decoder rows never leave their random init (0 of 1,024 planted atoms recovered).
    The norms are folded back into the encoder when the SAE is published (`SAE.fold_decoder_norms`).
    """
    device = sae.W_dec.device
    x_nd = x_nd.to(device, torch.float32)
    init_normalization(sae, x_nd, None if y_nd is None else y_nd.to(device, torch.float32), root)
    gen = torch.Generator().manual_seed(cfg.seed)
    n_rows, hi = sae.cfg.d_sae, lo + sae.d_sae
    if y_nd is None:
        sae.W_dec.copy_(randn_rows(gen, n_rows, sae.d_out, lo, hi))
        sae.normalize_decoder()
        init_norm = sae.arch.decoder_init_norm_for(cfg)
        if init_norm != 1.0:
            sae.W_dec.mul_(init_norm)
        sae.W_enc.copy_(sae.W_dec.T)
        sae.b_enc.zero_()
    else:
        randn_rows(gen, n_rows, sae.d_out, n_rows, n_rows)  # the decoder's draw: a transcoder's starts at zero
        init_transcoder(sae, x_nd * sae.scale, randn_rows(gen, n_rows, sae.d_model, lo, hi), cfg)
    sae.arch.init_parameters(sae, cfg)  # its own parameters (e.g. JumpReLU's thresholds), on these latents


def randn_rows(seed: int | torch.Generator, n_rows: int, d: int, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of `torch.randn(n_rows, d, generator=torch.Generator().manual_seed(seed))`, drawn in chunks (from
    `seed` itself when it is a generator: with lo = hi = n_rows, the whole draw is made and nothing kept, which leaves
    the generator where one call would).

    torch's CPU normal sampler turns each 16 uniforms into 16 normals (and redraws the last 16 of a tensor whose
    size is no multiple of 16), so chunks of whole 16-value groups, the tail kept with the last one, give the same
    values as one call; only rows before `hi` are drawn and only [lo, hi) kept.
    """
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    group = 16 // math.gcd(d, 16)  # rows per whole number of 16-value groups
    step = max(group, RANDN_CHUNK_ELEMS // d // group * group)
    starts = list(range(0, n_rows, step))
    if len(starts) > 1 and (n_rows - starts[-1]) * d < 16:
        starts.pop()  # a tail of fewer than 16 values is drawn with the chunk before it, as one call draws it
    out, ends = [], [*starts[1:], n_rows]
    for start, end in zip(starts, ends):
        if start >= hi:
            break
        chunk = torch.randn(end - start, d, generator=gen)
        if end > lo:
            out.append(chunk[max(lo - start, 0) : min(hi, end) - start])
    return torch.cat(out) if out else torch.zeros(0, d)


@torch.no_grad()
def init_normalization(sae: SAE, x_nd: torch.Tensor, y_nd: torch.Tensor | None, root) -> None:
    """The data-based start of the normalization: `scale` (and a transcoder's `target_scale`, `y_nd` its targets)
    to mean squared norm = width, b_dec = the mean of what the SAE outputs (normalized)."""
    sae.scale.fill_(norm_scale(x_nd, sae.d_model, root))
    if y_nd is None:
        sae.b_dec.copy_((x_nd * sae.scale).mean(0))
        return
    sae.target_scale.fill_(norm_scale(y_nd, sae.d_out, root))
    sae.b_dec.copy_((y_nd * sae.target_scale).mean(0))


def norm_scale(x_nd: torch.Tensor, width: int, root) -> float:
    """The multiplier that brings vectors of `width` to mean squared norm `width` (SAE.scale, SAE.target_scale)."""
    mean_sq = x_nd.square().sum(-1).mean()
    if not torch.isfinite(mean_sq) or mean_sq <= 0:
        raise SaeflowError(f"{root}: training vectors are all zero or not finite; cannot normalize")
    return math.sqrt(width / float(mean_sq))


@torch.no_grad()
def init_transcoder(sae: SAE, xn_nd: torch.Tensor, W_ds: torch.Tensor, cfg) -> None:
    """A transcoder at the start (`xn_nd`: the normalized input sample; `W_ds`: the random draw of its encoder
    columns, a row per latent: a latent shard's rows of one process's draw), as sparsify starts one: random unit encoder
    columns in its input's space (of the architecture's initial decoder row norm), biases that centre the
    pre-activations on the sample (its input is not centred by b_dec, which lives in the target's space), decoder
    rows and the skip path at zero. The decoder rows then train freely (`Arch.unit_rows`): each first learns what its
    latent predicts, then the encoder learns through it (benchmarks/bench_planted.py --transcoder: 93.6% of the planted
    output atoms, against 80.2% with unit rows started at random and 85.0% started at what their encoder column
    predicts linearly, at twice the learning rate)."""
    W_ds = W_ds.to(sae.W_enc.device)
    W_ds = W_ds / W_ds.norm(dim=-1, keepdim=True).clamp_min(1e-8) * sae.arch.decoder_init_norm_for(cfg)
    sae.W_enc.copy_(W_ds.T)
    sae.b_enc.copy_(-(xn_nd.mean(0) @ sae.W_enc))
    sae.W_dec.zero_()
    if sae.cfg.skip:
        sae.W_skip.zero_()


# ---------------------------------------------------------------------------------------------------------------
# sae.pt
# ---------------------------------------------------------------------------------------------------------------


def save_sae(sae: SAE, fpath: str | os.PathLike, readonly: bool = False) -> None:
    """Write `sae.pt` atomically (read-only when `readonly`): weights + architecture + normalization."""
    config = dataclasses.asdict(sae.cfg)
    if not sae.cfg.transcoder:  # an SAE's file as saeflow always wrote it, readable by every earlier saeflow
        config = {key: value for key, value in config.items() if key not in ("d_out", "skip")}
    obj = {
        "format": FORMAT,
        "version": TRANSCODER_VERSION if sae.cfg.transcoder else FORMAT_VERSION,
        "config": config,
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


def read_checkpoint(fpath: pathlib.Path, what: str):
    """`torch.load` of a checkpoint (`what` it is, for errors) on CPU, only tensors and plain data unpickled; a
    missing, unreadable or damaged file is one line."""
    try:
        with warnings.catch_warnings():  # torch warns about odd pickle protocols before failing on a damaged file
            warnings.simplefilter("ignore")
            return torch.load(fpath, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise SaeflowError(f"{fpath}: no such {what}") from None
    except OSError as err:
        raise unreadable(fpath, err) from None
    except Exception as err:  # torch raises many types (and long messages) for a damaged file
        raise SaeflowError(
            f"{fpath}: not a readable {what} (damaged, or not written by torch.save: {type(err).__name__})"
        ) from None


def load_sae(fpath: str | os.PathLike) -> SAE:
    """Load `sae.pt` into an SAE in eval mode on CPU. Only tensors and plain data are unpickled."""
    fpath = pathlib.Path(fpath)
    obj = read_checkpoint(fpath, "SAE checkpoint")
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise SaeflowError(f"{fpath}: not a saeflow SAE checkpoint (no format={FORMAT!r} marker)")
    if obj.get("version") not in READ_VERSIONS:
        raise SaeflowError(f"{fpath}: checkpoint version {obj.get('version')}, this saeflow reads {READ_VERSIONS}")
    try:
        sae = SAE(SAEConfig(**obj["config"]))
        sae.load_state_dict(obj["state_dict"])
    except (TypeError, KeyError, RuntimeError) as err:
        raise SaeflowError(f"{fpath}: damaged SAE checkpoint ({err})") from None
    return sae.eval()


def sae_tensors(fpath: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of `sae.pt` as float32 arrays, by name: what `saeflow compare` holds two runs' SAEs to."""
    return {name: t.detach().float().numpy() for name, t in load_sae(fpath).state_dict().items()}
