"""Run by bench_planted.py with SAELens and sparsify on PYTHONPATH: the peers trained on the planted stream.

    python _planted_peers.py JOB_JSON      (prints one JSON line: {"<library> <arch>": scores})

sae-lens: its `SAETrainer` (the library's training loop) with its training SAE classes at their defaults (lr 3e-4,
constant; decoder init norm 0.1; JumpReLU step and tanh (pre-activation loss 3e-6), Gated), the L1 warm-up set to
5% of the steps as saeflow's, ReLU swept over the same L1
grid. sparsify: its `Sae`, its loss (FVU, AuxK with its default weight 0) and its trainer's update (unit decoder
rows, gradient parallel to them removed, default optimizer: schedule-free SignSGD, lr 5e-3 / sqrt(d_sae / 2^14),
b_dec set to the first batch's mean), without its language-model hooks.
"""

import contextlib
import io
import json
import sys
import warnings

import torch

import planted

warnings.simplefilter("ignore")


def stream(atoms_ad, job, n_steps):
    for step in range(n_steps):
        yield planted.batch(atoms_ad, job["n_active"], job["batch_size"], job["seed"], step, *_law(job))


def heldout(atoms_ad, job):
    return planted.batch(atoms_ad, job["n_active"], job["batch_size"], job["seed"], job["n_steps"] + 2, *_law(job))


def _law(job) -> tuple[str, float]:
    """The stream's coefficient law and input noise, as bench_planted.py's (a job of an older caller: its defaults)."""
    return job.get("magnitude", "uniform"), job.get("input_noise", 0.0)


def saelens(atoms_ad, job, kind: str, l1: float = 0.0) -> dict:
    import sae_lens
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer

    torch.manual_seed(0)
    d, s, k, n_steps = atoms_ad.shape[1], atoms_ad.shape[0], job["n_active"], job["n_steps"]
    if kind == "relu":
        cfg = sae_lens.StandardTrainingSAEConfig(d_in=d, d_sae=s, l1_coefficient=l1, l1_warm_up_steps=n_steps // 20)
        sae = sae_lens.StandardTrainingSAE(cfg)
    elif kind == "topk":
        sae = sae_lens.TopKTrainingSAE(sae_lens.TopKTrainingSAEConfig(d_in=d, d_sae=s, k=k))
    elif kind == "batchtopk":
        sae = sae_lens.BatchTopKTrainingSAE(sae_lens.BatchTopKTrainingSAEConfig(d_in=d, d_sae=s, k=k))
    elif kind in ("jumprelu", "jumprelu-tanh"):  # its defaults (step: l0 1.0, bandwidth 0.05, init 0.01)
        mode = "tanh" if kind == "jumprelu-tanh" else "step"
        extra = {"pre_act_loss_coefficient": 3e-6} if mode == "tanh" else {}  # Anthropic's, as its docs name it
        cfg = sae_lens.JumpReLUTrainingSAEConfig(d_in=d, d_sae=s, jumprelu_sparsity_loss_mode=mode, **extra)
        sae = sae_lens.JumpReLUTrainingSAE(cfg)
    elif kind == "gated":
        sae = sae_lens.GatedTrainingSAE(sae_lens.GatedTrainingSAEConfig(d_in=d, d_sae=s))
    else:
        cfg = sae_lens.MatryoshkaBatchTopKTrainingSAEConfig(d_in=d, d_sae=s, k=k, matryoshka_widths=[s // 4, s])
        sae = sae_lens.MatryoshkaBatchTopKTrainingSAE(cfg)
    trainer_cfg = SAETrainerConfig(
        total_training_samples=n_steps * job["batch_size"], train_batch_size_samples=job["batch_size"], lr_end=3e-4
    )
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        sae = SAETrainer(trainer_cfg, sae, stream(atoms_ad, job, n_steps)).fit()
    sae.eval()
    with torch.no_grad():
        x_bd = heldout(atoms_ad, job)
        f_bs = sae.encode(x_bd)
        x_hat_bd = sae.decode(f_bs)
    return {**planted.score(atoms_ad, sae.W_dec.detach()), **planted.nmse_l0(x_bd, x_hat_bd, f_bs)}


def sparsify_topk(atoms_ad, job) -> dict:
    from schedulefree import ScheduleFreeWrapper
    from sparsify import Sae, SaeConfig
    from sparsify.sign_sgd import SignSGD

    torch.manual_seed(0)
    d, s = atoms_ad.shape[1], atoms_ad.shape[0]
    sae = Sae(d, SaeConfig(num_latents=s, k=job["n_active"]))
    opt = ScheduleFreeWrapper(SignSGD([dict(params=sae.parameters(), lr=5e-3 / (s / 2**14) ** 0.5)]), momentum=0.95)
    opt.train()
    for step, x_bd in enumerate(stream(atoms_ad, job, job["n_steps"])):
        if step == 0:
            sae.b_dec.data = x_bd.mean(0)
        sae.set_decoder_norm_to_unit_norm()
        out = sae(x_bd, y=x_bd)
        out.fvu.backward()
        sae.remove_gradient_parallel_to_decoder_directions()
        opt.step()
        opt.zero_grad()
    opt.eval()  # schedule-free: the averaged weights are the trained ones
    with torch.no_grad():
        x_bd = heldout(atoms_ad, job)
        out = sae(x_bd)
        f_bs = torch.zeros(x_bd.shape[0], s).scatter_(-1, out.latent_indices, out.latent_acts)
    return {**planted.score(atoms_ad, sae.W_dec.detach()), **planted.nmse_l0(x_bd, out.sae_out, f_bs)}


def sparsify_transcoder(atoms_ad, job) -> dict:
    """sparsify's transcoder as its trainer trains one (`transcode=True`, trainer.py): W_dec starts at zero (its
    SparseCoder init), the first batch sets the encoder biases to centre the pre-activations and b_dec to the
    targets' mean, decoder rows are not normalized and their parallel gradient is kept, the loss is the FVU of the
    target (AuxK off: its default weight 0), the optimizer its default (schedule-free SignSGD)."""
    from schedulefree import ScheduleFreeWrapper
    from sparsify import SparseCoder, TranscoderConfig
    from sparsify.sign_sgd import SignSGD

    torch.manual_seed(0)
    d, s = atoms_ad.shape[1], atoms_ad.shape[0]
    atoms_out_ad = planted.output_dictionary(d, s, job["seed"])
    sae = SparseCoder(d, TranscoderConfig(num_latents=s, k=job["n_active"], skip_connection=job["skip"]))
    opt = ScheduleFreeWrapper(SignSGD([dict(params=sae.parameters(), lr=5e-3 / (s / 2**14) ** 0.5)]), momentum=0.95)
    opt.train()
    for step in range(job["n_steps"]):
        x_bd, y_bd = planted.pair_batch(atoms_ad, atoms_out_ad, job["n_active"], job["batch_size"], job["seed"], step,
                                        job["noise"])  # fmt: skip
        if step == 0:
            sae.encoder.bias.data = -x_bd.mean(0) @ sae.encoder.weight.data.T
            sae.b_dec.data = y_bd.mean(0)
        out = sae(x_bd, y=y_bd)
        out.fvu.backward()
        opt.step()
        opt.zero_grad()
    opt.eval()  # schedule-free: the averaged weights are the trained ones
    with torch.no_grad():
        x_bd, y_bd = planted.pair_batch(atoms_ad, atoms_out_ad, job["n_active"], job["batch_size"], job["seed"],
                                        job["n_steps"] + 2, job["noise"])  # fmt: skip
        out = sae(x_bd, y=y_bd)
        f_bs = torch.zeros(x_bd.shape[0], s).scatter_(-1, out.latent_indices, out.latent_acts)
    return {**planted.score(atoms_out_ad, sae.W_dec.detach()), **planted.nmse_l0(y_bd, out.sae_out, f_bs)}


def main():
    job = json.loads(sys.argv[1])
    atoms_ad = planted.dictionary(job["d_model"], job["n_atoms"], job["seed"])
    only = job["only"].split(",")
    results = {}
    if job.get("transcoder"):
        results["sparsify topk transcoder"] = sparsify_transcoder(atoms_ad, job)
        print(json.dumps(results))
        return
    if "relu" in only:
        sweep = [dict(saelens(atoms_ad, job, "relu", float(c)), l1=c) for c in job["l1"].split(",")]
        results["sae-lens relu"] = max(sweep, key=lambda r: (r["recovered"], r["mean_max_cos"]))
    for kind in ("topk", "batchtopk", "matryoshka-batchtopk", "jumprelu", "jumprelu-tanh", "gated"):
        if kind in only:
            results[f"sae-lens {kind}"] = saelens(atoms_ad, job, kind)
    if "topk" in only:
        results["sparsify topk"] = sparsify_topk(atoms_ad, job)
    for name, r in results.items():
        print(f"  {name}: {r}", file=sys.stderr, flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
