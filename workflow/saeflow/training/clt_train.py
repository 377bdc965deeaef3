"""Training a cross-layer transcoder (training/clt.py) in the one-process loop of training/train.py.

A CLT run reads a directory per layer of each role (links/<role>.layer<l>: `RunLayout.layer_link`): its pass's
shuffled loader reads every layer's input and target row for row into one pool (`ShuffledLoader(also=...)`), so a
batch is the same tokens at every layer, and the loop, resume checkpoints and publishing are the one-process
trainer's (`train._train_group` with `open_pass`); `CLTTrainer` is a `train.Trainer` whose model is the CLT. Only
one process trains one (training/shapes.py refuses the parallel modes).
"""

import torch

from saeflow.errors import SaeflowError
from saeflow.store import runs
from saeflow.store.shards import ShardDir
from saeflow.training import clt as clt_mod
from saeflow.training import localcopy, memory
from saeflow.training.adam import Adam
from saeflow.training.loaders import OrderedLoader, ShuffledLoader
from saeflow.training.metrics import MetricsAccumulator
from saeflow.training.objectives import STATE_KEYS, DeadLatents, dead_latents, one_process
from saeflow.training.ranks.distributed import Comm
from saeflow.training.rates import lr_scales, peak_lr
from saeflow.training.specs import TrainConfig
from saeflow.training.train import LOG_EVERY, Checkpoint, Trainer, TrainSettings

ROLES = ((runs.Run.TRAIN_SHARDS, "train_shards"), (runs.Run.TARGET_SHARDS, "target"),
         (runs.Run.VAL_SHARDS, "val_shards"), (runs.Run.VAL_TARGET_SHARDS, "val_target"))  # fmt: skip


def layer_dirs(run: runs.Run, cfg: TrainConfig, link: str, key: str) -> list[ShardDir]:
    """The directories of one role (`link`, its config key `key`), one per layer, each checked against the config."""
    dirs = []
    for layer, shard_hash in zip(cfg.spanned_layers, cfg.per_layer(key)):
        link_fpath = run.layer_link(link, layer)
        if not link_fpath.is_symlink():
            raise SaeflowError(f"{link_fpath}: missing; create the run again (saeflow create-run)")
        shard_dir = ShardDir(link_fpath.resolve())
        if shard_dir.hash != shard_hash:
            raise SaeflowError(f"{link_fpath}: does not point to shards {shard_hash}")
        dirs.append(shard_dir)
    return dirs


class CLTTrainer(Trainer):
    """A CLT being trained: the model, one optimizer over every encoder, a dead-latent counter per layer."""

    def __init__(self, run: runs.Run, cfg: TrainConfig, d_model: int, n_steps: int, device: torch.device,
                 d_out: int):  # fmt: skip
        self.run, self.cfg, self.n_steps, self.device = run, cfg, n_steps, device
        self.checkpoint = Checkpoint(run)
        self.sae = clt_mod.CLT(clt_mod.CLTConfig.of_run(cfg, d_model, d_out)).to(device).train()
        self.peak_lr = peak_lr(cfg, self.sae.cfg.d_sae)
        scales = [scale for sae in self.sae.encoders for scale in lr_scales(sae, cfg)]
        self.opt = Adam(self.sae.parameters(), lr=self.peak_lr, lr_scales=scales)
        self.step, self.pool_rows = 0, None
        self.deads = [dead_latents(cfg, sae.arch, sae.d_sae, n_steps, device) for sae in self.sae.encoders]
        self._common_state()

    def init_from_data(self, *parts: torch.Tensor) -> None:
        """The start from a sample of every layer's inputs, then targets (`parts`: the loader's tuple)."""
        n = len(self.cfg.spanned_layers)
        clt_mod.init_from_data(self.sae, list(parts[:n]), list(parts[n:]), self.cfg.seed, self.cfg, self.run.root)

    def state_dict(self) -> dict:
        state = super().state_dict()
        stacked = {name: torch.stack([dead.state()[name] for dead in self.deads]) for name in self.dead.state()}
        return {**state, **stacked}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict({**state, **{name: state[name][0] for name in STATE_KEYS if name in state}})
        for i, dead in enumerate(self.deads):
            dead.load_state({name: state[name][i] for name in dead.state()}, self.step)

    @property
    def dead(self) -> DeadLatents:
        return self.deads[0]  # what Trainer.load_state_dict restores first (the others follow)

    def train_step(self, batch: tuple[torch.Tensor, ...]) -> None:
        n, clt = len(self.cfg.spanned_layers), self.sae
        self.set_lr()
        loss = clt_mod.clt_loss(clt, list(batch[:n]), list(batch[n:]), self.step, self.n_steps, self.deads, self.cfg)
        self.opt.zero_grad()
        loss.total.backward()
        self.opt.step()  # a transcoder's decoders train freely (Arch.unit_rows)
        with torch.no_grad():
            for sae, dead, codes in zip(clt.encoders, self.deads, loss.codes):
                dead.update(codes.fired_s())
                sae.arch.after_step(sae, codes.activations(), self.step, one_process)
        self.step += 1
        if self.step % LOG_EVERY == 0 or self.step == self.n_steps:
            self.last = {"step": self.step, "n_vectors": self.step * self.cfg.batch_size,
                         "lr": self.opt.param_groups[0]["lr"], "loss": float(loss.total.detach()),
                         **{name: float(value.detach()) for name, value in loss.terms.items()}, "nmse": loss.nmse(),
                         "l0": loss.l0(), "n_dead": int(sum(dead.dead_s.sum() for dead in self.deads))}  # fmt: skip
            self.checkpoint.log(self.last)
            self.tracker.log(self.last)

    def finish(self, val: tuple[list[ShardDir], list[ShardDir]]) -> dict:
        """Validation metrics (`val`: every layer's validation inputs and targets), then the run's files."""
        self.sae.eval()
        metrics = validation_metrics(self.sae, *val, self.cfg, self.device)
        split = "train" if self.cfg.val_shards == self.cfg.train_shards else "val"
        result = {"split": split, "shards": list(self.cfg.val_shards), "step": self.step, "peak_lr": self.peak_lr,
                  **metrics}  # fmt: skip
        return self.publish(result, clt_mod.save_clt)


@torch.no_grad()
def validation_metrics(clt: clt_mod.CLT, inputs: list[ShardDir], targets: list[ShardDir], cfg: TrainConfig,
                       device: torch.device) -> dict:  # fmt: skip
    """The CLT's metrics on the first `n_val_vectors` validation tokens (storage order), RAW space: each layer's
    (`layers`: NMSE of its target, L0, dead and dense latents of its own latents) and the whole (NMSE over every
    layer's target, L0 the sum of the layers', dead and dense counted over every latent)."""
    readers = [OrderedLoader(sd, layer, cfg.batch_size, cfg.tokens, borrowed=True)
               for sd, layer in [*zip(inputs, cfg.spanned_layers), *zip(targets, cfg.spanned_layers)]]  # fmt: skip
    n, n_max = len(cfg.spanned_layers), cfg.n_val_vectors or readers[0].n_vectors
    accs = [MetricsAccumulator(clt.cfg.d_out, clt.cfg.d_sae) for _ in range(n)]
    seen = 0
    for batch in zip(*readers, strict=True):
        batch = [t[: n_max - seen].to(device, torch.float32) for t in batch]
        preds, codes = clt(batch[:n])
        for acc, y_bd, y_hat_bd, f_bs in zip(accs, batch[n:], preds, codes):
            acc.update(y_bd, y_hat_bd, f_bs)
        seen += batch[0].shape[0]
        if seen >= n_max:
            break
    for reader in readers:
        reader.close()
    per_layer = {str(layer): acc.result() for layer, acc in zip(cfg.spanned_layers, accs)}
    err = sum(acc.sq_err for acc in accs)
    var = sum(acc.total_var() for acc in accs)
    nmse = err / var if var > 0 else float("nan")
    whole = {"n_vectors": seen, "nmse": nmse, "explained_variance": 1.0 - nmse,
             "mse": err / max(seen * clt.cfg.d_out * n, 1), "l0": sum(r["l0"] for r in per_layer.values()),
             "n_dead": sum(r["n_dead"] for r in per_layer.values()),
             "n_dense": sum(r["n_dense"] for r in per_layer.values()),
             "dense_freq": accs[0].dense_freq}  # fmt: skip
    return {**whole, "layers": per_layer}


def open_pass(group: list[tuple[runs.Run, TrainConfig]], dev: torch.device, settings: TrainSettings):
    """A CLT's pass (`train._train_group`'s `open_pass`): its loader over every layer's input and target, its
    validation directories, its trainer and the run's steps. A CLT trains alone in its pass (its loader key is its
    own shards)."""
    if len(group) != 1:
        raise SaeflowError(f"{group[1][0].root}: a cross-layer transcoder trains alone in its pass")
    run, cfg = group[0]
    dirs = {key: layer_dirs(run, cfg, link, key) for link, key in ROLES}
    train_in, train_out = dirs["train_shards"], dirs["target"]
    if settings.local_copy:
        train_in, train_out = ([ShardDir(localcopy.local_copy(sd.dpath, settings.local_copy)) for sd in sds]
                               for sds in (train_in, train_out))  # fmt: skip
    rows = [*train_in, *train_out]
    pool = memory.pool_bytes(group, settings.buffer_bytes, "sweep", train_in[0], Comm.alone(dev), rows)
    also = [*zip(train_in[1:], cfg.spanned_layers[1:]), *zip(train_out, cfg.spanned_layers)]
    loader = ShuffledLoader(train_in[0], cfg.spanned_layers[0], cfg.batch_size, cfg.data_seed, tokens=cfg.tokens,
                            buffer_bytes=pool, borrowed=True, also=also)  # fmt: skip
    widths = {sd.metadata.d_model for sd in [*train_in, *dirs["val_shards"]]}
    out_widths = {sd.metadata.d_model for sd in [*train_out, *dirs["val_target"]]}
    if len(widths) != 1 or len(out_widths) != 1:
        raise SaeflowError(f"{run.root}: a CLT's layers must share one input width and one target width, got "
                           f"{sorted(widths)} and {sorted(out_widths)}")  # fmt: skip
    n_steps = -(-cfg.n_train_vectors // cfg.batch_size) if cfg.n_train_vectors else cfg.n_epochs * len(loader)
    trainer = CLTTrainer(run, cfg, widths.pop(), n_steps, dev, out_widths.pop())
    return loader, [(dirs["val_shards"], dirs["val_target"])], [trainer], n_steps
