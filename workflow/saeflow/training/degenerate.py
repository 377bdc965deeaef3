"""When a result is degenerate: the one judgement of training's end (its log) and of the summary (`warning`).

Read from the metrics saeflow.training.metrics computes (validation at the end of training, inference for the
summary): a latent is dead when it never fires on the vectors measured, dense when it fires on more than
`dense_freq` of them. A result is degenerate when every latent is dead, every latent is dense, or, where the
architecture learns its L0 (not one whose `k` sets it: `Arch.uses_k`), L0 is above MAX_L0_FRACTION of d_sae (no sparse
code). Without torch: the summary module is imported when Snakemake parses.
"""

from saeflow.training import archs

# An L0 above this fraction of d_sae is not a sparse code (docs/training.md).
MAX_L0_FRACTION = 0.1


def reason(result: dict, d_sae: int, arch: str | None = None) -> str:
    """Why a metrics result (`n_vectors`, `l0`, `n_dead`, `n_dense`, `dense_freq`) of an SAE with `d_sae` latents of
    architecture `arch` is degenerate, in words; "" when it is not. A TopK-style SAE's L0 is its `k`, the user's
    choice, never a learned failure (an unknown or missing `arch` is judged by L0 too)."""
    learns_l0 = arch not in archs.REGISTRY or not archs.get(arch).uses_k
    problems = []
    if result["n_dead"] >= d_sae:
        problems.append(f"every latent is dead (none of the {d_sae} fired on {result['n_vectors']} vectors)")
    if result["n_dense"] >= d_sae:
        problems.append(f"every latent is dense (all {d_sae} fire on more than {result['dense_freq']:g} of vectors)")
    if learns_l0 and result["l0"] > MAX_L0_FRACTION * d_sae:
        problems.append(f"L0 {result['l0']:.1f} is above {MAX_L0_FRACTION:g} of d_sae {d_sae}: not a sparse code")
    return "; ".join(problems)
