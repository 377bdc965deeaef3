"""SAE checkpoint interop: saeflow SAEs exported to SAELens / sparsify load with those libraries' own loaders and
compute the same codes and reconstructions; SAEs made and saved by those libraries import into runs that
`saeflow inference` and `saeflow visuals` run on."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from builders import run_around_sae, typed
from saeflow import cli, extract, sae, sae_interop
from saeflow.errors import SaeflowError
from saeflow.layout import DumpLayout
from saeflow.shards import ShardDir

SAELENS_VERSION, SPARSIFY_VERSION = "6.54.12", "1.3.3"
# What the two libraries import, installed with --no-deps so pip never replaces the venv's CPU torch.
PEER_PACKAGES = (
    f"sae-lens=={SAELENS_VERSION}", f"eai-sparsify=={SPARSIFY_VERSION}", "transformer-lens==3.9.0", "einops==0.8.2",
    "simple-parsing==0.1.9", "docstring-parser==0.18.0", "natsort==8.4.0", "accelerate==1.15.0",
    "schedulefree==1.4.1", "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19", "xxhash==4.1.0",
    "jaxtyping==0.3.11", "better-abc==0.0.3", "wandb==0.31.0", "protobuf==7.36.2", "opentelemetry-api==1.45.2",
    "opentelemetry-sdk==1.45.2",
)  # fmt: skip
D_MODEL, D_SAE, K = 32, 64, 4
EXPORTS = {"saelens-relu": ("saelens", "relu"), "saelens-topk": ("saelens", "topk"),
           "saelens-batchtopk": ("saelens", "batchtopk"), "sparsify-topk": ("sparsify", "topk")}  # fmt: skip
CREATED = ("saelens-standard", "saelens-topk", "saelens-batchtopk", "sparsify-topk")


@pytest.fixture(scope="session")
def peers_site():
    """SAELens and sparsify (and what they import) installed once with `pip install --target` into a cache."""
    cache = pathlib.Path(os.environ.get("SAEFLOW_TEST_CACHE", pathlib.Path.home() / ".cache" / "saeflow-tests"))
    site = cache / f"sae-lens-{SAELENS_VERSION}+eai-sparsify-{SPARSIFY_VERSION}"
    if not ((site / "sae_lens" / "__init__.py").exists() and (site / "sparsify" / "__init__.py").exists()):
        tmp = cache / f".{site.name}.{os.getpid()}"
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp), *PEER_PACKAGES]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            pytest.skip(f"cannot install sae-lens {SAELENS_VERSION} / eai-sparsify {SPARSIFY_VERSION}: "
                        f"{proc.stderr[-500:]}")  # fmt: skip
        os.replace(tmp, site)
    return site


def saeflow_sae(arch: str, seed: int = 0) -> sae.SAE:
    """Random weights of the size a trained SAE has, with a non-trivial input scale (and threshold)."""
    g = torch.Generator().manual_seed(seed)
    W_dec = torch.randn(D_SAE, D_MODEL, generator=g)
    W_dec /= W_dec.norm(dim=-1, keepdim=True)
    return sae.SAE.from_weights(
        W_dec.T * 0.5, torch.randn(D_SAE, generator=g) * 0.1, W_dec, torch.randn(D_MODEL, generator=g) * 0.1,
        arch=arch, k=K, scale=0.37, threshold=0.2,
    )  # fmt: skip


def inputs(n: int = 64) -> torch.Tensor:
    return torch.randn(n, D_MODEL, generator=torch.Generator().manual_seed(1)) * 3.0


@pytest.fixture(scope="module")
def shards_dpath(tmp_path_factory):
    spec = {
        "model": {"random": {"arch": "vit", "config": {"hidden_size": D_MODEL, "num_hidden_layers": 2,
                                                       "num_attention_heads": 2, "intermediate_size": 64,
                                                       "image_size": 32, "patch_size": 8}}},
        "layers": [1],
        "dataset": {"kind": "generated_images", "n_ex": 6, "size": 48},
    }  # fmt: skip
    return extract.extract(typed(spec), tmp_path_factory.mktemp("shards"), progress=False).dpath


@pytest.fixture(scope="module")
def peers(peers_site, shards_dpath, tmp_path_factory):
    """One subprocess with the libraries: load every export, create (and save) one SAE of each kind; run them all."""
    root = tmp_path_factory.mktemp("sae-interop")
    runs_root = root / "runs"
    load = {}
    for i, (name, (fmt, arch)) in enumerate(EXPORTS.items()):
        run = run_around_sae(runs_root, ShardDir(shards_dpath), saeflow_sae(arch, seed=i), layer=1)
        assert cli.main(["export-sae", "--run", str(run.root), "--format", fmt, str(root / "exports" / name)]) == 0
        load[name] = [fmt, str(root / "exports" / name)]
    np.save(root / "x.npy", inputs().numpy())
    job = {"inputs": str(root / "x.npy"), "out": str(root / "results.npz"), "load": load, "d_in": D_MODEL,
           "d_sae": D_SAE, "k": K, "create": {f"created-{kind}": [kind, str(root / "created" / kind)]
                                              for kind in CREATED}}  # fmt: skip
    (root / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": str(peers_site), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    script = pathlib.Path(__file__).parent / "_sae_peers.py"
    proc = subprocess.run([sys.executable, str(script), str(root / "job.json")], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(root / "results.npz") as npz:
        results = {name: npz[name] for name in npz.files}
    assert list(results["versions"]) == [SAELENS_VERSION, SPARSIFY_VERSION]
    return root, runs_root, results


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_exports_load_in_the_libraries_with_the_same_outputs(peers, name):
    _, _, results = peers
    fmt, arch = EXPORTS[name]
    model = saeflow_sae(arch, seed=list(EXPORTS).index(name))
    with torch.no_grad():
        x_hat, f_bs = model(inputs())
    assert (f_bs > 0).sum(dim=-1).float().mean() > 1  # the codes are not trivially empty
    np.testing.assert_allclose(results[f"{name}.codes"], f_bs.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(results[f"{name}.recon"], x_hat.numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", CREATED)
def test_library_made_saes_import_and_run_through_inference(peers, shards_dpath, kind, capsys):
    root, runs_root, results = peers
    src = root / "created" / kind
    argv = ["import-sae", str(src), "--runs-root", str(runs_root), "--shards", str(shards_dpath)]
    assert cli.main(argv) == 0
    run_dpath = pathlib.Path(capsys.readouterr().out.strip())
    assert cli.main(argv) == 0 and pathlib.Path(capsys.readouterr().out.strip()) == run_dpath  # content-addressed
    config = json.loads((run_dpath / "checkpoint" / "config.json").read_text())
    assert config["layer"] == 1 and config["shards"] == ShardDir(shards_dpath).hash
    assert config["imported"]["format"] == kind.split("-")[0] and len(config["imported"]["weights_sha256"]) == 64
    model = sae.load_sae(run_dpath / "checkpoint" / "sae.pt")
    assert model.cfg.arch == {"saelens-standard": "relu", "saelens-batchtopk": "batchtopk"}.get(kind, "topk")
    with torch.no_grad():
        x_hat, f_bs = model(inputs())
    np.testing.assert_allclose(f_bs.numpy(), results[f"created-{kind}.codes"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(x_hat.numpy(), results[f"created-{kind}.recon"], rtol=0, atol=1e-5)
    assert cli.main(["inference", "--run", str(run_dpath), "--shards", str(shards_dpath), "--top-k", "4"]) == 0
    dump = DumpLayout(run_dpath / "inference" / ShardDir(shards_dpath).hash)
    assert json.loads(dump.metrics_fpath.read_text())["n_vectors"] == 6 * 17
    if kind == "saelens-topk":
        argv = ["visuals", "--run", str(run_dpath), "--selection", "list", "--latents", "0", "1", "--tile-px", "32"]
        assert cli.main(argv) == 0 and dump.index_fpath.exists()


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_export_import_round_trip_without_the_libraries(name, tmp_path):
    fmt, arch = EXPORTS[name]
    model = saeflow_sae(arch)
    back = sae_interop.read_checkpoint(sae_interop.export_sae(model, fmt, tmp_path / name)).sae()
    assert back.cfg.arch == arch and (arch == "relu" or back.cfg.k == K)
    with torch.no_grad():
        for got, want in zip(back(inputs()), model(inputs()), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_refusals(tmp_path):
    with pytest.raises(SaeflowError, match="sparsify has TopK SAEs only"):
        sae_interop.export_sae(saeflow_sae("relu"), "sparsify", tmp_path / "relu")
    assert not (tmp_path / "relu").exists()
    out = sae_interop.export_sae(saeflow_sae("topk"), "saelens", tmp_path / "topk")
    with pytest.raises(SaeflowError, match="already exists"):
        sae_interop.export_sae(saeflow_sae("topk"), "saelens", out)
    with pytest.raises(SaeflowError, match="not a SAELens"):
        sae_interop.read_checkpoint(tmp_path)
    cfg = json.loads((out / "cfg.json").read_text())
    for key, value, match in [("architecture", "gated", "architecture 'gated'"),
                              ("normalize_activations", "layer_norm", "normalize_activations")]:  # fmt: skip
        bad = tmp_path / f"bad-{key}"
        bad.mkdir()
        (bad / "sae_weights.safetensors").symlink_to(out / "sae_weights.safetensors")
        (bad / "cfg.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(SaeflowError, match=match):
            sae_interop.read_checkpoint(bad)
