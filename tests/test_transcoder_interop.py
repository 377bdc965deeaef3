"""Transcoder checkpoint interop (issue 35), both directions, without SAELens or sparsify installed.

Imports: transcoders SAELens and sparsify built and saved themselves (tests/fixtures/{saelens,sparsify}/transcoders/
accepted, with each library's own codes, latents' decode and prediction) become saeflow transcoders that compute them
to 1e-5, and their hook names map to saeflow's hook points. Exports: saeflow transcoders (tests/fixtures/.../exported/
<name>/sae.pt) export now to exactly the files the library loaded when the fixtures were written, and the library's
outputs from those files (outputs.npz) equal saeflow's to 1e-5. The regeneration scripts are make_*_transcoders.py.
"""

import json
import pathlib
import shutil

import numpy as np
import pytest
import safetensors.torch
import torch

from builders import write_shards
from saeflow import cli
from saeflow.errors import SaeflowError
from saeflow.extraction import hooks
from saeflow.interop import lmprobe
from saeflow.interop.checkpoints import hooknames, sae_checkpoints
from saeflow.store import runs
from saeflow.store.layout import DumpLayout
from saeflow.training import sae

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
TOL = 1e-5
MLP_1 = {"input": {"hook": "mlp_in", "layer": 1}, "target": {"hook": "mlp_out", "layer": 1}}
# fixture directory -> (saeflow arch, skip path, d_out, the hooks it names)
ACCEPTED = {
    "saelens/transcoders/accepted/transcoder": ("relu", False, 24, MLP_1),
    "saelens/transcoders/accepted/skip-transcoder": ("relu", True, 24, MLP_1),
    "saelens/transcoders/accepted/jumprelu-transcoder": ("jumprelu", False, 24, MLP_1),
    "saelens/transcoders/accepted/jumprelu-skip-transcoder": ("jumprelu", True, 24, MLP_1),
    "saelens/transcoders/accepted/jumprelu-transcoder-negative-threshold": ("jumprelu", False, 24, MLP_1),  # as 0
    "sparsify/transcoders/accepted/transcode/h.1.mlp": ("topk", False, 16, MLP_1),
    "sparsify/transcoders/accepted/transcode-skip/h.1.mlp": ("topk", True, 16, MLP_1),
    "sparsify/transcoders/accepted/skip-connection/layers.1": (  # an SAE with a skip path: a transcoder of its input
        "topk", True, 16, {"input": {"hook": "residual", "layer": 1}, "target": {"hook": "residual", "layer": 1}}),
}  # fmt: skip
EXPORTED = {f"saelens/transcoders/exported/{name}": "saelens" for name in
            ("relu", "relu-skip", "jumprelu", "jumprelu-skip", "batchtopk-skip")}  # fmt: skip
EXPORTED.update({f"sparsify/transcoders/exported/{name}": "sparsify" for name in ("topk", "topk-skip")})
WHERE = {"family": "gpt2", "input": ("mlp_in", 1), "target": ("mlp_out", 1)}  # what the exported fixtures read


def agree(model: sae.SAE, want) -> None:
    """The model's codes, latents' decode and prediction on the fixture's inputs are the library's, to 1e-5."""
    with torch.no_grad():
        y_hat, f_bs = model(torch.from_numpy(want["x"]))
        decoded = model.decode(f_bs)
    assert (want["codes"] > 0).sum(-1).mean() >= 1  # the codes are not trivially empty
    for got, key in ((f_bs, "codes"), (decoded, "decoded"), (y_hat, "recon")):
        np.testing.assert_allclose(got.numpy(), want[key], rtol=TOL, atol=TOL, err_msg=key)


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_library_transcoders_import_with_the_librarys_outputs(name, tmp_path):
    arch, skip, d_out, named = ACCEPTED[name]
    imported = sae_checkpoints.read_checkpoint(FIXTURES / name)
    model = imported.sae()
    assert (model.cfg.arch, model.cfg.skip, model.d_out, model.d_model) == (arch, skip, d_out, 16)
    assert {role: {k: v for k, v in entry.items() if k != "name"} for role, entry in imported.hooks.items()} == named
    with np.load(FIXTURES / name / "outputs.npz") as want:
        agree(model, want)
        sae.save_sae(model, tmp_path / "sae.pt")
        agree(sae.load_sae(tmp_path / "sae.pt"), want)  # a transcoder's sae.pt keeps it


@pytest.mark.parametrize("name", list(EXPORTED))
def test_exports_are_the_files_the_library_computed_saeflows_outputs_from(name, tmp_path):
    fmt = EXPORTED[name]
    model = sae.load_sae(FIXTURES / name / "sae.pt")
    origin = {"run_id": pathlib.Path(name).name, "layer": 1, "scale_folded": 0.37, "target_scale_folded": 1.9}
    out = sae_checkpoints.export_sae(model, fmt, tmp_path / "out", origin, WHERE)
    committed = FIXTURES / name / fmt
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in committed.iterdir())
    assert json.loads((out / "cfg.json").read_text()) == json.loads((committed / "cfg.json").read_text())
    got, want = (safetensors.torch.load_file(next(dpath.glob("*.safetensors"))) for dpath in (out, committed))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    with np.load(FIXTURES / name / "outputs.npz") as library:  # what the library computed from those files
        agree(model, library)
        agree(sae_checkpoints.read_checkpoint(out).sae(), library)  # and the way back


def test_exports_write_the_other_tools_hook_names(tmp_path):
    cfg = json.loads((FIXTURES / "saelens/transcoders/exported/relu-skip/saelens/cfg.json").read_text())
    assert (cfg["architecture"], cfg["d_out"], cfg["apply_b_dec_to_input"]) == ("skip_transcoder", 24, False)
    assert (cfg["metadata"]["hook_name"], cfg["metadata"]["hook_name_out"]) == ("blocks.1.ln2.hook_normalized",
                                                                                  "blocks.1.hook_mlp_out")
    header = lmprobe.read_safetensors_header(FIXTURES / "saelens/transcoders/exported/relu-skip/saelens"
                                             / "sae_weights.safetensors")  # fmt: skip
    assert tuple(header["W_skip"]["shape"]) == (24, 16)  # SAELens's (d_out, d_in)
    cfg = json.loads((FIXTURES / "sparsify/transcoders/exported/topk-skip/sparsify/cfg.json").read_text())
    assert (cfg["transcode"], cfg["skip_connection"], cfg["saeflow"]["hookpoint"]) == (True, True, "h.1.mlp")


HOOK_NAMES = {  # TransformerLens name -> saeflow (hook, layer); None: saeflow stores no such activation
    "blocks.3.hook_resid_post": ("residual", 3), "blocks.3.hook_resid_pre": ("residual", 2),
    "blocks.0.hook_resid_pre": None, "blocks.3.hook_attn_out": ("attn_out", 3), "blocks.3.hook_mlp_out": ("mlp_out", 3),
    "blocks.3.ln2.hook_normalized": ("mlp_in", 3), "blocks.3.hook_mlp_in": ("resid_mid", 3),
    "blocks.3.hook_resid_mid": ("resid_mid", 3),
    "blocks.3.attn.hook_z": None, "hook_embed": None,
}  # fmt: skip
HOOKPOINTS = {  # sparsify hookpoint -> (an SAE's (hook, layer), a transcoder's (input, target))
    "h.3.mlp": (("mlp_out", 3), (("mlp_in", 3), ("mlp_out", 3))),
    "layers.3.mlp/seed1": (("mlp_out", 3), (("mlp_in", 3), ("mlp_out", 3))),
    "layers.3": (("residual", 3), (("residual", 2), ("residual", 3))),
    "h.0": (("residual", 0), (None, ("residual", 0))),
    "h.3.attn": (("attn_out", 3), (None, ("attn_out", 3))),
    "layers.3.self_attn": (("attn_out", 3), (None, ("attn_out", 3))),
    "layers.3.post_attention_layernorm": (("mlp_in", 3), (None, ("mlp_in", 3))),
    "h.3.ln_1": (None, (None, None)),
    "embed_tokens": (None, (None, None)),
}


def test_hook_names_map_both_ways():
    for name, where in HOOK_NAMES.items():
        assert hooknames.from_transformerlens(name) == where, name
        if where is not None and name.endswith(("post", "out", "normalized", "mid")):
            assert hooknames.to_transformerlens(where) == name
    for hookpoint, (sae_where, transcoder_where) in HOOKPOINTS.items():
        assert hooknames.from_sparsify(hookpoint, False) == (sae_where, sae_where), hookpoint
        assert hooknames.from_sparsify(hookpoint, True) == transcoder_where, hookpoint
    to_sparsify = {("gpt2", ("mlp_in", 3), ("mlp_out", 3)): "h.3.mlp", ("llama", ("mlp_in", 3), ("mlp_out", 3)):
                   "layers.3.mlp", ("qwen2", ("residual", 2), ("residual", 3)): "layers.3",
                   ("gpt2", ("attn_out", 3), None): "h.3.attn", ("llama", ("mlp_in", 3), None):
                   "layers.3.post_attention_layernorm", ("gpt2", ("mlp_in", 3), ("attn_out", 3)): None,
                   ("bert", ("mlp_in", 3), ("mlp_out", 3)): None, ("gpt2", ("resid_mid", 3), None): None,
                   ("llama", ("resid_mid", 3), ("mlp_out", 3)): None}  # fmt: skip
    for (family, source, target), want in to_sparsify.items():
        assert hooknames.to_sparsify(family, source, target) == want, (family, source, target)
    circuit_tracer = {"residual": "hook_resid_post", "attn_out": "hook_attn_out", "mlp_out": "hook_mlp_out",
                      "mlp_in": "mlp.hook_in", "resid_mid": "hook_resid_mid"}  # its ReplacementModel's hooks
    assert {hook: hooknames.to_circuit_tracer(hook) for hook in hooks.HOOK_POINTS} == circuit_tracer


def test_exports_saeflow_cannot_map_are_refused_in_one_line(tmp_path):
    def transcoder(arch, d_out=16):
        g = torch.Generator().manual_seed(0)
        extra = {"r_mag": torch.zeros(8), "b_mag": torch.zeros(8)} if arch == "gated" else {}
        return sae.SAE.from_weights(torch.randn(16, 8, generator=g), torch.zeros(8), torch.randn(8, d_out, generator=g),
                                    torch.zeros(d_out), arch=arch, k=2, transcoder=True, extra=extra)  # fmt: skip

    refusals = {
        ("topk", 16, "saelens"): "^SAELens has no architecture that computes a topk transcoder .*: export it with "
                                 "--format sparsify$",
        ("gated", 16, "saelens"): "^SAELens has no architecture that computes a gated transcoder \\(its transcoders "
                                  "are ReLU or JumpReLU\\)$",
        ("relu", 16, "sparsify"): "^sparsify has TopK SAEs only .*this SAE is relu: export it with --format saelens$",
        ("topk", 12, "sparsify"): "^sparsify's transcoders predict a target as wide as their input; this one maps "
                                  "d_model=16 to d_out=12$",
    }  # fmt: skip
    for (arch, d_out, fmt), message in refusals.items():
        with pytest.raises(SaeflowError, match=message):
            sae_checkpoints.export_sae(transcoder(arch, d_out), fmt, tmp_path / "out")
        assert not (tmp_path / "out").exists()


def test_a_saelens_transcoder_with_b_dec_on_its_input_is_refused(tmp_path):
    src = tmp_path / "tc"
    shutil.copytree(FIXTURES / "saelens/transcoders/accepted/transcoder", src)
    cfg = json.loads((src / "cfg.json").read_text())
    (src / "cfg.json").write_text(json.dumps({**cfg, "apply_b_dec_to_input": True}))
    with pytest.raises(SaeflowError, match=f"^{src}: cannot import: apply_b_dec_to_input=true on a transcoder "):
        sae_checkpoints.read_checkpoint(src)
    (src / "cfg.json").write_text(json.dumps({**cfg, "architecture": "topk_skip_transcoder"}))
    with pytest.raises(SaeflowError, match=f"^{src}: cannot import: SAELens architecture 'topk_skip_transcoder' "):
        sae_checkpoints.read_checkpoint(src)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Shards of mlp_in (16 wide) and mlp_out (24 and 16 wide) at layers 0 and 1, the same tokens."""
    root, g = tmp_path_factory.mktemp("pairs"), np.random.default_rng(0)
    x_sd = write_shards(root, g.standard_normal((8, 2, 4, 16)).astype(np.float32), layers=(0, 1), tag="tc",
                        data={"hook": "mlp_in"}, family="gpt2")  # fmt: skip
    targets = {d: write_shards(root, g.standard_normal((8, 2, 4, d)).astype(np.float32), layers=(0, 1), tag="tc",
                               data={"hook": "mlp_out"}, family="gpt2") for d in (24, 16)}  # fmt: skip
    return x_sd, targets


def test_an_imported_transcoder_is_a_run_inference_reads_with_its_targets(pairs, tmp_path, capsys):
    """import-checkpoint with --target-shards: the run names the target, the layer comes from the hook name (the
    shards store two), the hook names are recorded, and inference scores the prediction against the target."""
    x_sd, targets = pairs
    src = FIXTURES / "saelens/transcoders/accepted/skip-transcoder"
    argv = ["import-checkpoint", str(src), "--runs-root", str(tmp_path / "runs"), "--shards", str(x_sd.dpath)]
    assert cli.main(argv) == 1
    assert "give its target's shards (--target-shards DIR" in capsys.readouterr().err
    assert cli.main([*argv, "--target-shards", str(targets[16].dpath)]) == 1
    assert "predicts d_out=24 at layer 1; these target shards store d_model=16" in capsys.readouterr().err
    assert cli.main([*argv, "--target-shards", str(targets[24].dpath)]) == 0
    run = runs.open_run(capsys.readouterr().out.strip())
    config = run.config()
    assert (config["layer"], config["target"], config["d_out"], config["skip"]) == (1, targets[24].hash, 24, True)
    assert config["imported"]["hooks"]["target"] == {"name": "blocks.1.hook_mlp_out", "hook": "mlp_out", "layer": 1}
    assert cli.main(["inference", "--run", str(run.root), "--shards", str(x_sd.dpath), "--top-k", "2"]) == 0
    dump = DumpLayout(run.root / "inference" / x_sd.hash)
    assert json.loads(dump.config_fpath.read_text())["target_hash"] == targets[24].hash
    assert json.loads(dump.metrics_fpath.read_text())["nmse"] > 0
    sae_src = FIXTURES / "saelens/accepted/standard"
    assert cli.main(["import-checkpoint", str(sae_src), "--runs-root", str(tmp_path / "runs"), "--shards",
                     str(x_sd.dpath), "--layer", "1", "--target-shards", str(targets[16].dpath)]) == 1  # fmt: skip
    assert "--target-shards: " in capsys.readouterr().err


def test_a_transcoder_run_exports_with_its_shards_hook_names(pairs, tmp_path):
    """export-checkpoint of a transcoder run names its linked shards' hook points as the other tool does."""
    x_sd, targets = pairs
    for fmt, name, d_out in (("saelens", "relu-skip", 24), ("sparsify", "topk-skip", 16)):
        run = runs.create_run(tmp_path / "runs", {"layer": 1, "train_shards": x_sd.hash, "target": targets[d_out].hash,
                                                  "name": name}, x_sd.dpath, target_shards=(targets[d_out].dpath, None))
        sae.save_sae(sae.load_sae(FIXTURES / fmt / "transcoders/exported" / name / "sae.pt"), run.sae_fpath)
        assert cli.main(["export-checkpoint", "--run", str(run.root), "--format", fmt, str(tmp_path / fmt)]) == 0
        cfg = json.loads((tmp_path / fmt / "cfg.json").read_text())
        ours = cfg["metadata"]["saeflow"] if fmt == "saelens" else cfg["saeflow"]
        assert (ours["hook"], ours["target_hook"], ours["target_scale_folded"]) == (["mlp_in", 1], ["mlp_out", 1],
                                                                                     pytest.approx(1.9))
        if fmt == "saelens":
            assert (cfg["metadata"]["hook_name"], cfg["metadata"]["hook_name_out"]) == (
                "blocks.1.ln2.hook_normalized", "blocks.1.hook_mlp_out")
        else:
            assert ours["hookpoint"] == "h.1.mlp"  # the shards are GPT-2's
        imported = sae_checkpoints.read_checkpoint(tmp_path / fmt)
        assert imported.hooks["target"]["hook"] == "mlp_out" and imported.hooks["input"]["layer"] == 1
