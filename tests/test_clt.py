"""Cross-layer transcoders and the dictionary-shape seam (issue 43): training/shapes.py, training/clt.py.

The plan: `shape: clt` makes one run of a `layer` list (its config.json lists a directory per layer of each role;
every other run's config is as before), and every (shape, architecture) pair either plans or is refused in one line,
as are a CLT's Matryoshka prefixes, skip path, unordered layers and parallel modes. The model: its predictions are
the sum over earlier layers' latents that the docstring writes, and its raw-space weights compute the same. Training:
every architecture a CLT trains recovers planted cross-layer features, resumes to the bytes of an uninterrupted
run, and trains from the CLI (which refuses it on several ranks).
"""

import copy
import json

import numpy as np
import pytest
import torch
import yaml

from builders import planted_cross_layer, run_of_clt, write_shards
from saeflow import cli, config
from saeflow.errors import SaeflowError
from saeflow.planning import WorkflowPlan, cli_configs, seed_group_configs
from saeflow.training import archs, clt, entry, shapes, train
from saeflow.training.entry import train_runs
from saeflow.training.specs import SAEConfig
from saeflow.training.sweeps import transcoder_sets
from test_identity import RANDOM_GPT2, ROOTS

GPT2_3 = {**RANDOM_GPT2, "model": {"random": {**RANDOM_GPT2["model"]["random"],
                                              "config": {**RANDOM_GPT2["model"]["random"]["config"], "n_layer": 3}}},
          "layers": [0, 1, 2]}  # fmt: skip


def _case(**sae) -> dict:
    return {**ROOTS, "activations": {"mid": {**GPT2_3, "hook": "resid_mid"}, "out": {**GPT2_3, "hook": "mlp_out"}},
            "saes": {"clt": {"train": "mid", "target": "out", "layer": [0, 1, 2], "shape": "clt", "expansion": 2,
                             "k": 4, **sae}}}  # fmt: skip


def _plan(cfg: dict) -> WorkflowPlan:
    return WorkflowPlan.from_config(config.validate(copy.deepcopy(cfg)))


def test_a_clt_plans_as_one_run_of_its_layers_and_other_runs_keep_their_configs():
    plan = _plan(_case())
    ((run_id, run_plan),) = plan.runs.items()
    obj = run_plan.train_config.to_dict()
    assert obj["shape"] == "clt" and obj["layer"] == [0, 1, 2] and run_plan.name == "clt"
    for key, activation in (("train_shards", "mid"), ("val_shards", "mid"), ("target", "out"), ("val_target", "out")):
        assert obj[key] == [plan.layer_hash[activation][layer] for layer in (0, 1, 2)]
    assert plan.dumps() == [] and len(run_plan.read_shards) == 6
    swept = _plan({**_case(), "saes": {"set": {"train": "mid", "target": "out", "layer": [0, 1, 2], "k": 4}}})
    assert sorted(p.train_config.layer for p in swept.runs.values()) == [0, 1, 2]  # a per-layer set, as before
    assert all("shape" not in p.train_config.to_dict() for p in swept.runs.values())
    explicit = _plan({**_case(), "saes": {"set": {"train": "mid", "target": "out", "layer": [0, 1, 2], "k": 4,
                                                  "shape": "transcoder"}}})  # fmt: skip
    assert list(explicit.runs) == list(swept.runs)  # `shape: transcoder` is what `auto` says: the same runs
    more = _plan(_case(expansion=[2, 4]))
    assert sorted(p.name for p in more.runs.values()) == ["clt[expansion=2]", "clt[expansion=4]"]


@pytest.mark.parametrize("shape", shapes.NAMES)
@pytest.mark.parametrize("arch", archs.NAMES)
def test_every_shape_plans_every_architecture_or_refuses_it_in_one_line(shape, arch):
    sae = {"train": "mid", "layer": [0, 1, 2] if shape == "clt" else 1, "shape": shape, "arch": arch, "k": 4,
           "expansion": 2, **({} if shape == "sae" else {"target": "out"})}  # fmt: skip
    cfg = {**_case(), "saes": {"one": sae}}
    why = shapes.get(shape).refusal(arch)
    if why is None:
        assert len(_plan(cfg).runs) == 1
        return
    with pytest.raises(SaeflowError) as err:
        _plan(cfg)
    assert "\n" not in str(err.value) and arch in str(err.value)


@pytest.mark.parametrize("sae, message", [
    ({"matryoshka": [0.5]}, "matryoshka: a cross-layer transcoder trains no Matryoshka prefixes"),
    ({"skip": True}, "skip: a cross-layer transcoder has no linear skip path"),
    ({"layer": [2, 0, 1]}, "layer: a cross-layer transcoder's layers are ascending and each once"),
    ({"layer": [0, 1, 3]}, "layer: layer 3 is not extracted by the (train|target) activation"),
    ({"target": None}, "shape: a clt predicts another activation; set target"),
])  # fmt: skip
def test_what_a_clt_cannot_train_is_refused_at_plan_time_in_one_line(sae, message):
    with pytest.raises(SaeflowError, match=message):
        _plan(_case(**sae))


@pytest.mark.parametrize("mode", ["data", "latents", "sweep"])
def test_a_clt_on_several_ranks_is_refused_at_plan_time_in_one_line(mode):
    cfg = {**_case(), "train": {"gpus": 2, "parallel": mode}}
    with pytest.raises(SaeflowError, match="cross-layer transcoders train on one process"):
        _plan(cfg)


def _random_clt(arch: str = "relu", n_layers: int = 3, d: int = 6, d_sae: int = 5) -> clt.CLT:
    model = clt.CLT(clt.CLTConfig(tuple(range(n_layers)), SAEConfig(d_model=d, d_sae=d_sae, arch=arch, k=2, d_out=d)))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
        for sae in model.encoders:
            sae.scale.fill_(1.7)
        model.target_scale.copy_(torch.tensor([0.5, 2.0, 3.0][:n_layers]))
    return model.eval()


def test_a_clts_prediction_sums_every_earlier_layers_latents_and_its_raw_weights_compute_it():
    model = _random_clt()
    xs = [torch.randn(9, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    preds, codes = model(xs)
    w = model.weights()
    for j in range(3):
        want = w[f"b_dec_{j}"].clone()
        for i in range(j + 1):
            f_bs = torch.relu(xs[i] @ w[f"W_enc_{i}"].T + w[f"b_enc_{i}"])
            assert torch.allclose(f_bs, codes[i], atol=1e-5)
            want = want + f_bs @ w[f"W_dec_{i}"][:, j - i]
        assert torch.allclose(preds[j], want, atol=1e-5), j
    assert w["W_enc_0"].shape == (5, 6) and w["W_dec_0"].shape == (5, 3, 6) and w["W_dec_2"].shape == (5, 1, 6)


def test_a_clt_checkpoint_round_trips_and_a_damaged_or_foreign_one_is_refused_in_one_line(tmp_path):
    model = _random_clt("jumprelu")
    clt.save_clt(model, tmp_path / "sae.pt")
    back = clt.load_clt(tmp_path / "sae.pt")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))
    (tmp_path / "bad.pt").write_bytes((tmp_path / "sae.pt").read_bytes()[:100])
    with pytest.raises(SaeflowError, match="bad.pt: not a readable CLT checkpoint"):
        clt.load_clt(tmp_path / "bad.pt")
    torch.save({"format": "saeflow-sae"}, tmp_path / "sae2.pt")
    with pytest.raises(SaeflowError, match="not a saeflow cross-layer transcoder"):
        clt.load_clt(tmp_path / "sae2.pt")


N_LAYERS, D, PER_LAYER, K, T = 3, 24, 24, 2, 16


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    xs, ys, dec_fld, src_f = planted_cross_layer(8192, N_LAYERS, D, PER_LAYER, K, noise=0.01)
    root = tmp_path_factory.mktemp("clt")
    ins = [write_shards(root, xs[layer].reshape(-1, 1, T, D), layers=(layer,), ex_per_shard=128, tag="clt")
           for layer in range(N_LAYERS)]  # fmt: skip
    outs = [write_shards(root, ys[layer].reshape(-1, 1, T, D), layers=(layer,), ex_per_shard=128, tag="clt",
                         data={"hook": "mlp_out"}) for layer in range(N_LAYERS)]  # fmt: skip
    return ins, outs, dec_fld, src_f


def recovered(model: clt.CLT, dec_fld: np.ndarray, src_f: np.ndarray, min_cos: float = 0.9) -> float:
    """The share of planted features whose decoders (every layer they write, concatenated) some latent of their own
    layer's encoder has to cosine `min_cos`."""
    w, hits = model.weights(), []
    for f, layer in enumerate(src_f):
        true_o = dec_fld[f, layer:].reshape(-1) / np.linalg.norm(dec_fld[f, layer:])
        rows_so = w[f"W_dec_{layer}"].reshape(model.cfg.d_sae, -1).numpy()
        rows_so = rows_so / np.maximum(np.linalg.norm(rows_so, axis=1, keepdims=True), 1e-8)
        hits.append((rows_so @ true_o).max() >= min_cos)
    return float(np.mean(hits))


CLT_ARCHS = [name for name in archs.NAMES if shapes.get("clt").refusal(name) is None]
PLANTED_SPECS = {"topk": {"k": K}, "batchtopk": {"k": K}, "relu": {}, "jumprelu": {"k": K}, "gated": {"k": K}}
MIN_RECOVERED = {"topk": 0.9, "batchtopk": 0.9, "relu": 0.6, "jumprelu": 0.6, "gated": 0.5}


@pytest.mark.parametrize("name", CLT_ARCHS)
def test_every_architecture_a_clt_trains_recovers_planted_cross_layer_features(tmp_path, planted, name):
    """Features that read one layer and write it and every later one: each architecture at its defaults finds
    their decoders across layers with its own layer's latents, and validates on every layer's target."""
    ins, outs, dec_fld, src_f = planted
    run = run_of_clt(tmp_path, ins, outs, arch=name, expansion=2, batch_size=256, n_epochs=6,
                     **PLANTED_SPECS[name])  # fmt: skip
    (result,) = train_runs([run.root], train.TrainSettings(device="cpu"))
    model = clt.load_clt(run.sae_fpath)
    share = recovered(model, dec_fld, src_f)
    assert share >= MIN_RECOVERED[name], f"{name}: recovered {share:.0%} of the planted cross-layer features"
    assert result["nmse"] < (0.3 if archs.get(name).uses_k else 0.5) and sorted(result["layers"]) == ["0", "1", "2"]
    assert result["l0"] == pytest.approx(sum(r["l0"] for r in result["layers"].values()))


def test_a_clt_resumes_to_the_bytes_of_an_uninterrupted_run(tmp_path, planted):
    ins, outs, _, _ = planted
    spec = dict(arch="jumprelu", expansion=1, batch_size=256, n_epochs=2)
    stopped, alone = run_of_clt(tmp_path / "a", ins, outs, **spec), run_of_clt(tmp_path / "b", ins, outs, **spec)
    settings = dict(device="cpu", buffer_bytes="200000", checkpoint_every=7)
    assert train_runs([stopped.root], train.TrainSettings(max_steps=23, **settings)) == []
    assert stopped.resume_fpath.exists()
    train_runs([stopped.root], train.TrainSettings(**settings))
    train_runs([alone.root], train.TrainSettings(**settings))
    assert stopped.sae_fpath.read_bytes() == alone.sae_fpath.read_bytes()
    assert stopped.metrics_log_fpath.read_text() == alone.metrics_log_fpath.read_text()


def test_a_clt_trains_from_the_cli_and_several_ranks_refuse_it_in_one_line(tmp_path, planted, monkeypatch):
    ins, outs, _, _ = planted
    run = run_of_clt(tmp_path, ins, outs, arch="topk", k=K, expansion=1, batch_size=512, n_epochs=1)
    assert cli.main(["train", "--run", str(run.root), "--device", "cpu"]) == 0
    metrics = json.loads(run.final_metrics_fpath.read_text())
    assert metrics["l0"] == pytest.approx(3 * K, abs=0.05)
    assert json.loads(run.config_fpath.read_text())["shape"] == "clt"
    other = run_of_clt(tmp_path, ins, outs, arch="topk", k=K, expansion=2, batch_size=512, n_epochs=1)
    monkeypatch.setattr(entry.distributed, "rendezvous_from_env", lambda: ("a launched job's rank", 0))
    with pytest.raises(SaeflowError, match="a cross-layer transcoder trains on one process; train it without --gpus"):
        entry.train_runs([other.root], train.TrainSettings(device="cpu"))
    assert not other.sae_fpath.exists()


def _ids(cfg: dict) -> dict[str, set[str]]:
    ids: dict[str, set[str]] = {}
    for run_id, run_plan in _plan(cfg).runs.items():
        ids.setdefault(run_plan.sae_name, set()).add(run_id)
    return ids


def test_changing_a_clts_sparsity_or_adding_a_layer_to_a_set_retrains_only_what_it_must():
    """A CLT and a per-layer set side by side (config/examples/gpt2-clt.yaml's shape): a new CLT coefficient names a
    new CLT and leaves the set's runs; a layer added to the set's sweep adds its run alone; the CLT is one model, so a
    layer added to it names a new CLT."""
    base = _case(arch="jumprelu", layer=[0, 1])
    base["saes"]["set"] = {"train": "mid", "target": "out", "layer": [0, 1], "arch": "jumprelu", "expansion": 2}
    before = _ids(base)
    assert len(before["clt"]) == 1 and len(before["set"]) == 2
    sparser = copy.deepcopy(base)
    sparser["saes"]["clt"]["l0_coeff"] = 4.0
    after = _ids(sparser)
    assert after["set"] == before["set"] and after["clt"].isdisjoint(before["clt"])
    unread = copy.deepcopy(base)
    unread["saes"]["clt"]["gate_l1_coeff"] = 9.0  # no key of jumprelu: no new run
    assert _ids(unread) == before
    wider = copy.deepcopy(base)
    wider["saes"]["set"]["layer"] = [0, 1, 2]
    wider["saes"]["clt"]["layer"] = [0, 1, 2]
    grown = _ids(wider)
    assert before["set"] < grown["set"] and len(grown["set"] - before["set"]) == 1
    assert grown["clt"].isdisjoint(before["clt"])


def test_a_clt_trains_through_the_workflow_and_a_new_coefficient_retrains_it_alone(tmp_path):
    """The real MiniLM's mlp_in -> mlp_out of two layers (one forward pass), a TopK CLT over both, through Snakemake:
    the CLT publishes its sae.pt and its validation metrics of each layer (it has no inference dump, so no summary
    row); a new CLT k then plans one create_run and one train (a set beside it keeping its runs: the plan-level test
    above)."""
    from workflow_helpers import job_counts, snakemake, tiny_config, write_config

    cfg = tiny_config(n_ex=24, layer=1)
    docs = {**cfg["activations"]["docs"], "layers": [1, 2]}
    cfg["activations"] = {"in": {**docs, "hook": "mlp_in"}, "out": {**docs, "hook": "mlp_out"}}
    common = {"train": "in", "target": "out", "layer": [1, 2], "arch": "topk", "k": 4, "expansion": 1,
              "batch_size": 64, "n_epochs": 1, "aux_k": 16}  # fmt: skip
    cfg["saes"] = {"clt": {**common, "shape": "clt"}}
    config_fpath = write_config(tmp_path, cfg)
    snakemake(tmp_path, config_fpath, "--cores", "2")
    plan = WorkflowPlan.from_config(config.load(config_fpath))
    (clt_id,) = plan.runs
    model = clt.load_clt(tmp_path / plan.run(clt_id).sae_fpath)
    assert model.cfg.layer_ids == (1, 2) and model.cfg.d_out == 384
    metrics = json.loads((tmp_path / plan.run(clt_id).final_metrics_fpath).read_text())
    assert sorted(metrics["layers"]) == ["1", "2"] and metrics["nmse"] < 1
    assert job_counts(snakemake(tmp_path, config_fpath, "-n").stdout) == {}
    cfg["saes"]["clt"]["k"] = 8
    write_config(tmp_path, cfg)
    assert job_counts(snakemake(tmp_path, config_fpath, "-n").stdout) == {"create_run": 1, "train": 1, "all": 1}
    assert not (tmp_path / "summary").exists()  # no run with a dump: no summary is planned (it would have no row)


def test_the_plan_knows_a_sweep_over_layers_as_one_transcoder_set_and_saeflow_plan_says_so(tmp_path, capsys):
    cfg = _case()
    cfg["saes"]["set"] = {"train": "mid", "target": "out", "layer": [0, 1, 2], "k": [4, 8], "expansion": 2}
    plan = _plan(cfg)
    sets = transcoder_sets(plan)
    assert sorted(sets) == ["set[k=4]", "set[k=8]"]  # one set per point of the other swept keys; the CLT is none
    for name, members in sets.items():
        assert list(members) == [0, 1, 2]
        assert {plan.runs[r].train_config.k for r in members.values()} == {int(name[6])}
    config_fpath = tmp_path / "config.yaml"
    config_fpath.write_text(yaml.safe_dump(cfg))
    assert cli.main(["plan", str(config_fpath)]) == 0
    out = capsys.readouterr().out
    assert "transcoder set set[k=4]: layers 0, 1, 2" in out and "a cross-layer transcoder of layers [0, 1, 2]" in out


def test_a_clt_seed_sweep_forms_no_seed_group_the_stability_stage_would_need_dumps_for():
    cfg = _case(seed=[0, 1])
    cfg["saes"]["set"] = {"train": "mid", "target": "out", "layer": 1, "k": 4, "expansion": 2, "seed": [0, 1]}
    plan = _plan(cfg)
    configs = seed_group_configs(plan)
    assert {plan.runs[r].sae_name for r in configs} == {"set"} and len(configs) == 2
    assert sum(path.parts[0] == "stability" for path in cli_configs(plan)) == 1  # the set's seed group alone


def test_the_memory_model_counts_a_clts_parameters_as_the_model_holds_them():
    from saeflow.training import memory

    (run_plan,) = _plan(_case()).runs.values()
    cfg = run_plan.train_config
    d = 16
    model = clt.CLT(clt.CLTConfig.of_run(cfg, d, d))
    assert memory.sae_params(cfg, d) == sum(t.numel() for name, t in model.named_parameters()
                                            if not name.endswith("log_threshold"))  # fmt: skip
