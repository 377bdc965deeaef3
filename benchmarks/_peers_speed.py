"""Run by bench_peers.py, one side per process (SAELens and sparsify on PYTHONPATH for theirs):

    python _peers_speed.py JOB_JSON      (prints one JSON line: {"vectors": n, "cpu_s": s, "computes": "..."})

Every side reads the same shard directory in order (saeflow's ordered loader, a plain pread of its files) and times
its own loop with `time.process_time` (every thread of this process), after its imports and set-up.

- bare-train: the TopK step written in bare torch with the algebra sparsify uses: encoder matmul, top k, decode of
  the k picks (embedding_bag), squared error, the encoder's gradient from the picks only (a CSR product), Adam.
- sparsify-train: sparsify 1.3.3's `SparseCoder` step as its Trainer runs it (unit decoder rows, FVU, its fused
  encoder and decoder, parallel gradient removed, torch Adam at its default rate, b_dec from the first batch).
- saelens-train: SAELens 6.54.12's `TopKTrainingSAE` (`BatchTopKTrainingSAE` for a job's "arch" batchtopk) through
  its `SAETrainer` (its defaults, AuxK included).
- bare-inference: encode, top k, the codes' CSR entries, decode of the picks, the metrics (NMSE, L0, dead latents),
  CSR and metrics saved.
- saeflow-inference: `saeflow.analysis.inference.run_inference` of the run (a fresh dump).
"""

import json
import pathlib
import sys
import tempfile
import time
import warnings

import numpy as np
import torch

from saeflow.store.shards import ShardDir
from saeflow.training.loaders import pairs

warnings.simplefilter("ignore")


def batches(job):
    loader = pairs.ordered_loader(ShardDir(job["shards"]), None, 0, job["batch_size"], "content")
    for batch in loader:
        yield pairs.split(batch)[0]


class _PickedGrad(torch.autograd.Function):
    """(b, n) pre-activations at the picks; backward: dW = (x - b_dec)^T G as a CSR product, db_enc, db_dec."""

    @staticmethod
    def forward(ctx, pre_bs, idx_bk, xc_bd, W_enc, b_enc, b_dec):
        ctx.save_for_backward(idx_bk, xc_bd, W_enc)
        ctx.s = pre_bs.shape[1]
        return pre_bs.gather(1, idx_bk)

    @staticmethod
    def backward(ctx, g_bk):
        idx_bk, xc_bd, W_enc = ctx.saved_tensors
        b, k = idx_bk.shape
        g = g_bk.contiguous().flatten()
        G = torch.sparse_csr_tensor(torch.arange(0, b * k + 1, k), idx_bk.flatten(), g, (b, ctx.s))
        db_enc = g.new_zeros(ctx.s).index_add_(0, idx_bk.flatten(), g)
        return None, None, None, xc_bd.t() @ G, db_enc, -(W_enc @ db_enc)


def bare_train(job):
    d, s, k = job["d_model"], job["d_sae"], job["k"]
    gen = torch.Generator().manual_seed(0)
    W_dec = torch.nn.Parameter(torch.randn(s, d, generator=gen) / d**0.5)
    W_enc = torch.nn.Parameter(W_dec.detach().T.clone())
    b_enc, b_dec = torch.nn.Parameter(torch.zeros(s)), torch.nn.Parameter(torch.zeros(d))
    opt = torch.optim.Adam([W_enc, b_enc, W_dec, b_dec], lr=1e-3)
    n, t0 = 0, time.process_time()
    for x_bd in batches(job):
        xc_bd = x_bd - b_dec.detach()
        with torch.no_grad():
            pre_bs = xc_bd @ W_enc + b_enc
            idx_bk = pre_bs.topk(k, dim=-1, sorted=False).indices
        vals_bk = torch.relu(_PickedGrad.apply(pre_bs, idx_bk, xc_bd, W_enc, b_enc, b_dec))
        x_hat_bd = torch.nn.functional.embedding_bag(idx_bk, W_dec, per_sample_weights=vals_bk, mode="sum") + b_dec
        loss = (x_hat_bd - x_bd).square().sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        n += x_bd.shape[0]
    return n, time.process_time() - t0, "TopK, AuxK off, Adam"


def sparsify_train(job):
    from sparsify import SparseCoder, SparseCoderConfig

    torch.manual_seed(0)
    s = job["d_sae"]
    sae = SparseCoder(job["d_model"], SparseCoderConfig(num_latents=s, k=job["k"]), device="cpu")
    opt = torch.optim.Adam(sae.parameters(), lr=2e-4 / (s / 2**14) ** 0.5)
    n, t0 = 0, time.process_time()
    for x_bd in batches(job):
        if n == 0:
            sae.b_dec.data = x_bd.mean(0)
        sae.set_decoder_norm_to_unit_norm()
        out = sae(x_bd)
        out.fvu.backward()
        sae.remove_gradient_parallel_to_decoder_directions()
        opt.step()
        opt.zero_grad()
        n += x_bd.shape[0]
    return n, time.process_time() - t0, "TopK, AuxK off (its default auxk_alpha 0), Adam"


def saelens_train(job):
    import contextlib
    import io

    import sae_lens
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer

    torch.manual_seed(0)
    data = list(batches(job))  # its trainer pulls batches from an iterator; read before the clock starts
    n = sum(x.shape[0] for x in data)
    if job.get("arch", "topk") == "batchtopk":
        sae = sae_lens.BatchTopKTrainingSAE(sae_lens.BatchTopKTrainingSAEConfig(d_in=job["d_model"], d_sae=job["d_sae"],
                                                                                k=job["k"]))  # fmt: skip
    else:
        sae = sae_lens.TopKTrainingSAE(sae_lens.TopKTrainingSAEConfig(d_in=job["d_model"], d_sae=job["d_sae"],
                                                                      k=job["k"]))  # fmt: skip
    cfg = SAETrainerConfig(total_training_samples=n, train_batch_size_samples=job["batch_size"], lr_end=3e-4)
    t0 = time.process_time()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        SAETrainer(cfg, sae, iter(data)).fit()
    return n, time.process_time() - t0, f"{type(sae).__name__[:-11]}, AuxK on (its default), Adam"


def bare_inference(job):
    from saeflow.training.sae import load_sae

    sae = load_sae(pathlib.Path(job["run"]) / "checkpoint" / "sae.pt").eval()
    W_enc, W_dec, b_enc, b_dec, scale = sae.W_enc, sae.W_dec, sae.b_enc, sae.b_dec, sae.scale
    k = job["k"]
    n, sq_err, sum_sq, n_active = 0, 0.0, 0.0, 0
    sum_d, fires_s = torch.zeros(sae.d_model, dtype=torch.float64), torch.zeros(sae.d_sae, dtype=torch.int64)
    rows, cols, vals = [], [], []
    t0 = time.process_time()
    with torch.no_grad():
        for x_bd in pairs.ordered_loader(ShardDir(job["shards"]), None, 0, job["batch_size"], "all", borrowed=True):
            x_bd = pairs.split(x_bd)[0]
            xn_bd = x_bd * scale
            v_bk, i_bk = (xn_bd @ W_enc + (b_enc - b_dec @ W_enc)).topk(k, dim=-1, sorted=False)
            v_bk = torch.relu(v_bk)
            i_bk, order = i_bk.sort(dim=1)
            v_bk = v_bk.gather(1, order)
            on = v_bk > 0
            rows.append((torch.arange(len(x_bd))[:, None].expand_as(i_bk)[on] + n).numpy())
            cols.append(i_bk[on].numpy().astype(np.int32))
            vals.append(v_bk[on].numpy())
            x_hat = torch.nn.functional.embedding_bag(i_bk, W_dec, per_sample_weights=v_bk, mode="sum") + b_dec
            x_hat = x_hat / scale
            x64 = x_bd.double()
            sq_err += float((x64 - x_hat.double()).square().sum())
            sum_d += x64.sum(0)
            sum_sq += float(x64.square().sum())
            n_active += int(on.sum())
            fires_s += torch.bincount(i_bk[on], minlength=len(fires_s))
            n += len(x_bd)
        nmse = sq_err / (sum_sq - float(sum_d.square().sum()) / n)
        metrics = {"nmse": nmse, "l0": n_active / n, "n_dead": int((fires_s == 0).sum())}
        with tempfile.TemporaryDirectory() as tmp:
            np.savez(pathlib.Path(tmp) / "csr.npz", rows=np.concatenate(rows), cols=np.concatenate(cols),
                     vals=np.concatenate(vals))  # fmt: skip
            (pathlib.Path(tmp) / "metrics.json").write_text(json.dumps(metrics))
    return n, time.process_time() - t0, "encode, top k, CSR, decode, NMSE, L0, dead latents; saved"


def saeflow_inference(job):
    from saeflow.analysis import inference

    t0 = time.process_time()
    cfg = inference.InferenceConfig(run=pathlib.Path(job["run"]), shards=pathlib.Path(job["shards"]), device="cpu")
    dump = inference.run_inference(cfg)
    n = json.loads((dump / "metrics.json").read_text())["all_tokens"]["n_vectors"]
    return n, time.process_time() - t0, "saeflow inference: CSR, latents.npz (statistics, top-k examples), metrics"


SIDES = {"bare-train": bare_train, "sparsify-train": sparsify_train, "saelens-train": saelens_train,
         "bare-inference": bare_inference, "saeflow-inference": saeflow_inference}  # fmt: skip


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    torch.set_num_threads(job["threads"])
    n, cpu_s, computes = SIDES[job["side"]](job)
    print(json.dumps({"vectors": n, "cpu_s": cpu_s, "computes": computes}))
