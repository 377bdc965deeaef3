"""The learning rate of a run: its peak (the schema's `lr`, or the default for its width and architecture), each
parameter's multiple of it, and its schedule over the steps. Every trainer (training.train, ranks.sharded, clt_train)
asks these."""

import math

from saeflow.training import archs


def auto_lr(d_sae: int) -> float:
    """The default peak learning rate of every architecture: 8e-4 at d_sae = 16384, scaled by 1/sqrt(d_sae).

    Adam moves every weight by about lr per step whatever its gradient's size, so what matters is lr against the
    weights' own size: a unit decoder row's (and its encoder column's) entries are about 1/sqrt(d_model), and
    scaling lr with them keeps the relative step (how fast a latent's direction turns) the same across widths at a
    fixed expansion (sparsify scales its default the same way). 4e-4 (an older fixed default) left TopK at 1% of a
    planted dictionary in 256 steps where sparsify's defaults reach 75%. ReLU, whose decoder rows start at norm 0.1,
    once got a fifth of this (to turn its short rows no faster than TopK's unit ones); that left its encoder biases
    too slow to sparsify the codes in a short run: 11% of the planted dictionary at L0 70 (true 8), against 91% at
    L0 13 with the full rate (benchmarks/bench_planted.py, d 128, 512 atoms, 1M vectors; 2x the rate gave 96%,
    0.5x 87%). Since saeflow-train-4 ReLU trains at 2.5x this (`relu.AUTO_LR_SCALE`): on MiniLM (226 steps) its L1
    at 1x left the codes dense and short of their decoder (NMSE 1.7x TopK's at its L0 at layer 2's residual; 1.24x
    at 2.5x), and on the planted grid 2.5x recovered more (docs/training.md has the tables). 3x did better still on
    MiniLM, but its weights then differed by 11-14% between CPU kernels on the default workflow's run (2.5x: 6.5%;
    1x: 4%), past the 10% `saeflow compare` allows. TopK's, JumpReLU's and Gated's decoders train at twice the
    run's rate (`archs.base.DECODER_LR_SCALE`, through `lr_scales`).
    """
    return 8e-4 * math.sqrt(16384 / d_sae)


def peak_lr(cfg, d_sae: int) -> float:
    """The run `cfg`'s peak learning rate: its `lr`, or when that is null `auto_lr(d_sae)` at its architecture's
    multiple (`Arch.auto_lr_scale`: ReLU's 2.5 since saeflow-train-4)."""
    return cfg.lr if cfg.lr is not None else auto_lr(d_sae) * archs.get(cfg.arch).auto_lr_scale(cfg)


def lr_scales(sae, cfg) -> list[float]:
    """Each parameter's multiple of the learning rate, in `sae.parameters()` order (`Arch.decoder_lr_scales` and
    `Arch.lr_scales`; 1 for most). `sae` is a whole SAE or a rank's latent shard."""
    scales = {**sae.arch.decoder_lr_scales(cfg), **sae.arch.lr_scales(cfg)}
    return [scales.get(name, 1.0) for name, _ in sae.named_parameters()]


def lr_at(step: int, n_steps: int, peak: float, warmup_frac: float) -> float:
    """Linear warm-up, then cosine decay to zero at the last step."""
    n_warm = int(warmup_frac * n_steps)
    if step < n_warm:
        return peak * (step + 1) / n_warm
    progress = (step - n_warm) / max(1, n_steps - n_warm)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))
