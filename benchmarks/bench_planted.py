"""Does every architecture learn a planted dictionary? saeflow beside sae-lens and sparsify, same data, same steps.

    python benchmarks/bench_planted.py [--d-model 256] [--n-atoms 1024] [--n-active 8] [--batch-size 4096]
                                       [--steps 512] [--l1 0.5,1,2,5] [--peers] [--only relu,topk,...]
                                       [--transcoder [--skip] [--noise 0.05]]
                                       [--magnitude uniform|exp|lognormal] [--input-noise 0.01] [--latents-per-atom 2]
    python benchmarks/bench_planted.py --grid [--axis d_model=128,256] [--vectors 2000000] [--only jumprelu,gated]

Data: `benchmarks/planted.py` (unit atoms, `n_active` per vector, coefficients in [0.5, 2.5]); every trainer reads
the identical stream of `steps` batches. Each SAE has d_sae = n_atoms (expansion n_atoms / d_model) and k =
n_active. saeflow trains with its real `Trainer.train_step` at its defaults (lr null = auto, warm-ups, AuxK); ReLU
is swept over `--l1` (and Gated over `--gate-l1`, when given); each point is printed and the best (most atoms
recovered) goes in the table, as does sae-lens' best over the same grid.

Peers (`--peers`) run in a subprocess (`_planted_peers.py`) with SAELens and sparsify on PYTHONPATH (the dir of
tests/_sae_peers.py's install, `$SAEFLOW_TEST_CACHE`, default ~/.cache/saeflow-tests/sae-lens-6.54.12+eai-sparsify-
1.3.3), each with its own training code and defaults: sae-lens' `SAETrainer` (lr 3e-4, decoder init norm 0.1);
sparsify's SAE, loss (FVU + AuxK) and default optimizer (schedule-free SignSGD, lr 5e-3 / sqrt(d_sae / 2^14)).

`--transcoder`: planted pairs (`planted.pair_batch`): inputs as above, targets the same coefficients on a second
set of unit atoms plus Gaussian noise; each saeflow architecture trains as a transcoder (its real `train_step` on the
pairs, at its defaults; `--skip`: with the linear skip path), sparsify's transcoder (`transcode=True`: its zero
decoder init, centred encoder biases, b_dec = the first targets' mean, no decoder normalization, its default
optimizer) on the same stream; recovery is of the output atoms, NMSE of the targets.

`--grid` (issue 42): every cell of GRID (d_model, atoms per dimension, active atoms, latents per atom, the
coefficients' law), each architecture at the schema's defaults for one pass over --vectors (AuxK's window
included), k = the planted active count; a table per architecture of recovered, NMSE, L0 against the planted L0, and
the shares of dead latents (silent on the held-out batch) and dense ones (firing on more than DENSE_FREQ of it).

Printed: per architecture the recovered fraction (an atom is recovered when some decoder row has cosine > 0.9
with it), the mean max cosine, NMSE and L0 on a held-out batch, and the ratio recovered / best peer's recovered.
"""

import argparse
import itertools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import planted  # noqa: E402
from saeflow import config  # noqa: E402
from saeflow.store import runs  # noqa: E402
from saeflow.training import keys, specs, sweeps, train  # noqa: E402

PEERS_DNAME = "sae-lens-6.54.12+eai-sparsify-1.3.3"
# Every run trains at the schema's defaults of every architecture's keys but k (the planted count); --grid at those
# of these too (the rest of train_saeflow's spec is the run's shape)
SCHEMA_DEFAULTS = ("aux_k", "aux_alpha", "dead_after_vectors", "lr", "lr_warmup_frac")
DENSE_FREQ = 0.1  # a latent that fires on more than this share of the held-out vectors is dense
# --grid: what users' data varies (issue 42): d_model, atoms per dimension, active atoms per vector, latents per atom,
# the coefficients' distribution (planted.MAGNITUDES)
GRID = {"d_model": (128, 256, 512), "atoms_per_dim": (4, 8), "n_active": (8, 16, 32), "latents_per_atom": (1, 2),
        "magnitude": ("exp", "lognormal")}
SAEFLOW_ARCHS = {
    "relu": dict(arch="relu"),
    "topk": dict(arch="topk"),
    "batchtopk": dict(arch="batchtopk"),
    "matryoshka-batchtopk": dict(arch="batchtopk", matryoshka=(0.25,)),
    "jumprelu": dict(arch="jumprelu"),
    "jumprelu-tanh": dict(arch="jumprelu", jumprelu_loss="tanh"),
    "gated": dict(arch="gated"),
}


def stream(atoms_ad, args, step: int, n: int):
    """Batch `step` of the benchmark's stream: vectors, or a transcoder's (inputs, targets) (`args.transcoder`)."""
    if not args.transcoder:
        return planted.batch(atoms_ad, args.n_active, n, args.seed, step, args.magnitude, args.input_noise)
    atoms_out_ad = planted.output_dictionary(atoms_ad.shape[1], atoms_ad.shape[0], args.seed)
    return planted.pair_batch(atoms_ad, atoms_out_ad, args.n_active, n, args.seed, step, args.noise)


def _schema_defaults(names) -> dict:
    """The schema's default of each key of `names` (the user's defaults, not the bench's)."""
    properties = config.def_schema("sae_spec")["properties"]
    return {key: properties[key]["default"] for key in names}


def train_saeflow(atoms_ad, args, n_steps: int, seed: int = 0, **overrides) -> dict:
    """One saeflow SAE (or transcoder) trained with `Trainer.train_step` on the planted stream; its scores."""
    d_model, n_atoms = atoms_ad.shape[1], atoms_ad.shape[0]
    spec = dict(
        trainer="", train_shards="planted", val_shards="planted", layer=0, tokens="all", arch="topk",
        expansion=max(1, args.latents_per_atom * n_atoms // d_model),
        matryoshka=(), aux_k=256, aux_alpha=1 / 32, dead_after_vectors=10_000_000, lr=None, lr_warmup_frac=0.05,
        batch_size=args.batch_size, n_epochs=1, n_train_vectors=None, n_val_vectors=None, seed=seed, data_seed=0,
        **sweeps.INTRODUCED,  # the keys added later, at their introduction values, then the architectures' defaults
    )  # fmt: skip
    spec.update(_schema_defaults(key for key in keys.ARCH_KEYS if key != "k"), k=args.n_active)
    if args.transcoder:
        spec.update(target="planted-target", val_target="planted-target", skip=args.skip)
    if args.dead_after_vectors:
        spec.update(dead_after_vectors=None if args.dead_after_vectors < 0 else args.dead_after_vectors)
    spec.update(lr=args.lr)
    spec.update(overrides)
    spec.update(args.overrides)
    cfg = specs.TrainConfig(**{**spec, "trainer": specs.trainer_of(spec["arch"])})
    with tempfile.TemporaryDirectory() as tmp:
        run = runs.Run(pathlib.Path(tmp))
        run.checkpoint_dpath.mkdir()
        trainer = train.Trainer(run, cfg, d_model, n_steps, torch.device("cpu"))
        init = stream(atoms_ad, args, n_steps + 1, 16384)
        trainer.init_from_data(*(init if args.transcoder else (init,)))
        for step in range(n_steps):
            trainer.train_step(stream(atoms_ad, args, step, args.batch_size))
        sae = trainer.sae.eval()
        if not sae.arch.unit_decoder_for(cfg):
            sae.fold_decoder_norms()
        with torch.no_grad():
            held = stream(atoms_ad, args, n_steps + 2, args.batch_size)
            x_bd, y_bd = held if args.transcoder else (held, held)
            y_hat_bd, f_bs = sae(x_bd)
        truth_ad = planted.output_dictionary(d_model, n_atoms, args.seed) if args.transcoder else atoms_ad
        freq_s = (f_bs > 0).float().mean(0)
        return {**planted.score(truth_ad, sae.W_dec.detach()), **planted.nmse_l0(y_bd, y_hat_bd, f_bs),
                "dead": float((freq_s == 0).float().mean()), "dense": float((freq_s > DENSE_FREQ).float().mean())}


def peers_site(instead: str) -> pathlib.Path:
    """The SAELens + sparsify install tests/test_sae_interop.py makes under $SAEFLOW_TEST_CACHE, or exit saying so."""
    cache = pathlib.Path(os.environ.get("SAEFLOW_TEST_CACHE", pathlib.Path.home() / ".cache" / "saeflow-tests"))
    site = cache / PEERS_DNAME
    if not site.is_dir():
        sys.exit(f"{site}: no SAELens/sparsify install (run tests/test_sae_interop.py once, or {instead})")
    return site


def run_peers(args, n_steps: int) -> dict:
    peers_dpath = peers_site("drop --peers")
    job = {**vars(args), "n_steps": n_steps}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(peers_dpath), str(pathlib.Path(__file__).parent)])}
    script = pathlib.Path(__file__).parent / "_planted_peers.py"
    proc = subprocess.run([sys.executable, str(script), json.dumps(job)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"peer training failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def best_of(results: list[dict]) -> dict:
    return max(results, key=lambda r: (r["recovered"], r["mean_max_cos"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-atoms", type=int, default=1024)
    parser.add_argument("--n-active", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--l1", default="1,2,5", help="ReLU L1 coefficients swept (saeflow and sae-lens)")
    parser.add_argument("--gate-l1", default=None, help="gated gate_l1_coeff values swept (default: its default)")
    parser.add_argument("--seed", type=int, default=0, help="data seed")
    parser.add_argument("--only", default=",".join(SAEFLOW_ARCHS), help="architectures to run")
    parser.add_argument("--peers", action="store_true", help="also train sae-lens and sparsify")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--transcoder", action="store_true", help="planted pairs: transcoders (sparsify's as peer)")
    parser.add_argument("--skip", action="store_true", help="transcoders with the linear skip path")
    parser.add_argument("--noise", type=float, default=0.05, help="transcoder targets' noise std per dimension")
    parser.add_argument("--lr", type=float, default=None, help="saeflow's peak learning rate (default: its auto)")
    parser.add_argument("--dead-after-vectors", type=int, default=0,
                        help="saeflow's dead-latent window (AuxK); -1: its default (a tenth of the run); 0: 10M")
    parser.add_argument("--magnitude", choices=planted.MAGNITUDES, default="uniform", help="the coefficients' law")
    parser.add_argument("--input-noise", type=float, default=0.0, help="Gaussian noise std per dimension of the SAE "
                        "inputs (a transcoder's targets take --noise)")
    parser.add_argument("--latents-per-atom", type=int, default=1, help="d_sae = this x n_atoms")
    parser.add_argument("--grid", action="store_true", help="every cell of GRID (at --vectors each), a table per "
                        "architecture; --axis narrows an axis")
    parser.add_argument("--axis", action="append", default=[], metavar="NAME=V1,V2",
                        help=f"--grid: the values of one axis of {', '.join(GRID)}")
    parser.add_argument("--vectors", type=int, default=2_000_000, help="--grid: training vectors per cell (one pass)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a training key for every "
                        "architecture run (a JSON value: --set bandwidth=2 --set jumprelu_loss='\"tanh\"')")
    args = parser.parse_args()
    args.overrides = {key: json.loads(value) for key, _, value in (text.partition("=") for text in args.set)}
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.grid:
        return run_grid(args)
    atoms_ad = planted.dictionary(args.d_model, args.n_atoms, args.seed)
    n_steps = args.steps
    what = f"transcoder pairs{' (skip)' if args.skip else ''}, noise {args.noise}, " if args.transcoder else ""
    print(
        f"planted {what}d {args.d_model}, {args.n_atoms} atoms, {args.n_active} active, {n_steps} steps of "
        f"{args.batch_size} ({n_steps * args.batch_size:,} vectors), torch threads {torch.get_num_threads()}"
    )
    rows = {}
    for name in args.only.split(","):
        t0 = time.perf_counter()
        swept = {"relu": ("l1_coeff", args.l1), "gated": ("gate_l1_coeff", args.gate_l1)}.get(name, (None, None))
        if swept[1]:
            key, values = swept
            sweep = []
            for c in values.split(","):
                scores = train_saeflow(atoms_ad, args, n_steps, **{key: float(c)}, **SAEFLOW_ARCHS[name])
                sweep.append(dict(scores, swept=f"{key} {c}"))
                print(f"    {key} {c}: {scores}", flush=True)
            rows[f"saeflow {name}"] = best_of(sweep)
        else:
            rows[f"saeflow {name}"] = train_saeflow(atoms_ad, args, n_steps, **SAEFLOW_ARCHS[name])
        rows[f"saeflow {name}"]["sec"] = time.perf_counter() - t0
        print(f"  saeflow {name}: {rows[f'saeflow {name}']}", flush=True)
    peers = run_peers(args, n_steps) if args.peers else {}
    _print_table(rows, peers)


def grid_cells(args) -> list[dict]:
    """The cells of GRID, each axis narrowed by --axis NAME=V1,V2."""
    axes = dict(GRID)
    for text in args.axis:
        name, _, values = text.partition("=")
        if name not in GRID or not values:
            raise SystemExit(f"--axis {text!r}: give NAME=V1,V2 with NAME one of {', '.join(GRID)}")
        kind = str if name == "magnitude" else int
        axes[name] = tuple(kind(v) for v in values.split(","))
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def run_grid(args) -> None:
    """Every architecture of --only at its defaults in every cell, one pass over --vectors; a table per architecture
    (recovered, NMSE, L0 against the planted L0, dead and dense latents' shares)."""
    n_steps = max(1, args.vectors // args.batch_size)
    print(f"planted grid, {n_steps} steps of {args.batch_size} ({n_steps * args.batch_size:,} vectors) per cell, "
          f"input noise {args.input_noise}, torch threads {torch.get_num_threads()}")  # fmt: skip
    table = {name: [] for name in args.only.split(",")}
    defaults = {**_schema_defaults(SCHEMA_DEFAULTS), **({} if args.lr is None else {"lr": args.lr})}  # --lr wins
    for cell in grid_cells(args):
        n_atoms = cell["atoms_per_dim"] * cell["d_model"]
        cell_args = argparse.Namespace(**{**vars(args), **cell, "n_atoms": n_atoms, "dead_after_vectors": 0})
        atoms_ad = planted.dictionary(cell["d_model"], n_atoms, args.seed)
        for name in table:
            t0 = time.perf_counter()
            scores = train_saeflow(atoms_ad, cell_args, n_steps, **{**defaults, **SAEFLOW_ARCHS[name]})
            row = {**cell, **scores}
            table[name].append({**row, "sec": time.perf_counter() - t0})
            print(f"  {name} {cell}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items() if k not in cell), flush=True)
    for name, rows in table.items():
        print(f"\n### {name}\n\n| d_model | atoms/dim | active | latents/atom | magnitude | recovered | NMSE | L0 "
              "(planted) | dead | dense |\n|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
        for r in rows:
            print(f"| {r['d_model']} | {r['atoms_per_dim']} | {r['n_active']} | {r['latents_per_atom']} | "
                  f"{r['magnitude']} | {r['recovered']:.1%} | {r['nmse']:.3f} | {r['l0']:.1f} ({r['n_active']}) | "
                  f"{r['dead']:.1%} | {r['dense']:.1%} |")  # fmt: skip


def _print_table(rows: dict, peers: dict) -> None:
    print(f"\n{'SAE':34s} {'recovered':>9s} {'mean max cos':>12s} {'NMSE':>7s} {'L0':>7s}  vs best peer")
    for name, r in {**rows, **peers}.items():
        arch = name.split(" ", 1)[1].split(" ")[0]
        same = [p["recovered"] for n, p in peers.items() if n.split(" ", 1)[1].split(" ")[0] == arch]
        ratio = f"{r['recovered'] / max(same):.2f}x" if name in rows and same and max(same) > 0 else ""
        extra = f" ({r['swept']})" if "swept" in r else f" (l1 {r['l1']})" if "l1" in r else ""
        print(
            f"{name + extra:34s} {r['recovered']:9.1%} {r['mean_max_cos']:12.3f} {r['nmse']:7.3f} {r['l0']:7.1f}  "
            f"{ratio}"
        )


if __name__ == "__main__":
    main()
