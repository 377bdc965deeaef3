"""SAE checkpoint interop. Imports: checkpoints SAELens and sparsify wrote themselves (tests/fixtures/saelens,
tests/fixtures/sparsify, each with its regeneration script) become runs whose SAE computes the library's own
codes and reconstructions, and the architectures saeflow cannot represent are refused in one line. Exports:
the files match what the libraries write for the same architecture, and (when PyPI is reachable) the libraries'
own loaders load them and compute saeflow's outputs."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import safetensors.torch
import torch

from builders import pip_site, run_around_sae, typed
from hang import HANG_SEC
from saeflow import cli
from saeflow.errors import SaeflowError
from saeflow.extraction import extract
from saeflow.interop import lmprobe
from saeflow.interop.checkpoints import sae_checkpoints
from saeflow.store.layout import DumpLayout
from saeflow.store.shards import ShardDir
from saeflow.training import archs, objectives, sae
from saeflow.training.specs import TrainConfig

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
SAELENS_VERSION, SPARSIFY_VERSION = "6.54.12", "1.3.3"  # what wrote the fixtures and what the export test installs
# What the two libraries import, installed with --no-deps so pip never replaces the venv's CPU torch.
PEER_PACKAGES = (
    f"sae-lens=={SAELENS_VERSION}", f"eai-sparsify=={SPARSIFY_VERSION}", "transformer-lens==3.9.0", "einops==0.8.2",
    "simple-parsing==0.1.9", "docstring-parser==0.18.0", "natsort==8.4.0", "accelerate==1.15.0",
    "schedulefree==1.4.1", "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19", "xxhash==4.1.0",
    "jaxtyping==0.3.11", "better-abc==0.0.3", "wandb==0.31.0", "protobuf==7.36.2", "opentelemetry-api==1.45.2",
    "opentelemetry-sdk==1.45.2",
)  # fmt: skip
D_MODEL, D_SAE, K = 16, 32, 4  # the fixtures' sizes
# fixture (library, name) -> (saeflow arch, k) it imports as
ACCEPTED = {
    ("saelens", "standard"): ("relu", 1),
    ("saelens", "standard-no-b-dec-on-input"): ("relu", 1),
    ("saelens", "standard-training"): ("relu", 1),
    ("saelens", "topk"): ("topk", K),
    ("saelens", "topk-rescale-acts-by-decoder-norm"): ("topk", K),
    ("saelens", "topk-training"): ("topk", K),
    ("saelens", "batchtopk-training"): ("batchtopk", K),
    ("saelens", "matryoshka-batchtopk-training"): ("batchtopk", K),
    ("saelens", "jumprelu"): ("jumprelu", 1),
    ("saelens", "jumprelu-shared-threshold"): ("jumprelu", 1),  # a JumpReLU: no BatchTopK training metadata
    ("saelens", "jumprelu-training"): ("jumprelu", 1),
    ("saelens", "gated"): ("gated", 1),
    ("saelens", "gated-training"): ("gated", 1),
    ("saelens", "jumprelu-negative-threshold"): ("jumprelu", 1),  # thresholds below 0 import as 0: the same codes
    ("saelens", "gated-no-b-dec-on-input"): ("gated", 1),  # b_gate and b_mag shifted to read x - b_dec
    ("saelens", "matching-pursuit"): ("mp", D_MODEL),  # max_iterations null: d_in steps
    ("saelens", "matching-pursuit-training"): ("mp", K),
    ("saelens", "matching-pursuit-no-b-dec-on-input"): ("mp", D_MODEL),
    ("sparsify", "topk"): ("topk", K),
    ("sparsify", "topk-expansion-factor"): ("topk", K),
    ("sparsify", "topk-multi-topk"): ("topk", K),
    ("sparsify", "topk-unnormalized-decoder"): ("topk", K),
}
# fixture -> the problem its one-line refusal names
REFUSED = {
    ("saelens", "standard-layer-norm"): "normalize_activations='layer_norm': saeflow SAEs have no run-time input "
                                        "normalization; each input is centred and scaled by its own mean and std, "
                                        "which no weights can fold in",
    ("saelens", "topk-expected-average-only-in"): "normalize_activations='expected_average_only_in': saeflow SAEs "
                                                  "have no run-time input normalization; one constant scale: fold it "
                                                  "first (SAELens: sae.fold_activation_norm_scaling_factor)",
    ("saelens", "standard-hook-z"): "hook_z",
    ("saelens", "abstopk"): "SAELens architecture 'abstopk'",
    ("sparsify", "groupmax"): "sparsify activation 'groupmax'",
}
EXPORTS = {"saelens-relu": ("saelens", "relu"), "saelens-topk": ("saelens", "topk"),
           "saelens-batchtopk": ("saelens", "batchtopk"), "sparsify-topk": ("sparsify", "topk"),
           "saelens-jumprelu": ("saelens", "jumprelu"), "saelens-gated": ("saelens", "gated"),
           "saelens-mp": ("saelens", "mp")}  # fmt: skip
# the fixture each library wrote for the architecture an export writes
EXPORT_TWINS = {"saelens-relu": "saelens/accepted/standard", "saelens-topk": "saelens/accepted/topk",
                "saelens-batchtopk": "saelens/accepted/batchtopk-training", "sparsify-topk": "sparsify/accepted/topk",
                "saelens-jumprelu": "saelens/accepted/jumprelu", "saelens-gated": "saelens/accepted/gated",
                "saelens-mp": "saelens/accepted/matching-pursuit"}
# SAELens's matching pursuit pursues raw activations with saeflow's unit decoder rows (training/archs/mp.py), so its
# codes are saeflow's divided by the input scale; its reconstruction is saeflow's.
CODES_IN_INPUT_UNITS = {"saelens-mp"}
# SAELens-saved files exported again by saeflow after their import: SAELens computes its own outputs from the export
REEXPORTS = ("matching-pursuit", "matching-pursuit-training", "matching-pursuit-no-b-dec-on-input")


def fixture_dpath(library: str, name: str, group: str = "accepted") -> pathlib.Path:
    return FIXTURES / library / group / name


def ids(table: dict) -> list[str]:
    return [f"{library}-{name}" for library, name in table]


def saeflow_sae(arch: str, seed: int = 0) -> sae.SAE:
    """Random weights of the size a trained SAE has, with a non-trivial input scale (and threshold)."""
    g = torch.Generator().manual_seed(seed)
    W_dec = torch.randn(D_SAE, D_MODEL, generator=g)
    W_dec /= W_dec.norm(dim=-1, keepdim=True)
    b_enc, b_dec = torch.randn(D_SAE, generator=g) * 0.1, torch.randn(D_MODEL, generator=g) * 0.1
    # the architecture's own parameters, random too (JumpReLU: thresholds 0.05..0.5; Gated: r_mag, b_mag)
    extra = {name: (torch.rand(D_SAE, generator=g) * 0.45 + 0.05).log() if name == "log_threshold"
             else torch.randn(D_SAE, generator=g) * 0.1 for name in archs.get(arch).parameters(D_SAE)}  # fmt: skip
    return sae.SAE.from_weights(W_dec.T * 0.5, b_enc, W_dec, b_dec, arch=arch, k=K, scale=0.37, threshold=0.2,
                                extra=extra)  # fmt: skip


def inputs(n: int = 64) -> torch.Tensor:
    return torch.randn(n, D_MODEL, generator=torch.Generator().manual_seed(1)) * 3.0


@pytest.fixture(scope="module")
def shards_dpath(tmp_path_factory):
    spec = {
        "model": {"random": {"arch": "vit", "config": {"hidden_size": D_MODEL, "num_hidden_layers": 2,
                                                       "num_attention_heads": 2, "intermediate_size": 32,
                                                       "image_size": 32, "patch_size": 8}}},
        "layers": [1],
        "dataset": {"kind": "generated_images", "n_ex": 6, "size": 48},
    }  # fmt: skip
    return extract.extract(typed(spec), tmp_path_factory.mktemp("shards"), progress=False).dpath


# ---------------------------------------------------------------------------------------------------------------
# Imports of checkpoints the libraries wrote
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("library", "name"), list(ACCEPTED), ids=ids(ACCEPTED))
def test_library_checkpoints_import_with_the_librarys_outputs(library, name, shards_dpath, tmp_path, capsys):
    src = fixture_dpath(library, name)
    argv = ["import-sae", str(src), "--runs-root", str(tmp_path / "runs"), "--shards", str(shards_dpath)]
    assert cli.main(argv) == 0
    run_dpath = pathlib.Path(capsys.readouterr().out.strip())
    assert cli.main(argv) == 0 and pathlib.Path(capsys.readouterr().out.strip()) == run_dpath  # content-addressed
    config = json.loads((run_dpath / "checkpoint" / "config.json").read_text())
    assert (config["arch"], config["k"]) == ACCEPTED[library, name]
    assert config["layer"] == 1 and config["shards"] == ShardDir(shards_dpath).hash
    assert config["imported"]["format"] == library and len(config["imported"]["weights_sha256"]) == 64
    model = sae.load_sae(run_dpath / "checkpoint" / "sae.pt")
    with np.load(src / "outputs.npz") as want, torch.no_grad():
        x_hat, f_bs = model(torch.from_numpy(want["x"]))
        np.testing.assert_allclose(f_bs.numpy(), want["codes"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(x_hat.numpy(), want["recon"], rtol=1e-5, atol=1e-5)
    assert cli.main(["inference", "--run", str(run_dpath), "--shards", str(shards_dpath), "--top-k", "4"]) == 0
    dump = DumpLayout(run_dpath / "inference" / ShardDir(shards_dpath).hash)
    metrics = json.loads(dump.metrics_fpath.read_text())  # an imported run trained on tokens: content (no CLS)
    assert (metrics["tokens"], metrics["n_vectors"], metrics["all_tokens"]["n_vectors"]) == ("content", 6 * 16, 6 * 17)
    if (library, name) == ("saelens", "topk"):
        argv = ["visuals", "--run", str(run_dpath), "--selection", "list", "--latents", "0", "1", "--tile-px", "32"]
        assert cli.main(argv) == 0 and dump.index_fpath.exists()


@pytest.mark.parametrize(("library", "name"), list(REFUSED), ids=ids(REFUSED))
def test_library_checkpoints_saeflow_cannot_represent_are_refused_in_one_line(library, name, shards_dpath, tmp_path,
                                                                             capsys):
    src = fixture_dpath(library, name, "refused")
    runs_root = tmp_path / "runs"
    assert cli.main(["import-sae", str(src), "--runs-root", str(runs_root), "--shards", str(shards_dpath)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"saeflow import-sae: error: {src}: cannot import: ") and "\n" not in err, err
    assert REFUSED[library, name] in err
    assert not runs_root.exists() or not list(runs_root.iterdir())


# ---------------------------------------------------------------------------------------------------------------
# Exports
# ---------------------------------------------------------------------------------------------------------------


def _files(dpath: pathlib.Path) -> tuple[dict, dict]:
    """(cfg.json, {tensor: (dtype, shape)}) of a checkpoint directory, read without either library."""
    weights_fpath = next(dpath.glob("*.safetensors"))
    header = lmprobe.read_safetensors_header(weights_fpath)
    return json.loads((dpath / "cfg.json").read_text()), {k: (d["dtype"], d["shape"]) for k, d in header.items()}


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_exports_have_the_files_the_libraries_write(name, tmp_path):
    """Same file names, tensor names, dtypes and shapes, and the library's cfg.json keys with the same values
    (but the saeflow provenance the libraries ignore) as the checkpoint the library saved for that arch."""
    fmt, arch = EXPORTS[name]
    twin_dpath = FIXTURES / EXPORT_TWINS[name]
    out = sae_checkpoints.export_sae(saeflow_sae(arch), fmt, tmp_path / name)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in twin_dpath.iterdir() if p.suffix != ".npz")
    (ours_cfg, ours_tensors), (twin_cfg, twin_tensors) = _files(out), _files(twin_dpath)
    assert ours_tensors == twin_tensors
    ignored = {"metadata", "saeflow"}  # provenance; both loaders ignore it
    if twin_cfg.get("architecture") == "jumprelu":
        ignored.add("k")  # kept for the way back to batchtopk; SAELens drops it
    if twin_cfg.get("architecture") == "matching_pursuit":
        ignored |= {"residual_threshold", "max_iterations"}  # the SAE's own threshold and k
    assert set(ours_cfg) - ignored == set(twin_cfg) - ignored
    ours_only = {"expansion_factor", "normalize_decoder"}  # sparsify: unused beside num_latents; the folded scale
    same = set(twin_cfg) - ignored - ours_only
    assert {k: ours_cfg[k] for k in same} == {k: twin_cfg[k] for k in same}
    if fmt == "sparsify":
        assert ours_cfg["normalize_decoder"] is False and ours_cfg["num_latents"] == D_SAE


@pytest.fixture(scope="session")
def peers_site():
    """SAELens and sparsify (and what they import) installed once with `pip install --target` into a cache."""
    return pip_site(f"sae-lens-{SAELENS_VERSION}+eai-sparsify-{SPARSIFY_VERSION}", list(PEER_PACKAGES),
                    "sparsify/__init__.py")


@pytest.fixture(scope="module")
def loaded_by_the_libraries(peers_site, shards_dpath, tmp_path_factory):
    """One subprocess with the libraries loads every export with their own loaders and runs it on `inputs()`."""
    root = tmp_path_factory.mktemp("sae-interop")
    load = {}
    for i, (name, (fmt, arch)) in enumerate(EXPORTS.items()):
        run = run_around_sae(root / "runs", ShardDir(shards_dpath), saeflow_sae(arch, seed=i), layer=1)
        assert cli.main(["export-sae", "--run", str(run.root), "--format", fmt, str(root / "exports" / name)]) == 0
        load[name] = [fmt, str(root / "exports" / name)]
    for name in REEXPORTS:
        imported = sae_checkpoints.read_checkpoint(fixture_dpath("saelens", name)).sae()
        load[f"reexport-{name}"] = ["saelens", str(sae_checkpoints.export_sae(imported, "saelens",
                                                                              root / "reexports" / name))]  # fmt: skip
        load[f"original-{name}"] = ["saelens", str(fixture_dpath("saelens", name))]
    np.save(root / "x.npy", inputs().numpy())
    job = {"inputs": str(root / "x.npy"), "out": str(root / "results.npz"), "load": load}
    (root / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": str(peers_site), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    script = pathlib.Path(__file__).parent / "_sae_peers.py"
    proc = subprocess.run([sys.executable, str(script), str(root / "job.json")], capture_output=True, text=True,
                          env=env, timeout=HANG_SEC)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(root / "results.npz") as npz:
        results = {name: npz[name] for name in npz.files}
    assert list(results["versions"]) == [SAELENS_VERSION, SPARSIFY_VERSION]
    return results


@pytest.mark.parametrize("name", sorted(EXPORTS))
@pytest.mark.slow
def test_exports_load_in_the_libraries_with_the_same_outputs(loaded_by_the_libraries, name):
    fmt, arch = EXPORTS[name]
    model = saeflow_sae(arch, seed=list(EXPORTS).index(name))
    with torch.no_grad():
        x_hat, f_bs = model(inputs())
    assert (f_bs > 0).sum(dim=-1).float().mean() > 1  # the codes are not trivially empty
    want_codes = f_bs / model.scale if name in CODES_IN_INPUT_UNITS else f_bs
    np.testing.assert_allclose(loaded_by_the_libraries[f"{name}.codes"], want_codes.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(loaded_by_the_libraries[f"{name}.recon"], x_hat.numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", REEXPORTS)
@pytest.mark.slow
def test_saelens_files_imported_and_exported_again_give_saelens_its_own_outputs(loaded_by_the_libraries, name):
    """Both ways on files SAELens saved: imported (`test_library_checkpoints_import_with_the_librarys_outputs`), then
    exported by saeflow, SAELens's own loader computes from the export the codes and reconstruction it computes from
    its own file, to 1e-5."""
    for key in ("codes", "recon"):
        np.testing.assert_allclose(loaded_by_the_libraries[f"reexport-{name}.{key}"],
                                   loaded_by_the_libraries[f"original-{name}.{key}"], rtol=0, atol=1e-5)  # fmt: skip
    assert (loaded_by_the_libraries[f"original-{name}.codes"] > 0).sum(-1).mean() > 1  # not trivially empty


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_export_import_round_trip_without_the_libraries(name, tmp_path):
    fmt, arch = EXPORTS[name]
    model = saeflow_sae(arch)
    back = sae_checkpoints.read_checkpoint(sae_checkpoints.export_sae(model, fmt, tmp_path / name)).sae()
    assert back.cfg.arch == arch and (not archs.get(arch).uses_k or back.cfg.k == K)
    with torch.no_grad():
        (got_recon, got_codes), (want_recon, want_codes) = back(inputs()), model(inputs())
    torch.testing.assert_close(got_recon, want_recon, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_codes, want_codes / model.scale if name in CODES_IN_INPUT_UNITS else want_codes,
                               rtol=0, atol=1e-5)  # fmt: skip


# SAELens-saved checkpoints saeflow represents after a change of parameters -> the outputs.npz key of decode(codes)
REPARAMETRIZED = {"saelens/accepted/jumprelu-negative-threshold": "recon",
                  "saelens/accepted/gated-no-b-dec-on-input": "recon",
                  "saelens/transcoders/accepted/jumprelu-transcoder-negative-threshold": "decoded"}  # fmt: skip


def _reexported(name: str, out_dpath: pathlib.Path) -> pathlib.Path:
    """The SAELens checkpoint imported, then exported again by saeflow."""
    return sae_checkpoints.export_sae(sae_checkpoints.read_checkpoint(FIXTURES / name).sae(), "saelens", out_dpath)


@pytest.mark.parametrize("name", list(REPARAMETRIZED))
def test_reparametrized_checkpoints_export_back_with_the_librarys_codes(name, tmp_path):
    """Negative JumpReLU thresholds and a Gated SAE without apply_b_dec_to_input import as saeflow's parameters
    (threshold 0; b_gate and b_mag shifted) and export as SAELens files of that form computing SAELens's codes."""
    out = _reexported(name, tmp_path / "out")
    cfg = json.loads((out / "cfg.json").read_text())
    tensors = safetensors.torch.load_file(out / "sae_weights.safetensors")
    assert cfg["apply_b_dec_to_input"] is not cfg["architecture"].endswith("transcoder")  # an SAE's reads x - b_dec
    assert "threshold" not in tensors or float(tensors["threshold"].min()) == 0.0
    with np.load(FIXTURES / name / "outputs.npz") as want, torch.no_grad():
        model = sae_checkpoints.read_checkpoint(out).sae()
        codes = model.encode(torch.from_numpy(want["x"]))
        np.testing.assert_allclose(codes.numpy(), want["codes"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(model.decode(codes).numpy(), want[REPARAMETRIZED[name]], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_reparametrized_checkpoints_reexported_load_in_saelens_with_its_codes(peers_site, tmp_path):
    """The same exports, loaded by SAELens's own `SAE.load_from_disk`: its codes and decode equal those SAELens
    computed from the checkpoint it saved, to 1e-5."""
    load = {pathlib.Path(name).name: ["saelens", str(_reexported(name, tmp_path / str(i)))]
            for i, name in enumerate(REPARAMETRIZED)}  # fmt: skip
    x = np.load(FIXTURES / next(iter(REPARAMETRIZED)) / "outputs.npz")["x"]
    assert all(np.array_equal(np.load(FIXTURES / name / "outputs.npz")["x"], x) for name in REPARAMETRIZED)
    np.save(tmp_path / "x.npy", x)
    job = {"inputs": str(tmp_path / "x.npy"), "out": str(tmp_path / "results.npz"), "load": load}
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": str(peers_site), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    script = pathlib.Path(__file__).parent / "_sae_peers.py"
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "job.json")], capture_output=True, text=True,
                          env=env, timeout=HANG_SEC)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(tmp_path / "results.npz") as got:
        for name, decoded in REPARAMETRIZED.items():
            key = pathlib.Path(name).name
            with np.load(FIXTURES / name / "outputs.npz") as want:
                np.testing.assert_allclose(got[f"{key}.codes"], want["codes"], rtol=0, atol=1e-5, err_msg=name)
                np.testing.assert_allclose(got[f"{key}.recon"], want[decoded], rtol=0, atol=1e-5, err_msg=name)


def test_refusals(tmp_path):
    for name in archs.REGISTRY:  # every architecture sparsify cannot represent: one line, nothing written
        if archs.get(name).sparsify is None:
            with pytest.raises(SaeflowError, match=rf"^sparsify has TopK SAEs only .*this SAE is {name}: export it "
                                                   "with --format saelens$"):  # fmt: skip
                sae_checkpoints.export_sae(saeflow_sae(name), "sparsify", tmp_path / name)
            assert not (tmp_path / name).exists()
    out = sae_checkpoints.export_sae(saeflow_sae("topk"), "saelens", tmp_path / "topk")
    with pytest.raises(SaeflowError, match="already exists"):
        sae_checkpoints.export_sae(saeflow_sae("topk"), "saelens", out)
    with pytest.raises(SaeflowError, match="not a SAELens"):
        sae_checkpoints.read_checkpoint(tmp_path)


def test_a_run_root_is_refused_naming_the_sae_directories_it_holds(tmp_path, capsys):
    """Issue 33: a sparsify Trainer run's root (its own cfg.json beside one directory per hookpoint, each as
    `save_to_disk` wrote it) was hinted "SAE subdirectories ['cfg.json', 'cfg.json']", and a root of several seeds
    (one level further down) got no hint at all."""
    run_root = tmp_path / "sparsify-run"
    for hookpoint in ("layers.0", "layers.1"):
        shutil.copytree(FIXTURES / "sparsify" / "accepted" / "topk", run_root / hookpoint)
    (run_root / "cfg.json").write_text(json.dumps({"hookpoints": ["layers.0", "layers.1"]}))
    argv = ["import-checkpoint", str(run_root), "--runs-root", str(tmp_path / "runs"), "--shards", str(tmp_path)]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "it holds SAE directories layers.0, layers.1: give one of them" in err, err
    seeds_root = tmp_path / "seeds"
    for seed in ("seed0", "seed1"):
        shutil.copytree(run_root, seeds_root / seed)
    with pytest.raises(SaeflowError, match="holds SAE directories seed0/layers.0, seed0/layers.1, seed1/layers.0, "):
        sae_checkpoints.read_checkpoint(seeds_root)


# ---------------------------------------------------------------------------------------------------------------
# Training losses against SAELens's own, on its own checkpoints
# ---------------------------------------------------------------------------------------------------------------

# fixture, its loss in outputs.npz -> the saeflow training keys that ask for SAELens's (make_saelens_jumprelu_gated.py)
LOSSES = {
    ("jumprelu-training", "loss_step"): dict(arch="jumprelu", jumprelu_loss="step", l0_coeff=0.7, bandwidth=0.05),
    ("jumprelu-training", "loss_tanh"): dict(arch="jumprelu", jumprelu_loss="tanh", tanh_coeff=0.7, tanh_scale=4.0,
                                             pre_act_coeff=0.3),
    ("gated-training", "loss"): dict(arch="gated", gated_loss="l1", gate_l1_coeff=0.7),
}


@pytest.mark.parametrize(("name", "key"), list(LOSSES), ids=[f"{n}-{k}" for n, k in LOSSES])
def test_training_loss_equals_saelens_on_its_own_checkpoint(name, key):
    """saeflow's one-process training loss (objectives.Objective, no warm-up, AuxK off) on SAELens's weights and
    inputs, with SAELens's dead-latent mask, equals SAELens's `training_forward_pass` loss to 1e-5."""
    src = fixture_dpath("saelens", name)
    model = sae_checkpoints.read_checkpoint(src).sae().train()
    cfg = TrainConfig.from_dict({
        "trainer": "saeflow-train-3", "train_shards": "a" * 64, "val_shards": "a" * 64, "layer": 0, "tokens": "all",
        "expansion": 2, "k": 1, "matryoshka": [], "l1_coeff": 3.0, "aux_k": 8, "aux_alpha": 0.0,
        "dead_after_vectors": None, "lr": None, "lr_warmup_frac": 0.0, "sparsity_warmup_frac": 0.0,
        "batch_size": 24, "n_epochs": 1, "n_train_vectors": None, "n_val_vectors": None, "seed": 0, "data_seed": 0,
        **LOSSES[name, key]}, name)  # fmt: skip
    with np.load(src / "outputs.npz") as want:
        dead = objectives.DeadLatents(D_SAE, 1, torch.device("cpu"))
        dead.since_fired_s.copy_(torch.from_numpy(want["dead"]).long() if "dead" in want.files else 0)
        loss = objectives.Objective(cfg, 100)(model, torch.from_numpy(want["x"]), 50, dead)
        assert float(loss.total) == pytest.approx(float(want[key]), rel=1e-5)
