"""A transcoder set evaluated whole (analysis/replacement.py, `saeflow evaluate --run ... --run ... --out`): every
layer's MLP replaced at once, and a cross-layer transcoder the same way (`--run CLT --out`), on a tiny random GPT-2 and
Llama and the real all-MiniLM-L6-v2 (an encoder: its embeddings' cosine and relative error). Known answers (each
block's own MLP as its "transcoder" recovers everything) and the numbers of a trained set and CLT against an
independent computation: plain transformers with a forward hook written here on every block's MLP, torch's own
cross-entropy and KL. Each run alone equals `saeflow evaluate` of that run."""

import json

import pytest
import torch

from builders import run_from_sae_spec, typed
from saeflow import cli
from saeflow.analysis import evaluate, splice
from saeflow.errors import SaeflowError
from saeflow.extraction import adapters, extract
from saeflow.store import shards
from saeflow.training import loaders, sae, train
from test_hooks import DOC_PATHS, spec_of
from test_splice import MINILM, REAL, Plain, plain_model

LAYERS = (0, 1)  # of 3 blocks (test_hooks.spec_of)


FAMILIES = ("gpt2", "llama", "minilm")  # a tiny random GPT-2 and Llama (test_hooks.CONFIGS), the real MiniLM
MINILM_SPEC = {"model": {"name": MINILM}, "layers": list(LAYERS), "dataset": {"kind": "builtin_text", "n_ex": 8},
               "context_length": 16, "batch_size": 4, "device": "cpu"}  # fmt: skip


def spec_for(name: str, hook: str) -> dict:
    return {**MINILM_SPEC, "hook": hook} if name in REAL else spec_of(name, hook=hook)


def plain_for(name: str, plan, sd) -> Plain:
    """Plain transformers' model of the family `name` (the real MiniLM: its own checkpoint), run on `sd`'s inputs."""
    import transformers

    base = transformers.AutoModel.from_pretrained(MINILM).eval() if name in REAL else plain_model(name)
    return Plain(REAL.get(name, name), plan, sd, base)


def own_mlp(block, family: str):
    """The block's own MLP from its input (the norm's output) to its output, hook-free (`forward`): BERT's is its
    intermediate layer and output dense."""
    if family == "bert":
        return lambda x: block.output.dense.forward(block.intermediate.forward(x))
    return block.mlp.forward


def differs(want: dict) -> bool:
    """The spliced pass is not the clean one: KL above 1e-6 (a language model), or a pooled cosine below 1 - 1e-6."""
    return want["kl_spliced"] > 1e-6 if "kl_spliced" in want else want["pooled_cos_spliced"] < 1 - 1e-6


@pytest.fixture(scope="module", params=FAMILIES)
def model_set(tmp_path_factory, request):
    """A random 3-block GPT-2's mlp_in and mlp_out at blocks 0 and 1 (a directory per layer, as `saeflow extract`
    writes them), a TopK transcoder trained per layer, and the config naming both activations."""
    root = tmp_path_factory.mktemp("replacement")
    arch = request.param
    specs_ = {hook: spec_for(arch, hook) for hook in ("mlp_in", "mlp_out")}
    cfg = {"shards_root": str(root / "shards"), "runs_root": str(root / "runs"), "saes": {},
           "activations": {"tc_in": specs_["mlp_in"], "tc_out": specs_["mlp_out"]}}  # fmt: skip
    (root / "config.json").write_text(json.dumps(cfg))
    assert cli.main(["extract", str(root / "config.json"), "--no-progress"]) == 0
    sds = {hook: {unit.layers[0]: shards.ShardDir(root / "shards" / extract.plan_activation(unit).hash)
                  for unit in extract.plan_units(typed(spec))} for hook, spec in specs_.items()}  # fmt: skip
    members = [run_from_sae_spec(root / "runs", sds["mlp_in"][layer], target_sd=sds["mlp_out"][layer], layer=layer,
                                 arch="topk", k=4, expansion=2, batch_size=32, n_epochs=2) for layer in LAYERS]
    train.train_runs([run.root for run in members], train.TrainSettings(device="cpu"))
    return root, sds, members, arch


def plain_replacement(plain: Plain, predict: dict) -> torch.Tensor:
    """Plain transformers' logits with block l's MLP output replaced, at the mask, by predict[l](the MLP's input: its
    norm's output, the documented module of test_hooks.DOC_PATHS)."""
    handles = []
    for layer, fn in predict.items():
        block = adapters.find_blocks(plain.model.base_model)[layer]
        norm, mlp = (block.get_submodule(DOC_PATHS[plain.arch][hook]) for hook in ("mlp_in", "mlp_out"))
        got = {}
        handles.append(norm.register_forward_hook(lambda m, a, out, got=got: got.update(x=out[plain.mask])))

        def write(module, args, out, got=got, fn=fn):
            new = out.clone()
            new[plain.mask] = fn(got.pop("x"))
            return new

        handles.append(mlp.register_forward_hook(write))
    try:
        with torch.no_grad():
            out = plain.model(input_ids=plain.ids, attention_mask=torch.ones_like(plain.ids))
            return out.logits if hasattr(out, "logits") else out.last_hidden_state
    finally:
        for handle in handles:
            handle.remove()


def test_the_set_of_each_blocks_own_mlp_recovers_everything(model_set):
    _, sds, _, arch = model_set
    sd = sds["mlp_in"][0]
    plan = extract.plan(typed({**spec_for(arch, "mlp_in"), "layers": [0]}))
    m = splice.load_model(plan.info, plan.spec.model, "float32", torch.device("cpu"))
    own = tuple(splice.Splice(splice.Point("mlp_in", layer), splice.Point("mlp_out", layer),
                              own_mlp(m.blocks[layer], REAL.get(arch, arch))) for layer in LAYERS)  # fmt: skip
    view = loaders.LayerView(sd, 0, "no_special")
    metrics = evaluate.three_passes(m, plan, view, own, sd.n_ex, 4, "cpu", progress=False)
    if "kl_spliced" in metrics:
        assert metrics["ce_loss_recovered"] == pytest.approx(1.0, abs=1e-5) and metrics["kl_spliced"] < 1e-9
        assert metrics["kl_ablated"] > 0  # zeroing both MLPs changes the output
    else:  # an encoder: the embeddings are the clean ones
        assert metrics["pooled_cos_spliced"] == pytest.approx(1.0, abs=1e-6)
        assert metrics["pooled_cos_ablated"] < 1 - 1e-4


def test_a_trained_set_spliced_whole_agrees_with_plain_transformers(model_set, tmp_path):
    root, sds, members, arch = model_set
    out = tmp_path / "set.json"
    argv = ["evaluate", *[a for run in members for a in ("--run", str(run.root))], str(root / "config.json"),
            "--activation", "tc_in", "--out", str(out), "--no-progress", "--device", "cpu", "--batch-size", "4"]
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    written = [one["write"] for one in result["config"]["splices"]]
    assert written == [{"hook": "mlp_out", "layer": layer} for layer in LAYERS]

    plan = extract.plan(typed({**spec_for(arch, "mlp_in"), "layers": [0]}))
    plain = plain_for(arch, plan, sds["mlp_in"][0])
    tcs = {layer: sae.load_sae(run.sae_fpath) for layer, run in zip(LAYERS, members)}

    def predict(layer):
        return lambda x: tcs[layer](x)[0]

    def mean_of(layer):
        view = loaders.LayerView(sds["mlp_out"][layer], layer, "no_special")
        mean_d = evaluate.mean_activation(view)[0].float()
        return lambda x: mean_d.expand_as(x)

    outs = {"clean": plain_replacement(plain, {}),
            "spliced": plain_replacement(plain, {layer: predict(layer) for layer in LAYERS}),
            "ablated": plain_replacement(plain, dict.fromkeys(LAYERS, torch.zeros_like)),
            "mean_ablated": plain_replacement(plain, {layer: mean_of(layer) for layer in LAYERS})}  # fmt: skip
    want = plain.metrics(outs, False)
    for key, value in want.items():
        assert result["replacement"][key] == pytest.approx(value, abs=1e-7), key
    assert differs(want)  # the transcoders are not the MLPs (a tiny random Llama's MLPs move little)
    for layer, run in zip(LAYERS, members):  # each alone: what `saeflow evaluate` writes for the run
        one = ["evaluate", "--run", str(run.root), str(root / "config.json"), "--activation", "tc_in", "--no-progress",
               "--device", "cpu", "--batch-size", "4"]  # fmt: skip
        assert cli.main(one) == 0
        alone = json.loads(run.evaluation_fpath(run.config()["val_shards"]).read_text())["metrics"]
        assert result["per_layer"][str(layer)] == pytest.approx(alone, abs=1e-9)
    score = "kl_spliced" if "kl_spliced" in want else "pooled_rel_err_spliced"  # an error: larger is worse
    replaced_both = result["replacement"][score]
    assert replaced_both > max(result["per_layer"][str(layer)][score] for layer in LAYERS)
    print(f"{arch} replacement: {score} {replaced_both:.4f}; "
          + ", ".join(f"layer {layer} alone {result['per_layer'][str(layer)][score]:.4f}" for layer in LAYERS))


def test_a_set_is_refused_in_one_line_without_out_or_with_a_layer_twice(model_set, tmp_path, capsys):
    root, _, members, arch = model_set
    config_fpath = str(root / "config.json")
    twice = ["--run", str(members[0].root), "--run", str(members[0].root)]
    assert cli.main(["evaluate", *twice, config_fpath, "--activation", "tc_in"]) == 1
    assert "give --out FILE for its evaluation" in capsys.readouterr().err
    assert cli.main(["evaluate", *twice, config_fpath, "--activation", "tc_in", "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "both splice layer 0; a set has one run per layer" in err
    assert not (tmp_path / "x").exists()
    with pytest.raises(SaeflowError, match="already exists"):
        (tmp_path / "y").write_text("{}")
        from saeflow.analysis import replacement

        replacement.run_set_evaluation(replacement.SetEvaluateConfig(
            runs=(members[0].root,), spec=typed(spec_for(arch, "mlp_in")),
            out=tmp_path / "y"))  # fmt: skip


def test_a_clt_spliced_whole_agrees_with_plain_transformers(model_set, tmp_path):
    """A ReLU cross-layer transcoder over both blocks (mlp_in -> mlp_out), `saeflow evaluate --run CLT --out`: the
    replacement equals plain transformers with block l's MLP output replaced by b_dec_l + sum_{i <= l} f_i @ W_dec_i
    (circuit-tracer's tensors, computed here from the raw weights); each layer alone reads the clean earlier inputs."""
    from builders import run_of_clt
    from saeflow.training import clt, entry

    root, sds, _, arch = model_set
    run = run_of_clt(tmp_path / "runs", [sds["mlp_in"][layer] for layer in LAYERS],
                     [sds["mlp_out"][layer] for layer in LAYERS], arch="relu", expansion=2, batch_size=32,
                     n_epochs=2)  # fmt: skip
    entry.train_runs([run.root], train.TrainSettings(device="cpu"))
    out = tmp_path / "clt.json"
    argv = ["evaluate", "--run", str(run.root), str(root / "config.json"), "--activation", "tc_in", "--out", str(out),
            "--no-progress", "--device", "cpu", "--batch-size", "4"]  # fmt: skip
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    w = clt.load_clt(run.sae_fpath).weights()

    def predictor():
        codes = {}

        def predict(layer):
            def fn(x):
                codes[layer] = torch.relu(x @ w[f"W_enc_{layer}"].T + w[f"b_enc_{layer}"])
                return w[f"b_dec_{layer}"] + sum(codes[i] @ w[f"W_dec_{i}"][:, layer - i] for i in range(layer + 1))
            return fn
        return predict

    plan = extract.plan(typed({**spec_for(arch, "mlp_in"), "layers": [0]}))
    plain = plain_for(arch, plan, sds["mlp_in"][0])
    predict = predictor()
    outs = {"clean": plain_replacement(plain, {}),
            "spliced": plain_replacement(plain, {layer: predict(layer) for layer in LAYERS}),
            "ablated": plain_replacement(plain, dict.fromkeys(LAYERS, torch.zeros_like))}  # fmt: skip
    view = {layer: loaders.LayerView(sds["mlp_out"][layer], layer, "no_special") for layer in LAYERS}
    means = {layer: evaluate.mean_activation(view[layer])[0].float() for layer in LAYERS}
    outs["mean_ablated"] = plain_replacement(plain, {layer: (lambda x, m=means[layer]: m.expand_as(x))
                                                     for layer in LAYERS})  # fmt: skip
    want = plain.metrics(outs, False)
    for key, value in want.items():
        assert result["replacement"][key] == pytest.approx(value, abs=1e-7), key
    assert differs(want)
    alone = predictor()  # layer 1 alone: layer 0's codes from the clean pass, its MLP output its own
    record_layer0 = alone(0)

    def own_mlp_recording_codes(x):
        record_layer0(x)
        return own_mlp(adapters.find_blocks(plain.model.base_model)[0], plain.arch)(x)  # position-wise, hook-free

    outs_alone = {**outs, "spliced": plain_replacement(plain, {0: own_mlp_recording_codes, 1: alone(1)})}
    alone_want = plain.metrics(outs_alone, False)  # its ablations are the whole CLT's here: only the splice compares
    for key in (key for key in alone_want if key.endswith("_spliced")):
        assert result["per_layer"]["1"][key] == pytest.approx(alone_want[key], abs=1e-7), key
