"""GPU check: every CUDA path of saeflow, run once on a GPU node, each timed against a limit measured in the same run.

    python benchmarks/gpu/check.py                  # on a machine with a CUDA GPU (minutes)
    python benchmarks/gpu/check.py --cpu            # dry run: the same pipeline, tiny models, on the CPU (seconds)
    python benchmarks/gpu/check.py --dir $TMPDIR    # shards on node-local disk (default: the system temp dir)

On OSC: `srun --gpus-per-node=1 -t 0:30:00 python benchmarks/gpu/check.py --dir $TMPDIR` (or the same line in an
sbatch script). Stages:

1. tests     `pytest -m cuda` in a subprocess (tests/test_cuda.py: GPU vs CPU extraction, GPU resume, inference).
2. extract   a random ViT-L/14-sized vision model (d 1024, 24 blocks, 16 heads, patch 14, image 224) and a random
             ~1B Llama-sized decoder (d 2048, 16 blocks, 32 heads, MLP 8192) in bfloat16, last block stored as
             float16: tokens/s of `saeflow.extraction.extract.extract` (its batch loop: input loading, forward, writing,
             publish; `Result.loop_sec`) against a bare forward pass of the same model over the same inputs,
             already in host memory (limit). Also the writer's share, `Result.write_sec / total_sec`.
3. train     TopK and BatchTopK SAEs (d 1024, 32x, k 32, batch 4096) from float16 shards on local disk, through
             the real loop (`train._run_steps`: shuffled loader -> GPU -> `Trainer.train_step`): examples/s against
             a bare-torch step on a batch already on the GPU (encoder matmul, row top-k, embedding_bag decoder,
             backward, Adam), and peak GPU memory (`torch.cuda.max_memory_allocated`) against that step's.
4. inference `saeflow.analysis.inference.run_inference` on the GPU: vectors/s against a bare SAE forward over the same
             batches (host -> GPU, encode/decode, codes back to the host).

While extraction and training run, GPU utilization is sampled every 100 ms (`nvidia-smi -lms 100`, else
`torch.cuda.utilization()` when pynvml is installed): its mean and the longest run of idle samples (a GPU waiting
on the loader or the writer). Targets: extraction >= 0.9 of the bare forward, training >= 0.7 of the bare step,
no idle gap over 0.5 s. One table is printed (stage, measured, limit, ratio, target), Markdown, headed by the
machine; paste it into README.md (Benchmarks, "GPU check"). The exit status is 1 when the CUDA tests fail.

--cpu skips the `pytest -m cuda` run and the utilization sampling (their rows say "skipped") and runs everything
else on tiny models and data, so CI exercises this script (tests/test_gpu_check.py).
"""

import argparse
import dataclasses
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "workflow"))  # runnable from a checkout without PYTHONPATH
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from saeflow.analysis import inference  # noqa: E402
from saeflow.extraction import adapters, extract, specs  # noqa: E402
from saeflow.store import runs, shards  # noqa: E402
from saeflow.training import loaders, sae, train  # noqa: E402
from saeflow.training.specs import TrainConfig, trainer_of  # noqa: E402

SAMPLE_SEC = 0.1
IDLE_GAP_LIMIT_SEC = 0.5
SKIPPED = "skipped"


@dataclasses.dataclass(frozen=True)
class Profile:
    """Model and data sizes of one mode."""

    vision_config: dict
    vision_n_ex: int
    text_config: dict
    text_n_ex: int
    context_length: int
    extract_batch: int
    n_workers: int
    d_model: int
    expansion: int
    k: int
    train_batch: int
    n_warm_steps: int
    n_steps: int  # timed
    n_infer_vectors: int
    infer_batch: int


GPU_PROFILE = Profile(
    vision_config=dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, image_size=224,
        patch_size=14,
    ),
    vision_n_ex=1024,
    text_config=dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192,
        vocab_size=32000, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
    ),
    text_n_ex=512, context_length=512, extract_batch=32, n_workers=4,
    d_model=1024, expansion=32, k=32, train_batch=4096, n_warm_steps=10, n_steps=100,
    n_infer_vectors=131072, infer_batch=4096,
)  # fmt: skip
CPU_PROFILE = Profile(
    vision_config=dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
    ),
    vision_n_ex=16,
    text_config=dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        vocab_size=300, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
    ),
    text_n_ex=8, context_length=32, extract_batch=4, n_workers=0,
    d_model=32, expansion=4, k=8, train_batch=256, n_warm_steps=2, n_steps=10,
    n_infer_vectors=2048, infer_batch=512,
)  # fmt: skip


@dataclasses.dataclass
class Row:
    stage: str
    measured: str
    limit: str
    ratio: float | None  # None: skipped
    target: str


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ---------------------------------------------------------------------------------------------------------------
# GPU utilization
# ---------------------------------------------------------------------------------------------------------------


class UtilSampler:
    """GPU utilization (%) every SAMPLE_SEC in a background process or thread; `stats` of a time window."""

    def __init__(self, enabled: bool):
        self.samples: list[tuple[float, float]] = []  # (time.monotonic(), utilization %)
        self.source, self._proc, self._stop = None, None, threading.Event()
        if not enabled:
            return
        if shutil.which("nvidia-smi"):
            cmd = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                   "-lms", str(int(SAMPLE_SEC * 1000)), "-i", gpu_id()]  # fmt: skip
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self.source = "nvidia-smi"
            target = self._read_smi
        else:
            try:
                import pynvml  # noqa: F401  (torch.cuda.utilization needs it)
            except ImportError:
                return
            self.source = "torch.cuda.utilization"
            target = self._poll_torch
        threading.Thread(target=target, daemon=True).start()

    def _read_smi(self) -> None:
        for line in self._proc.stdout:
            try:
                self.samples.append((time.monotonic(), float(line.strip())))
            except ValueError:
                pass

    def _poll_torch(self) -> None:
        while not self._stop.wait(SAMPLE_SEC):
            self.samples.append((time.monotonic(), float(torch.cuda.utilization())))

    def close(self) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()

    def stats(self, windows: list[tuple[float, float]]) -> tuple[float, float] | None:
        """(mean utilization %, longest run of idle samples in seconds) inside the windows; None without samples."""
        utils, longest = [], 0.0
        for lo, hi in windows:
            run = 0
            for t, util in self.samples:
                if lo <= t <= hi:
                    utils.append(util)
                    run = run + 1 if util == 0 else 0
                    longest = max(longest, run * SAMPLE_SEC)
        return (float(np.mean(utils)), longest) if utils else None


def gpu_id() -> str:
    """The current GPU for nvidia-smi: its UUID (CUDA_VISIBLE_DEVICES renumbers torch's indices, not nvidia-smi's)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    uuid = getattr(props, "uuid", None)
    return f"GPU-{uuid}" if uuid else str(torch.cuda.current_device())


def util_rows(name: str, sampler: UtilSampler, windows: list[tuple[float, float]]) -> list[Row]:
    stats = sampler.stats(windows) if sampler.source else None
    if stats is None:
        why = SKIPPED if sampler.source is None else "no samples"
        return [Row(f"GPU utilization, {name}", why, "100 %", None, "(info)"),
                Row(f"GPU longest idle gap, {name}", why, f"{IDLE_GAP_LIMIT_SEC} s", None, "<= 1.0")]  # fmt: skip
    mean_pct, gap_sec = stats
    return [
        Row(f"GPU utilization, {name}", f"{mean_pct:.0f} %", "100 %", mean_pct / 100, "(info)"),
        Row(f"GPU longest idle gap, {name}", f"{gap_sec:.1f} s", f"{IDLE_GAP_LIMIT_SEC} s",
            gap_sec / IDLE_GAP_LIMIT_SEC, "<= 1.0"),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------


def cuda_tests() -> tuple[Row, bool]:
    """`pytest -m cuda` in a subprocess: (its row, whether it passed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT / "workflow"),
                                                                     os.environ.get("PYTHONPATH")]))}  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "tests"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n", file=sys.stderr)
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", proc.stdout)}
    passed = counts.get("passed", 0)
    ran = passed + counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    total = ran + counts.get("skipped", 0)
    ok = proc.returncode == 0 and passed > 0 and ran == total
    return Row("pytest -m cuda", f"{passed} passed", f"{total} selected", passed / max(total, 1), "= 1.0"), ok


def activation_spec(kind: str, prof: Profile, device: str) -> specs.ActivationSpec:
    common = dict(layers=[-1], compute_dtype="bfloat16", store_dtype="float16", batch_size=prof.extract_batch,
                  device=device)  # fmt: skip
    if kind == "vision":
        size = prof.vision_config["image_size"]
        return specs.ActivationSpec.from_dict({
            **common,
            "model": {"random": {"arch": "vit", "config": prof.vision_config, "seed": 0}},
            "dataset": {"kind": "generated_images", "n_ex": prof.vision_n_ex, "seed": 0, "size": size},
            "n_workers": prof.n_workers,
            "patches_per_shard": 64 * (size // prof.vision_config["patch_size"]) ** 2,
        })
    return specs.ActivationSpec.from_dict({
        **common,
        "model": {"random": {"arch": "llama", "config": prof.text_config, "seed": 0}},
        "dataset": {"kind": "builtin_text", "n_ex": prof.text_n_ex},
        "tokenizer": "bytes",
        "context_length": prof.context_length,
        "patches_per_shard": 64 * prof.context_length,
    })


def bare_forward_sec(spec: specs.ActivationSpec, dev: torch.device) -> float:
    """Seconds of a bare forward pass over the spec's inputs (already in host memory), after a warm-up batch."""
    plan_ = extract.plan(spec, device=str(dev))
    md = plan_.metadata
    source = extract._image_batches if plan_.info.modality == "vision" else extract._text_batches
    inputs = [x for x, _ in source(plan_, extract.batches(md.n_ex, md.ex_per_shard, spec.batch_size, 0))]
    model = adapters.load(plan_.model_spec, spec.compute_dtype, str(dev), info=plan_.info).model
    dtype = getattr(torch, spec.compute_dtype)

    def forward(x):
        x = x.to(dev)
        if plan_.info.modality == "vision":
            return model(pixel_values=x.to(dtype))
        return model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)

    with torch.inference_mode():
        forward(inputs[0])
        sync(dev)
        t0 = time.perf_counter()
        for x in inputs:
            forward(x)
        sync(dev)
        return time.perf_counter() - t0


def extraction(kind: str, label: str, prof: Profile, dev: torch.device, root: pathlib.Path, windows: list) -> list[Row]:
    spec = activation_spec(kind, prof, str(dev))
    bare_sec = bare_forward_sec(spec, dev)  # first, so CUDA and cuBLAS are warm for both sides
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the bare model's weights go before extraction loads its own
    result = extract.extract(spec, root / f"shards-{kind}", device=str(dev), progress=False)
    end = time.monotonic()
    windows.append((end - result.loop_sec, end))
    n_tokens = result.n_ex * extract.plan(spec).metadata.tokens_per_ex
    ours, bare = n_tokens / result.loop_sec, n_tokens / bare_sec
    return [
        Row(f"extract {label}: tokens/s", f"{ours:,.0f} tok/s", f"{bare:,.0f} tok/s (bare forward)", ours / bare,
            ">= 0.9"),
        Row(f"extract {label}: writer share", f"{result.write_sec:.2f} s", f"{result.total_sec:.2f} s (total)",
            result.write_sec / result.total_sec, "(info)"),
    ]  # fmt: skip


def write_vectors(root: pathlib.Path, n_vectors: int, d_model: int, tag: str) -> shards.ShardDir:
    """float16 shards of `n_vectors` random vectors (256 tokens per example, one layer), written in chunks."""
    n_tok = 256
    n_ex = -(-n_vectors // n_tok)
    md = shards.Metadata(
        family="vit", ckpt=f"gpu-check/{tag}", layers=(0,), patches_per_ex=n_tok, cls_token=False, d_model=d_model,
        n_ex=n_ex, patches_per_shard=64 * n_tok, data={"__class__": "Synthetic", "tag": tag}, dataset="/nonexistent",
        dtype="float16",
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    dirs_d = torch.randn(64, d_model, generator=gen)  # a few strong directions: top-k has structure to find
    with shards.ShardWriter(root, md) as writer:
        for lo in range(writer.n_written, n_ex, 16):
            n = min(16, n_ex - lo)
            x_nd = torch.randn(n * n_tok, d_model, generator=gen) + torch.rand(n * n_tok, 64, generator=gen) @ dirs_d
            writer.write(x_nd.reshape(n, 1, n_tok, d_model).numpy().astype(np.float16))
    return shards.ShardDir(writer.dpath)


def train_config(arch: str, prof: Profile) -> TrainConfig:
    return TrainConfig(
        trainer=trainer_of(arch), train_shards="gpu-check", val_shards="gpu-check", layer=0, tokens="content",
        arch=arch, expansion=prof.expansion, k=prof.k, matryoshka=(), l1_coeff=0.0, aux_k=256, aux_alpha=1 / 32,
        dead_after_vectors=10_000_000, lr=4e-4, lr_warmup_frac=0.05, sparsity_warmup_frac=0.0,
        batch_size=prof.train_batch, n_epochs=1, n_train_vectors=None, n_val_vectors=None, seed=0, data_seed=0,
    )  # fmt: skip


def peak_bytes(dev: torch.device) -> int:
    return torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0


def reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def bare_train(x_bd: torch.Tensor, prof: Profile, dev: torch.device) -> tuple[float, int]:
    """(seconds per step, peak bytes) of a bare TopK SAE step on a batch already on the device."""
    reset_peak(dev)
    d, s = prof.d_model, prof.d_model * prof.expansion
    gen = torch.Generator().manual_seed(0)
    W_enc = (torch.randn(d, s, generator=gen) / d**0.5).to(dev).requires_grad_()
    W_dec = (torch.randn(s, d, generator=gen) / d**0.5).to(dev).requires_grad_()
    b_enc = torch.zeros(s, device=dev, requires_grad=True)
    b_dec = torch.zeros(d, device=dev, requires_grad=True)
    opt = torch.optim.Adam([W_enc, b_enc, W_dec, b_dec], lr=4e-4)

    def step():
        vals_bk, idx_bk = torch.relu(x_bd @ W_enc + b_enc).topk(prof.k, dim=-1, sorted=False)
        x_hat_bd = torch.nn.functional.embedding_bag(idx_bk, W_dec, per_sample_weights=vals_bk, mode="sum") + b_dec
        loss = (x_hat_bd - x_bd).square().sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(prof.n_warm_steps):
        step()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(prof.n_steps):
        step()
    sync(dev)
    return (time.perf_counter() - t0) / prof.n_steps, peak_bytes(dev)


def ours_train(arch, sd, prof, dev, root: pathlib.Path, windows: list) -> tuple[float, int, sae.SAE]:
    """(seconds per step, peak bytes, the SAE) of saeflow's training loop from the shards, after warm-up steps."""
    run = runs.Run(root / f"run-{arch}")
    run.checkpoint_dpath.mkdir(parents=True)
    loader = loaders.ShuffledLoader(sd, 0, prof.train_batch, seed=0, borrowed=True)  # as the trainer reads
    n_steps = prof.n_warm_steps + prof.n_steps
    trainer = train.Trainer(run, train_config(arch, prof), prof.d_model, n_steps, dev)
    trainer.init_from_data(train._first_vectors(loader, train.N_INIT_VECTORS))
    reset_peak(dev)
    no_checkpoint = n_steps + 1
    train._run_steps([trainer], loader, 0, prof.n_warm_steps, no_checkpoint)
    sync(dev)
    t0, start = time.perf_counter(), time.monotonic()
    train._run_steps([trainer], loader, prof.n_warm_steps, n_steps, no_checkpoint)
    sync(dev)
    sec = (time.perf_counter() - t0) / prof.n_steps
    windows.append((start, time.monotonic()))
    loader.close()
    return sec, peak_bytes(dev), trainer.sae.eval().cpu()  # off the GPU before the next SAE's peak


def training(prof: Profile, dev: torch.device, root: pathlib.Path, windows: list) -> tuple[list[Row], sae.SAE]:
    sd = write_vectors(root / "shards-train", (prof.n_warm_steps + prof.n_steps) * prof.train_batch, prof.d_model,
                       "train")  # fmt: skip
    loader = loaders.OrderedLoader(sd, 0, prof.train_batch)
    x_bd = next(iter(loader)).to(dev, torch.float32)
    loader.close()
    bare_sec, bare_peak = bare_train(x_bd, prof, dev)
    del x_bd
    rows, topk_sae = [], None
    bare_eps = prof.train_batch / bare_sec
    for arch in ("topk", "batchtopk"):
        sec, peak, model = ours_train(arch, sd, prof, dev, root, windows)
        topk_sae = topk_sae or model
        eps = prof.train_batch / sec
        size = f"d {prof.d_model}, {prof.expansion}x"
        rows.append(Row(f"train {arch} ({size}): examples/s", f"{eps:,.0f} ex/s",
                        f"{bare_eps:,.0f} ex/s (bare step)", eps / bare_eps, ">= 0.7"))  # fmt: skip
        if dev.type == "cuda":
            rows.append(Row(f"train {arch}: peak GPU memory", f"{peak / 2**30:.2f} GiB",
                            f"{bare_peak / 2**30:.2f} GiB (bare step)", peak / bare_peak, "(info)"))  # fmt: skip
        else:
            rows.append(Row(f"train {arch}: peak GPU memory", SKIPPED, "-", None, "(info)"))
    return rows, topk_sae


def run_inference(model: sae.SAE, prof: Profile, dev: torch.device, root: pathlib.Path) -> list[Row]:
    sd = write_vectors(root / "shards-infer", prof.n_infer_vectors, prof.d_model, "infer")
    run = runs.create_run(root / "runs", {"layer": 0, "train_shards": sd.hash}, sd.dpath)
    sae.save_sae(model.cpu(), run.sae_fpath)
    cfg = inference.InferenceConfig(run.root, sd.dpath, batch_size=prof.infer_batch, device=str(dev))
    t0 = time.perf_counter()
    inference.run_inference(cfg)
    ours_sec = time.perf_counter() - t0
    loader = loaders.OrderedLoader(sd, 0, prof.infer_batch)
    batches = list(loader)  # owned batches (the loader's default)
    loader.close()
    model = sae.load_sae(run.sae_fpath).to(dev)
    with torch.no_grad():
        for _ in range(2):  # a warm-up pass, then the timed one (the second)
            sync(dev)
            t0 = time.perf_counter()
            for x_bd in batches:
                _, f_bs = model(x_bd.to(dev, torch.float32))
                f_bs.cpu()
            sync(dev)
    bare_sec = time.perf_counter() - t0
    n = sd.n_ex * sd.metadata.tokens_per_ex
    return [Row("inference: vectors/s", f"{n / ours_sec:,.0f} vec/s", f"{n / bare_sec:,.0f} vec/s (bare SAE forward)",
                bare_sec / ours_sec, "(info)")]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def machine(dev: torch.device, cpu: bool) -> str:
    versions = f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}"
    if cpu:
        return f"{platform.machine()} CPU, {os.cpu_count()} cores, {versions} (cpu dry run)"
    return f"{torch.cuda.get_device_name(dev)}, {versions}, cuDNN {torch.backends.cudnn.version()}"


def table(rows: list[Row], header: str) -> str:
    lines = [f"GPU check: {header}", "", "| stage | measured | limit | ratio | target |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
        lines.append(f"| {r.stage} | {r.measured} | {r.limit} | {ratio} | {r.target} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="dry run on the CPU with tiny models (seconds; what CI runs)")
    p.add_argument("--dir", default=None, help="where shards and runs go (default: the system temp dir)")
    p.add_argument("--device", default="cuda", help="the GPU to check (default cuda)")
    p.add_argument("--skip-tests", action="store_true", help="do not run `pytest -m cuda`")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA GPU visible; run on a GPU node, or pass --cpu for the dry run", file=sys.stderr)
        return 2
    dev = torch.device("cpu" if args.cpu else args.device)
    prof = CPU_PROFILE if args.cpu else GPU_PROFILE
    ok = True
    rows: list[Row] = []
    if args.cpu or args.skip_tests:
        rows.append(Row("pytest -m cuda", SKIPPED, "-", None, "= 1.0"))
    else:
        row, ok = cuda_tests()
        rows.append(row)
    sampler = UtilSampler(enabled=not args.cpu)
    extract_windows: list = []
    train_windows: list = []
    try:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="saeflow-gpu-check-") as tmp:
            root = pathlib.Path(tmp)
            rows += extraction("vision", "ViT-L/14-sized" if not args.cpu else "tiny ViT", prof, dev, root,
                               extract_windows)  # fmt: skip
            rows += extraction("text", "Llama ~1B-sized" if not args.cpu else "tiny Llama", prof, dev, root,
                               extract_windows)  # fmt: skip
            train_rows, model = training(prof, dev, root, train_windows)
            rows += train_rows
            rows += run_inference(model, prof, dev, root)
    finally:
        sampler.close()
    rows += util_rows("extraction", sampler, extract_windows)
    rows += util_rows("training", sampler, train_windows)
    print(table(rows, machine(dev, args.cpu)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
