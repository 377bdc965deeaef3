"""Pre-activations read at a k-sparse selection's picks, with the encoder's gradient computed from the picks only.

A TopK SAE's loss reads its (b, s) pre-activations at k latents per vector (and AuxK's picks), so the gradient
reaching them is zero but at those b x n places. Autograd does not know that: it scatters the picks' gradient into a
dense (b, s) tensor and multiplies it by the inputs, a second dense (d, b) x (b, s) matmul as large as the forward.
`PreActs(model, xn_bd, picked=True)` computes the pre-activations once without autograd and `gather` returns the
picked ones through `_PickedPreActs`, whose backward builds the picks' gradient as a CSR matrix (b, s) and computes

    dW_enc = (x_n - b_dec)^T G      (d, s), a dense x sparse product: O(b n d), not O(b s d)
    db_enc = sum_b G                 (s,)
    db_dec = -W_enc db_enc           (d,)  (an SAE's; a transcoder's input is not centred by b_dec)

the gradients of `SAE.pre_acts_normed`'s parameters, equal up to rounding to autograd's (sparsify's
`fused_encoder` does the same with `index_add_`). BatchTopK keeps a varying number per vector: `gather_entries` reads
the places a (b, s) mask keeps as CSR rows (`_PickedEntries`), with the same backward. The forward values are the
dense ones, bit for bit. Where the picks are too many a share of the latents for that to pay (`sparse_picks`, the
crossover measured by benchmarks/bench_sparse_grad.py: docs/training.md) the same backward scatters them densely
instead; either way, per shape, is one fixed maths.

Shapes: b batch, d d_model, s latents (of this model: a latent shard's own), n picks per vector.
"""

import contextlib
import warnings

import torch

# On CPU the sparse backward wins where a vector's picks are a small share of the latents: in bench_sparse_grad.py's
# grid (docs/training.md) it is faster at 1/48 of them and below, level or slower at 1/32 and above. No GPU has been
# measured: there the dense backward (one cuBLAS matmul) stays.
MAX_PICKED_SHARE = 1 / 48


def sparse_picks(n_picks: int, n_latents: int, device: torch.device) -> bool:
    """Whether a k-sparse selection's encoder gradient is computed from its picks (`_PickedPreActs`): on CPU, when a
    vector's `n_picks` (k, plus AuxK's) are at most `MAX_PICKED_SHARE` of the `n_latents`."""
    return torch.device(device).type == "cpu" and n_picks <= MAX_PICKED_SHARE * n_latents


class _PickedPreActs(torch.autograd.Function):
    """pre_bs.gather(1, ids_bn), whose backward sends the gradient to the encoder's parameters (module docstring)."""

    @staticmethod
    def forward(ctx, pre_bs, ids_bn, xn_bd, W_enc, b_enc, b_dec):
        ctx.save_for_backward(ids_bn, xn_bd, W_enc, b_dec)
        ctx.centred = b_dec is not None
        ctx.n_latents = pre_bs.shape[1]
        return pre_bs.gather(1, ids_bn)

    @staticmethod
    def backward(ctx, g_bn):
        ids_bn, xn_bd, W_enc, b_dec = ctx.saved_tensors
        b, n = ids_bn.shape
        g_flat = g_bn.contiguous().flatten()
        crow_b1 = torch.arange(0, b * n + 1, n, device=ids_bn.device)
        return (None, None, *_encoder_grads(ctx, xn_bd, W_enc, b_dec, crow_b1, ids_bn.flatten(), g_flat,
                                            lambda: g_flat.new_zeros(b, ctx.n_latents).scatter_add_(1, ids_bn, g_bn)))


class _PickedEntries(torch.autograd.Function):
    """pre_bs[rows_n, cols_n] for entries grouped by row (`crow_b1`: their CSR row offsets), a varying number per vector
    (BatchTopK's), whose backward sends the gradient to the encoder's parameters as `_PickedPreActs`' does."""

    @staticmethod
    def forward(ctx, pre_bs, crow_b1, rows_n, cols_n, xn_bd, W_enc, b_enc, b_dec):
        ctx.save_for_backward(crow_b1, rows_n, cols_n, xn_bd, W_enc, b_dec)
        ctx.centred = b_dec is not None
        ctx.n_latents = pre_bs.shape[1]
        return pre_bs[rows_n, cols_n]

    @staticmethod
    def backward(ctx, g_n):
        crow_b1, rows_n, cols_n, xn_bd, W_enc, b_dec = ctx.saved_tensors
        g_n = g_n.contiguous()
        shape = (crow_b1.numel() - 1, ctx.n_latents)
        dense = lambda: g_n.new_zeros(shape).index_put_((rows_n, cols_n), g_n, accumulate=True)  # noqa: E731
        return (None, None, None, None, *_encoder_grads(ctx, xn_bd, W_enc, b_dec, crow_b1, cols_n, g_n, dense))


def _encoder_grads(ctx, xn_bd, W_enc, b_dec, crow_b1, cols_n, g_n, dense_bs) -> tuple:
    """(None for xn_bd, dW_enc, db_enc, db_dec) from the picks' gradient `g_n` at the CSR entries (`crow_b1`,
    `cols_n`): a dense x sparse product where the picks are few enough (`sparse_picks`), else `dense_bs()`'s."""
    b = crow_b1.numel() - 1
    xc_bd = xn_bd - b_dec if ctx.centred else xn_bd
    if sparse_picks(cols_n.numel() / max(b, 1), ctx.n_latents, g_n.device):
        dW_ds = xc_bd.t() @ _csr(crow_b1, cols_n, g_n, ctx.n_latents)
    else:
        dW_ds = xc_bd.t() @ dense_bs()
    db_enc = g_n.new_zeros(ctx.n_latents).index_add_(0, cols_n, g_n)
    db_dec = -(W_enc @ db_enc) if ctx.centred and ctx.needs_input_grad[-1] else None
    return None, dW_ds, db_enc, db_dec


def _csr(crow_b1: torch.Tensor, cols_n: torch.Tensor, g_n: torch.Tensor, n_latents: int) -> torch.Tensor:
    """(b, s) sparse CSR: row i holds g at latents cols_n[crow_b1[i]:crow_b1[i + 1]] (a repeated id adds up)."""
    with warnings.catch_warnings():  # torch's note that its CSR tensors are beta, once per process
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(crow_b1, cols_n, g_n, (crow_b1.numel() - 1, n_latents), check_invariants=False)


class PreActs:
    """A batch's pre-activations (b, s) of `model` (an SAE or a latent shard) and how its selection reads them.

    picked=False: `pre_bs` carries autograd and `gather` is a plain gather (every selection's, and a TopK run's made
    by an earlier trainer). picked=True (a k-sparse selection): `pre_bs` has no gradient (it chooses the picks, and
    AuxK's) and only `gather` passes one, to the encoder's parameters, through `_PickedPreActs`.
    """

    def __init__(self, model, xn_bd: torch.Tensor, picked: bool = False):
        self.model, self.xn_bd, self.picked = model, xn_bd, picked
        with torch.no_grad() if picked else contextlib.nullcontext():
            self.pre_bs = model.pre_acts_normed(xn_bd)

    def gather(self, ids_bn: torch.Tensor) -> torch.Tensor:
        """(b, n) the pre-activations at latents `ids_bn` (ids on this model)."""
        if not self.picked:
            return self.pre_bs.gather(1, ids_bn)
        return _PickedPreActs.apply(self.pre_bs, ids_bn, *self._encoder_inputs())

    def gather_entries(self, keep_bs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pre-activations at the places `keep_bs` (b, s) bool marks, a varying number per vector, in CSR form:
        (values (n,), their latent ids (n,), each vector's first entry (b,)), row by row."""
        rows_n, cols_n = keep_bs.nonzero().unbind(1)  # row-major: grouped by row
        crow_b1 = torch.zeros(keep_bs.shape[0] + 1, dtype=torch.int64, device=keep_bs.device)
        torch.cumsum(keep_bs.sum(1), 0, out=crow_b1[1:])
        if not self.picked:
            vals_n = self.pre_bs[rows_n, cols_n]
        else:
            vals_n = _PickedEntries.apply(self.pre_bs, crow_b1, rows_n, cols_n, *self._encoder_inputs())
        return vals_n, cols_n, crow_b1[:-1]

    def _encoder_inputs(self) -> tuple:
        """What the picked functions differentiate: the inputs (no gradient), W_enc, b_enc and an SAE's b_dec (None
        for a transcoder, whose input is not centred)."""
        m = self.model
        return self.xn_bd.detach(), m.W_enc, m.b_enc, None if m.cfg.transcoder else m.b_dec
