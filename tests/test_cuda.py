"""CUDA paths against their CPU twins (`pytest -m cuda`; skipped without a GPU, run by benchmarks/gpu/check.py).

- extraction on the GPU stores what the CPU stores (tiny random ViT and GPT-2, float32 and bfloat16), within a
  relative tolerance: kernels differ in the last bits (cuDNN convolutions may use TF32), the bytes of the hash do not;
- training on the GPU resumes exactly: `max_steps` then a restart gives the weights of an uninterrupted GPU run;
- an inference dump made on the GPU equals the CPU's within float tolerance (codes, statistics, top-k, metrics).
"""

import json
import os

# Deterministic cuBLAS (for the exact-resume test) must be asked for before the first CUDA call of the process.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import scipy.sparse  # noqa: E402
import torch  # noqa: E402

from builders import (  # noqa: E402
    planted_data,
    run_around_sae,
    run_from_sae_spec,
    text_spec,
    typed,
    vision_spec,
    write_shards,
)
from saeflow.analysis import inference, summary  # noqa: E402
from saeflow.extraction import extract  # noqa: E402
from saeflow.store import shards  # noqa: E402
from saeflow.store.layout import DumpLayout  # noqa: E402
from saeflow.training import sae, train  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# ||gpu - cpu|| / ||cpu|| over a whole layer: TF32 convolutions in float32, one bfloat16 ulp (2^-8) in bfloat16.
REL_TOL = {"float32": 2e-3, "bfloat16": 3e-2}


def _all_acts(dpath) -> np.ndarray:
    sd = shards.ShardDir(dpath)
    return np.concatenate([np.asarray(sd.acts(i), dtype=np.float64) for i in range(len(sd.shard_sizes))])


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("make_spec", [vision_spec, text_spec], ids=["vit", "gpt2"])
def test_extraction_on_gpu_matches_cpu(tmp_path, make_spec, compute_dtype):
    spec = typed(make_spec(compute_dtype=compute_dtype))
    cpu = extract.extract(spec, tmp_path / "cpu", device="cpu", progress=False)
    gpu = extract.extract(spec, tmp_path / "gpu", device="cuda", progress=False)
    assert cpu.dpath.name == gpu.dpath.name  # the device is not hashed
    provenance = json.loads(shards.ShardDir(gpu.dpath).layout.provenance_fpath.read_text())
    assert provenance["extraction"]["device"].startswith("cuda")
    acts_cpu, acts_gpu = _all_acts(cpu.dpath), _all_acts(gpu.dpath)
    assert acts_cpu.shape == acts_gpu.shape and np.isfinite(acts_gpu).all()
    for li in range(acts_cpu.shape[1]):  # per layer: the deeper one accumulates more rounding
        rel = np.linalg.norm(acts_gpu[:, li] - acts_cpu[:, li]) / np.linalg.norm(acts_cpu[:, li])
        assert rel < REL_TOL[compute_dtype], f"layer index {li}: relative error {rel:.2e}"
    aux = extract.plan(spec).aux_fname
    assert (cpu.dpath / aux).read_bytes() == (gpu.dpath / aux).read_bytes()  # labels / token ids: exact


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True, warn_only=True)  # a kernel without a deterministic variant warns
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("arch", ["topk", "batchtopk"])
def test_training_on_gpu_resumes_exactly(tmp_path, deterministic, arch):
    x_nd, _ = planted_data(4096, d_model=16, n_atoms=32, k=2, seed=1)
    sd = write_shards(tmp_path / "shards", x_nd.reshape(-1, 1, 8, 16), layers=(0,), ex_per_shard=100, tag="gpu")
    spec = dict(arch=arch, k=2, expansion=4, batch_size=32, n_epochs=1, matryoshka=[0.25], dead_after_vectors=512)
    resumed = run_from_sae_spec(tmp_path / "resumed", sd, **spec)
    assert train.train_runs([resumed.root], train.TrainSettings(device="cuda", checkpoint_every=20, max_steps=50)) == []
    state = torch.load(resumed.resume_fpath, weights_only=True)
    assert state["step"] == 50 and state["sae"]["W_dec"].is_cuda  # saved from the GPU, restored onto it
    (result,) = train.train_runs([resumed.root], train.TrainSettings(device="cuda", checkpoint_every=20))
    assert result["step"] == 128
    clean = run_from_sae_spec(tmp_path / "clean", sd, **spec)
    train.train_runs([clean.root], train.TrainSettings(device="cuda", checkpoint_every=10**6))
    resumed_state = sae.load_sae(resumed.sae_fpath).state_dict()
    for name, tensor in sae.load_sae(clean.sae_fpath).state_dict().items():
        assert torch.equal(tensor, resumed_state[name]), name
    assert clean.metrics_log_fpath.read_text() == resumed.metrics_log_fpath.read_text()


def _random_topk_sae(d_model: int, d_sae: int, k: int) -> sae.SAE:
    gen = torch.Generator().manual_seed(0)
    W_dec_sd = torch.nn.functional.normalize(torch.randn(d_sae, d_model, generator=gen), dim=-1)
    b_enc_s = 0.1 * torch.randn(d_sae, generator=gen)
    return sae.SAE.from_weights(W_dec_sd.T.contiguous(), b_enc_s, W_dec_sd, torch.zeros(d_model), arch="topk", k=k)


def test_inference_dump_on_gpu_matches_cpu(tmp_path):
    rng = np.random.default_rng(0)
    acts = rng.standard_normal((40, 1, 9, 24)).astype(np.float32)  # 40 examples, CLS + 8 patches, d 24
    sd = write_shards(tmp_path / "shards", acts, layers=(2,), cls_token=True, ex_per_shard=7)
    model = _random_topk_sae(24, 96, k=6)
    dumps = {}
    for device in ("cpu", "cuda"):
        run = run_around_sae(tmp_path / f"runs-{device}", sd, model, layer=2)
        cfg = inference.InferenceConfig(run.root, sd.dpath, top_k=5, batch_size=64, device=device)
        dumps[device] = inference.run_inference(cfg)
    codes = {dev: scipy.sparse.load_npz(DumpLayout(d).acts_fpath).toarray() for dev, d in dumps.items()}
    assert codes["cpu"].shape == (40 * 9, 96)
    assert np.array_equal(codes["cpu"] > 0, codes["cuda"] > 0)  # the same latents fire (no near-ties here)
    np.testing.assert_allclose(codes["cuda"], codes["cpu"], rtol=1e-4, atol=1e-5)
    cpu, gpu = inference.load_dump(dumps["cpu"]), inference.load_dump(dumps["cuda"])
    for name in ("n_fires", "l0_hist", "topk_example", "topk_token"):
        assert np.array_equal(gpu.latents[name], cpu.latents[name]), name
    for name in ("freq", "mean_act", "max_act", "topk_values"):
        np.testing.assert_allclose(gpu.latents[name], cpu.latents[name], rtol=1e-4, atol=1e-5, err_msg=name)
    gpu_metrics, cpu_metrics = summary.flatten(gpu.metrics), summary.flatten(cpu.metrics)  # all_tokens.* too
    assert gpu_metrics.keys() == cpu_metrics.keys()
    for key, value in cpu_metrics.items():
        assert gpu_metrics[key] == (value if isinstance(value, str) else pytest.approx(value, rel=1e-4, abs=1e-6)), key
