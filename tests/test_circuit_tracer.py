"""Transcoder sets out to circuit-tracer 0.5.0 (interop/checkpoints/circuit_tracer.py, docs/interop.md): a tiny random
GPT-2 saved as `gpt2` in a Hugging Face cache, its mlp_in and mlp_out (and resid_mid) extracted and a transcoder
trained per layer by saeflow, exported with `saeflow export-checkpoint --format circuit-tracer`, then loaded by
circuit-tracer's own loader in a subprocess (its pinned packages on PYTHONPATH: it needs transformers 4.57): its
transcoders compute saeflow's outputs to 1e-5, and `attribute()` builds an attribution graph whose replacement score
is reported. What circuit-tracer cannot load is refused in one line, before OUT exists. Back in: sets circuit-tracer
saved itself import a layer at a time and compute its outputs; hostile ones are refused in one line."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import huggingface_hub.constants
import numpy as np
import pytest
import safetensors.torch
import torch
import yaml

from builders import HANG_SEC, pip_site, run_from_sae_spec, run_of_clt, typed, write_shards
from saeflow import cli
from saeflow.errors import SaeflowError
from saeflow.extraction import extract
from saeflow.interop.checkpoints import circuit_tracer, circuit_tracer_clt
from saeflow.store import runs, shards
from saeflow.training import clt, sae, train
from saeflow.training.entry import train_runs
from workflow_helpers import CORPUS, hf_cache_repo

CIRCUIT_TRACER_VERSION = "0.5.0"
# What circuit-tracer 0.5.0 imports beyond saeflow's venv, resolved by pip in a clean venv beside torch 2.13.0 and
# installed here with --no-deps (so pip never touches the CPU torch): its own transformers, huggingface_hub and
# tokenizers (it needs transformers <= 4.57.3) shadow saeflow's on the subprocess's PYTHONPATH.
PACKAGES = (
    f"circuit-tracer=={CIRCUIT_TRACER_VERSION}", "nnsight==0.7.0", "transformer-lens==3.2.1", "transformers==4.57.3",
    "huggingface_hub==0.36.2", "tokenizers==0.22.2", "datasets==5.0.1", "accelerate==1.16.0", "einops==0.8.2",
    "fancy-einsum==0.0.3", "jaxtyping==0.3.11", "wadler_lindig==0.1.8", "beartype==0.23.1", "better-abc==0.0.3",
    "typeguard==4.6.1", "sentencepiece==0.2.3", "transformers-stream-generator==0.0.5", "astor==0.8.1", "toml==0.10.2",
    "zstandard==0.25.0", "python-socketio==5.18.1", "python-engineio==4.15.1", "bidict==0.24.1",
    "simple-websocket==1.1.0", "wsproto==1.3.2", "websocket-client==1.9.2", "aiohttp==3.14.5",
    "aiohappyeyeballs==2.7.1", "aiosignal==1.4.0", "frozenlist==1.8.0", "multidict==7.2.1", "propcache==0.5.4",
    "yarl==1.25.1", "ipython==9.18.1", "ipython_pygments_lexers==1.1.1", "jedi==0.20.1", "parso==0.8.7",
    "matplotlib-inline==0.2.2", "pexpect==4.9.0", "ptyprocess==0.7.0", "prompt_toolkit==3.0.53", "wcwidth==0.9.4",
    "stack-data==0.6.3", "asttokens==3.0.2", "executing==2.3.0", "pure_eval==0.2.4",
)  # fmt: skip
N_LAYERS, D_MODEL = 2, 32


def save_gpt2(dpath: pathlib.Path) -> None:
    """A 2-block GPT-2 at d=32, random (seed 0), with a byte-level BPE; `<|endoftext|>` is id 1 (TransformerLens
    takes a BOS of 0 for none) and config.json carries `n_ctx`, which TransformerLens reads."""
    import tokenizers
    import transformers

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([CORPUS], trainer)
    tok = transformers.GPT2TokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                         unk_token="<|endoftext|>", pad_token="<pad>")  # fmt: skip
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=len(tok), n_embd=D_MODEL, n_layer=N_LAYERS, n_head=4, n_positions=64,
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    cfg.n_ctx = cfg.n_positions
    transformers.GPT2LMHeadModel(cfg).save_pretrained(dpath)
    tok.save_pretrained(dpath)


@pytest.fixture(scope="module")
def gpt2_set(tmp_path_factory):
    """The HF cache, and a transcoder set per input hook point: {hook: [run per layer]} (relu at layer 0, jumprelu
    at layer 1, from mlp_in; batchtopk at both from resid_mid), trained on the extracted shards."""
    root = tmp_path_factory.mktemp("circuit-tracer")
    save_gpt2(root / "saved")
    hub = root / "hub"
    hf_cache_repo(hub, "gpt2", root / "saved")
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        mp.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))  # read at its import
        spec = {"model": {"name": "gpt2"}, "layers": list(range(N_LAYERS)), "context_length": 16, "batch_size": 8,
                "dataset": {"kind": "builtin_text", "n_ex": 48}, "device": "cpu"}  # fmt: skip
        hooks_ = ("mlp_in", "resid_mid", "mlp_out")
        results = extract.extract_pass([typed({**spec, "hook": hook}) for hook in hooks_], root / "shards",
                                       progress=False)  # fmt: skip
        sds = {hook: shards.ShardDir(r.dpath) for hook, r in zip(hooks_, results)}
        archs_ = {"mlp_in": ("relu", "jumprelu"), "resid_mid": ("batchtopk", "batchtopk")}
        sets = {}
        for source, per_layer in archs_.items():
            sets[source] = [run_from_sae_spec(root / "runs", sds[source], target_sd=sds["mlp_out"], layer=layer,
                                              arch=arch, k=4, expansion=2, batch_size=64, n_epochs=2)
                            for layer, arch in enumerate(per_layer)]  # fmt: skip
            train.train_runs([run.root for run in sets[source]], train.TrainSettings(device="cpu"))
        yield root, env, sds, sets


@pytest.fixture(scope="module")
def circuit_tracer_site():
    return pip_site(f"circuit-tracer-{CIRCUIT_TRACER_VERSION}", list(PACKAGES), "circuit_tracer/__init__.py")


def export(runs_, out: pathlib.Path) -> int:
    return cli.main(["export-checkpoint", "--format", "circuit-tracer", *[a for r in runs_ for a in ("--run", str(r))],
                     str(out)])  # fmt: skip


def run_peer(job_fpath: pathlib.Path, job: dict, env: dict, site: pathlib.Path) -> dict:
    """tests/_circuit_tracer_peer.py on `job` in circuit-tracer's packages: its results.npz, by name."""
    job_fpath.write_text(json.dumps(job))
    script = pathlib.Path(__file__).parent / "_circuit_tracer_peer.py"
    proc = subprocess.run([sys.executable, str(script), str(job_fpath)], capture_output=True, text=True,
                          env={**os.environ, **env, "PYTHONPATH": str(site)}, timeout=HANG_SEC)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(job["out"]) as npz:
        return {name: npz[name] for name in npz.files}


@pytest.mark.parametrize("source", ["mlp_in", "resid_mid"])
def test_circuit_tracer_loads_an_exported_set_computes_its_outputs_and_builds_a_graph(gpt2_set, circuit_tracer_site,
                                                                                        source):
    root, env, sds, sets = gpt2_set
    out = root / f"export-{source}"
    assert export([run.root for run in sets[source]], out) == 0
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["model_kind"] == "transcoder_set"
    assert (config["feature_input_hook"], config["feature_output_hook"]) == (
        {"mlp_in": "mlp.hook_in", "resid_mid": "hook_resid_mid"}[source], "hook_mlp_out")
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "layer_0.safetensors", "layer_1.safetensors"]

    inputs, want = {}, {}
    for layer, run in enumerate(sets[source]):
        x_nd = torch.from_numpy(np.stack([sds[source].example(i, layer) for i in range(8)])).reshape(-1, D_MODEL)
        np.save(root / f"x{layer}.npy", x_nd.numpy())
        inputs[layer] = str(root / f"x{layer}.npy")
        with torch.no_grad():
            want[layer] = sae.load_sae(run.sae_fpath)(x_nd)[0].numpy()
    tokens = np.asarray(sds[source].aux("tokens.bin")[0], dtype=np.int64).tolist()  # example 0's ids, as extracted
    job = {"model": "gpt2", "transcoders": str(out.resolve()), "inputs": inputs, "out": str(root / "results.npz"),
           "prompt": "the quick brown fox jumps over the lazy dog", "tokens": tokens}  # fmt: skip
    got = run_peer(root / "job.json", job, env, circuit_tracer_site)
    assert str(got["version"]) == CIRCUIT_TRACER_VERSION
    for layer in want:
        np.testing.assert_allclose(got[f"layer{layer}"], want[layer], atol=1e-5, rtol=0)
        assert np.abs(want[layer]).max() > 1e-3  # not an all-zero transcoder
    for layer in range(N_LAYERS):  # circuit-tracer's hooks read and replace the tensors saeflow stores
        for hook, sd in ((config["feature_input_hook"], sds[source]), (config["feature_output_hook"], sds["mlp_out"])):
            np.testing.assert_allclose(got[f"hook:blocks.{layer}.{hook}"], sd.example(0, layer), atol=1e-5, rtol=0)
    assert got["n_features"] > 0 and got["adjacency_nonzero"] > 0  # a graph with feature nodes and edges
    assert 0.0 <= float(got["replacement"]) <= 1.0 and 0.0 <= float(got["completeness"]) <= 1.0
    print(f"circuit-tracer {source} set: replacement {float(got['replacement']):.3f}, completeness "
          f"{float(got['completeness']):.3f}, {int(got['n_features'])} features")


def test_circuit_tracer_loads_an_exported_clt_computes_its_outputs_and_builds_a_graph(gpt2_set, circuit_tracer_site):
    """One JumpReLU cross-layer transcoder over both layers (resid_mid -> mlp_out), trained by saeflow, exported as
    circuit-tracer's CLT: its loader computes saeflow's predictions at every layer to 1e-5, and its replacement model
    builds a graph. A TopK CLT is refused in one line, before OUT exists."""
    root, env, sds, _ = gpt2_set
    mid, out_sd = sds["resid_mid"], sds["mlp_out"]
    run = run_of_clt(root / "clt-runs", [mid, mid], [out_sd, out_sd], layers=[0, 1], arch="jumprelu", expansion=2,
                     batch_size=64, n_epochs=3)  # fmt: skip
    train_runs([run.root], train.TrainSettings(device="cpu"))
    out = root / "export-clt"
    assert export([run.root], out) == 0
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert (config["model_kind"], config["feature_input_hook"]) == ("cross_layer_transcoder", "hook_resid_mid")
    assert sorted(p.name for p in out.iterdir()) == ["W_dec_0.safetensors", "W_dec_1.safetensors",
                                                     "W_enc_0.safetensors", "W_enc_1.safetensors", "config.yaml"]
    xs = [torch.from_numpy(np.stack([mid.example(i, layer) for i in range(8)])).reshape(-1, D_MODEL)
          for layer in range(N_LAYERS)]  # fmt: skip
    inputs = {}
    for layer, x_nd in enumerate(xs):
        np.save(root / f"clt-x{layer}.npy", x_nd.numpy())
        inputs[layer] = str(root / f"clt-x{layer}.npy")
    want, _ = clt.load_clt(run.sae_fpath)(xs)
    job = {"model": "gpt2", "transcoders": str(out.resolve()), "inputs": inputs, "out": str(root / "clt.npz"),
           "prompt": "the quick brown fox jumps over the lazy dog", "tokens": [1, 2, 3]}  # fmt: skip
    got = run_peer(root / "clt-job.json", job, env, circuit_tracer_site)
    for layer in range(N_LAYERS):
        np.testing.assert_allclose(got[f"layer{layer}"], want[layer].numpy(), atol=1e-5, rtol=0)
        assert np.abs(want[layer].numpy()).max() > 1e-3
    assert got["n_features"] > 0 and got["adjacency_nonzero"] > 0
    assert 0.0 <= float(got["replacement"]) <= 1.0 and 0.0 <= float(got["completeness"]) <= 1.0
    print(f"circuit-tracer CLT: replacement {float(got['replacement']):.3f}, completeness "
          f"{float(got['completeness']):.3f}, {int(got['n_features'])} features")
    topk = run_of_clt(root / "clt-runs", [mid, mid], [out_sd, out_sd], layers=[0, 1], arch="topk", k=4,
                      expansion=2, batch_size=64, n_epochs=1)  # fmt: skip
    train_runs([topk.root], train.TrainSettings(device="cpu"))
    with pytest.raises(SaeflowError, match="a topk CLT; circuit-tracer's CLTs compute ReLU and JumpReLU"):
        circuit_tracer_clt.export_clt(topk.root, root / "export-topk")
    assert not (root / "export-topk").exists()


def save_llama(dpath: pathlib.Path) -> None:
    """A 2-block Llama at d=32, random (seed 0), with a byte-level BPE saved as a PreTrainedTokenizerFast (which both
    saeflow's transformers and circuit-tracer's 4.57 load)."""
    import tokenizers
    import transformers

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([CORPUS], trainer)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                                               pad_token="<pad>")  # fmt: skip
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=D_MODEL, intermediate_size=64,
                                   num_hidden_layers=N_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(dpath)
    tok.save_pretrained(dpath)
    tok_cfg_fpath = dpath / "tokenizer_config.json"  # transformers 5 names its own backend class, 4.57 has none
    tok_cfg_fpath.write_text(json.dumps({**json.loads(tok_cfg_fpath.read_text()),
                                         "tokenizer_class": "PreTrainedTokenizerFast"}))  # fmt: skip


def test_circuit_tracer_traces_a_tiny_llama_through_nnsight(tmp_path, circuit_tracer_site):
    """A Llama-family model in a local directory goes through circuit-tracer's nnsight backend (nnsight 0.7.0):
    saeflow extracts it, trains a ReLU transcoder per layer, exports; circuit-tracer computes saeflow's outputs and
    builds an attribution graph."""
    save_llama(tmp_path / "llama")
    spec = {"model": {"name": str(tmp_path / "llama")}, "layers": list(range(N_LAYERS)), "context_length": 16,
            "batch_size": 8, "dataset": {"kind": "builtin_text", "n_ex": 48}, "device": "cpu"}  # fmt: skip
    results = extract.extract_pass([typed({**spec, "hook": hook}) for hook in ("mlp_in", "mlp_out")],
                                   tmp_path / "shards", progress=False)  # fmt: skip
    sd_in, sd_out = (shards.ShardDir(r.dpath) for r in results)
    members = [run_from_sae_spec(tmp_path / "runs", sd_in, target_sd=sd_out, layer=layer, arch="relu", expansion=2,
                                 batch_size=64, n_epochs=2) for layer in range(N_LAYERS)]  # fmt: skip
    train.train_runs([run.root for run in members], train.TrainSettings(device="cpu"))
    assert export([run.root for run in members], tmp_path / "set") == 0
    inputs, want = {}, {}
    for layer, run in enumerate(members):
        x_nd = torch.from_numpy(np.stack([sd_in.example(i, layer) for i in range(8)])).reshape(-1, D_MODEL)
        np.save(tmp_path / f"x{layer}.npy", x_nd.numpy())
        inputs[layer] = str(tmp_path / f"x{layer}.npy")
        with torch.no_grad():
            want[layer] = sae.load_sae(run.sae_fpath)(x_nd)[0].numpy()
    job = {"model": str(tmp_path / "llama"), "backend": "nnsight", "transcoders": str((tmp_path / "set").resolve()),
           "inputs": inputs, "out": str(tmp_path / "results.npz"), "prompt": "the quick brown fox"}  # fmt: skip
    got = run_peer(tmp_path / "job.json", job, {"HF_HUB_OFFLINE": "1"}, circuit_tracer_site)
    for layer in want:
        np.testing.assert_allclose(got[f"layer{layer}"], want[layer], atol=1e-5, rtol=0)
    assert got["n_features"] > 0 and got["adjacency_nonzero"] > 0
    assert 0.0 <= float(got["replacement"]) <= 1.0
    print(f"circuit-tracer nnsight llama set: replacement {float(got['replacement']):.3f}, completeness "
          f"{float(got['completeness']):.3f}, {int(got['n_features'])} features")


def test_what_circuit_tracer_cannot_load_is_refused_in_one_line(gpt2_set, capsys):
    root, _, sds, sets = gpt2_set
    out = root / "refused"
    topk = run_from_sae_spec(root / "runs", sds["mlp_in"], target_sd=sds["mlp_out"], layer=1, arch="topk", k=4,
                             expansion=2, batch_size=64, n_epochs=1)  # fmt: skip
    an_sae = run_from_sae_spec(root / "runs", sds["mlp_out"], layer=0, arch="relu", expansion=2, batch_size=64,
                               n_epochs=1)  # fmt: skip
    train.train_runs([topk.root, an_sae.root], train.TrainSettings(device="cpu"))
    layer0, layer1 = (run.root for run in sets["mlp_in"])
    cases = {
        (layer0, topk.root): "a topk transcoder; circuit-tracer's files hold ReLU and JumpReLU transcoders",
        (an_sae.root,): "an SAE, not a transcoder",
        (layer1,): "no run for layer 0: circuit-tracer needs a transcoder for every layer from 0 up",
        (layer0, layer0): "a second run for layer 0",
        (layer0, sets["resid_mid"][1].root): "the runs read different hook points (mlp_in, resid_mid)",
    }
    for runs_, message in cases.items():
        capsys.readouterr()
        assert export(runs_, out) == 1
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and message in err, err
        assert not out.exists()
    assert cli.main(["export-checkpoint", "--format", "saelens", "--run", str(layer0), "--run", str(layer1),
                     str(out)]) == 1  # fmt: skip
    assert "--format saelens writes one run; got --run 2 times" in capsys.readouterr().err


FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "circuit_tracer" / "sets"


@pytest.fixture(scope="module")
def layer_shards(tmp_path_factory):
    """mlp_in and mlp_out shards (d 16) of layers 0 and 1, for the imported transcoders to read and predict."""
    root, g = tmp_path_factory.mktemp("ct-import"), np.random.default_rng(0)
    return {hook: write_shards(root, g.standard_normal((8, 2, 4, 16)).astype(np.float32), layers=(0, 1), tag="ct",
                               data={"hook": hook}, family="gpt2") for hook in ("mlp_in", "mlp_out")}  # fmt: skip


@pytest.mark.parametrize("name", ["relu", "jumprelu", "jumprelu-skip"])
def test_a_set_circuit_tracer_saved_imports_a_layer_at_a_time_and_computes_its_outputs(name, layer_shards, tmp_path,
                                                                                      capsys):  # fmt: skip
    """Sets circuit-tracer 0.5.0 built and saved itself (tests/fixtures/circuit_tracer/make_circuit_tracer_sets.py):
    each layer imports as a run (the format detected), whose codes and prediction equal circuit-tracer's own to 1e-5,
    with its hook names mapped back; exported again, the files hold the same tensors."""
    src = FIXTURES / name
    outputs = np.load(src / "outputs.npz")
    x = torch.from_numpy(outputs["x"])
    for layer in (0, 1):
        argv = ["import-checkpoint", str(src), "--layer", str(layer), "--runs-root", str(tmp_path / "runs"),
                "--shards", str(layer_shards["mlp_in"].dpath), "--target-shards", str(layer_shards["mlp_out"].dpath)]
        assert cli.main(argv) == 0
        run = runs.open_run(capsys.readouterr().out.strip())
        config = run.config()
        assert config["arch"] == ("jumprelu" if name.startswith("jumprelu") else "relu") and config["layer"] == layer
        assert config["skip"] == name.endswith("skip") and config["imported"]["format"] == "circuit-tracer"
        assert config["imported"]["hooks"] == {
            "input": {"name": f"blocks.{layer}.mlp.hook_in", "hook": "mlp_in", "layer": layer},
            "target": {"name": f"blocks.{layer}.hook_mlp_out", "hook": "mlp_out", "layer": layer}}
        model = sae.load_sae(run.sae_fpath)
        with torch.no_grad():
            recon, codes = model(x)[0], model.encode(x)
        np.testing.assert_allclose(recon.numpy(), outputs[f"recon{layer}"], atol=1e-5, rtol=0)
        np.testing.assert_allclose(codes.numpy(), outputs[f"codes{layer}"], atol=1e-5, rtol=0)
        again = circuit_tracer.layer_tensors(model)
        theirs = safetensors.torch.load_file(src / f"layer_{layer}.safetensors")
        assert set(again) == set(theirs)
        for key, tensor in theirs.items():
            torch.testing.assert_close(again[key], tensor, atol=1e-6, rtol=0)


def test_a_hostile_or_foreign_set_is_refused_in_one_line_and_writes_nothing(layer_shards, tmp_path, capsys):
    runs_root = tmp_path / "runs"

    def refused(src, *extra) -> str:
        argv = ["import-checkpoint", str(src), "--format", "circuit-tracer", "--runs-root", str(runs_root),
                "--shards", str(layer_shards["mlp_in"].dpath), "--target-shards", str(layer_shards["mlp_out"].dpath),
                *extra]  # fmt: skip
        assert cli.main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and not runs_root.exists(), err
        return err

    assert "say which (--layer L)" in refused(FIXTURES / "relu")
    bad = tmp_path / "bad"
    shutil.copytree(FIXTURES / "jumprelu", bad)
    (bad / "config.yaml").write_text("model_kind: cross_layer_transcoder\nfeature_input_hook: hook_resid_mid\n"
                                     "feature_output_hook: hook_mlp_out\n")  # fmt: skip
    assert "model_kind 'cross_layer_transcoder'; saeflow imports transcoder_set" in refused(bad, "--layer", "0")
    (bad / "config.yaml").write_text("!!python/object/apply:os.system ['true']\n")
    assert "not valid YAML" in refused(bad, "--layer", "0")
    shutil.copy(FIXTURES / "jumprelu" / "config.yaml", bad / "config.yaml")
    tensors = safetensors.torch.load_file(bad / "layer_0.safetensors")
    narrow = {**tensors, "W_dec": tensors["W_dec"][:, :8].contiguous()}  # b_dec says 16
    safetensors.torch.save_file(narrow, bad / "layer_0.safetensors")
    assert "tensor 'W_dec' has shape [32, 8]" in refused(bad, "--layer", "0")
    safetensors.torch.save_file({**tensors, "log_thresholds": tensors["b_enc"].clone()}, bad / "layer_0.safetensors")
    assert "log_thresholds" in refused(bad, "--layer", "0")
    (bad / "layer_0.safetensors").write_bytes((bad / "layer_1.safetensors").read_bytes()[:300])
    assert "layer_0.safetensors" in refused(bad, "--layer", "0")


def read_feature(out: pathlib.Path, feature_id: int) -> dict:
    """A reader written from the format (analysis/feature_files.py): the Cantor pair unpaired as the frontend does,
    the layer's offsets from the gzip index, the record's 4-byte little-endian length, its zlib JSON."""
    import gzip
    import math
    import struct
    import zlib

    w = (math.isqrt(8 * feature_id + 1) - 1) // 2
    index = feature_id - w * (w + 1) // 2
    layer = w - index
    entry = json.loads(gzip.decompress((out / "features" / "index.json.gz").read_bytes()))[layer]
    data = (out / "features" / entry["filename"]).read_bytes()[entry["offsets"][index] : entry["offsets"][index + 1]]
    (length,) = struct.unpack("<I", data[:4])
    return json.loads(zlib.decompress(data[4 : 4 + length]))


def test_feature_view_files_from_inference_dumps_read_back_and_validate_as_circuit_tracers_model(
        gpt2_set, circuit_tracer_site, tmp_path):  # fmt: skip
    """saeflow inference of each layer's transcoder, then `saeflow export-features`: every latent of every layer reads
    back by its Cantor-pair id, its top example's activation at its train token is the dump's, and circuit-tracer's
    own pydantic feature model (frontend/feature_models.py) accepts the records."""
    from saeflow.analysis import feature_files

    root, env, sds, sets = gpt2_set
    members = sets["mlp_in"]
    for run in members:
        assert cli.main(["inference", "--run", str(run.root), "--shards", str(sds["mlp_in"].dpath)]) == 0
    out = tmp_path / "features-out"
    assert cli.main(["export-features", *[a for r in members for a in ("--run", str(r.root))], str(out)]) == 0
    for layer, run in enumerate(members):
        with np.load(run.dump(sds["mlp_in"].hash).latents_fpath) as npz:
            top_values, freq = npz["topk_values"], npz["freq"]
        d_sae = top_values.shape[0]
        for i in range(d_sae):
            feature = read_feature(out, feature_files.cantor_pair(layer, i))
            assert feature["index"] == i and feature["activation_frequency"] == pytest.approx(float(freq[i]))
            examples = feature["examples_quantiles"][0]["examples"] if feature["examples_quantiles"] else []
            assert len(examples) == int((top_values[i] > 0).sum())
            if examples:
                best = examples[0]
                assert best["tokens_acts_list"][best["train_token_ind"]] == pytest.approx(float(top_values[i][0]),
                                                                                          rel=1e-5)  # fmt: skip
                assert len(best["tokens"]) == len(best["tokens_acts_list"])
    check = ("import sys, json; from circuit_tracer.frontend.feature_models import Model; "
             "[Model(**json.loads(line)) for line in sys.stdin]; print('ok')")  # fmt: skip
    lines = "".join(json.dumps(read_feature(out, feature_files.cantor_pair(layer, i))) + "\n"
                    for layer in range(len(members)) for i in range(4))  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", check], input=lines, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(circuit_tracer_site)}, timeout=HANG_SEC)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    with pytest.raises(SaeflowError, match="already exists"):
        feature_files.export_features([members[0].root], out)
    with pytest.raises(SaeflowError, match="no inference dump of the run on its validation shards; run saeflow "
                                           "inference"):  # fmt: skip
        feature_files.export_features([sets["resid_mid"][0].root], tmp_path / "none")
    assert not (tmp_path / "none").exists()


CLT_FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "circuit_tracer" / "clts"


@pytest.mark.parametrize("name", ["relu", "jumprelu"])
def test_clts_circuit_tracer_saved_import_and_compute_its_codes_and_predictions(tmp_path, name):
    """CLTs circuit-tracer 0.5.0 built and saved itself (tests/fixtures/circuit_tracer/make_circuit_tracer_clts.py):
    `saeflow import-checkpoint` makes a CLT run whose codes and predictions equal circuit-tracer's own to 1e-5, and
    exported again its files hold circuit-tracer's tensors."""
    src = CLT_FIXTURES / name
    n_layers, d = 3, 16
    x_lnd = np.load(src / "outputs.npz")["x"]
    ins = [write_shards(tmp_path / "s", np.repeat(x_lnd[layer][None, None], 1, 0), layers=(layer,), tag="clt-import",
                        data={"hook": "resid_mid"}) for layer in range(n_layers)]  # fmt: skip
    outs = [write_shards(tmp_path / "s", np.zeros((1, 1, 20, d), np.float32), layers=(layer,), tag="clt-import",
                         data={"hook": "mlp_out"}) for layer in range(n_layers)]  # fmt: skip
    argv = ["import-checkpoint", str(src), "--runs-root", str(tmp_path / "runs"),
            *[a for sd in ins for a in ("--shards", str(sd.dpath))],
            *[a for sd in outs for a in ("--target-shards", str(sd.dpath))]]  # fmt: skip
    assert cli.main(argv) == 0
    (run_dpath,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    run = runs.open_run(run_dpath)
    model = clt.load_clt(run.sae_fpath)
    want = np.load(src / "outputs.npz")
    preds, codes = model([torch.from_numpy(x_nd) for x_nd in x_lnd])
    for layer in range(n_layers):
        np.testing.assert_allclose(codes[layer].numpy(), want["codes"][layer], atol=1e-5, rtol=0)
        np.testing.assert_allclose(preds[layer].numpy(), want["recon"][layer], atol=1e-5, rtol=0)
    assert run.config()["shape"] == "clt" and run.config()["arch"] == name
    assert cli.main(argv) == 0  # idempotent: the same run
    out = tmp_path / "again"
    assert export([run.root], out) == 0
    for fname in sorted(f.name for f in src.glob("W_*.safetensors")):
        theirs, ours = safetensors.torch.load_file(src / fname), safetensors.torch.load_file(out / fname)
        assert sorted(theirs) == sorted(ours), fname
        for key in theirs:
            torch.testing.assert_close(ours[key], theirs[key].float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "W_dec_1.safetensors").write_bytes((d / "W_dec_1.safetensors").read_bytes()[:200]),
     "W_dec_1.safetensors"),
    (lambda d: (d / "config.yaml").write_text("model_kind: !!python/object:os.system x\\n"), "config.yaml"),
    (lambda d: (d / "W_dec_2.safetensors").unlink(), "W_dec_2.safetensors"),
    (lambda d: safetensors.torch.save_file({**safetensors.torch.load_file(d / "W_enc_1.safetensors"),
                                            "evil": torch.zeros(24)}, str(d / "W_enc_1.safetensors")), "W_enc_1"),
])  # fmt: skip
def test_a_damaged_or_hostile_clt_directory_is_refused_in_one_line_and_makes_no_run(tmp_path, damage, message):
    src = tmp_path / "clt"
    shutil.copytree(CLT_FIXTURES / "jumprelu", src)
    damage(src)
    sd = write_shards(tmp_path / "s", np.zeros((1, 3, 20, 16), np.float32), layers=(0, 1, 2), tag="hostile",
                      data={"hook": "resid_mid"})  # fmt: skip
    with pytest.raises(SaeflowError, match=message) as err:
        circuit_tracer_clt.import_clt(src, tmp_path / "runs", [sd.dpath], [sd.dpath])
    assert "\n" not in str(err.value)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
