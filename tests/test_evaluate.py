"""`saeflow evaluate`: the SAE spliced into its model (known answers, and agreement with plain transformers hooks)."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
import yaml

from builders import run_from_sae_spec, text_spec, typed, vision_spec
from saeflow import cli
from saeflow.analysis import evaluate, scoring, splice
from saeflow.extraction import extract, hooks
from saeflow.store import runs, shards
from saeflow.training import loaders, sae, train
from saeflow.training.sweeps import auto_tokens_of


def _spec_config(tmp_path, spec: dict, **others: dict):
    fpath = tmp_path / "val.yaml"
    fpath.write_text(yaml.safe_dump({"activations": {**others, "val": spec}}))
    return fpath


def _shards(tmp_path, spec: dict) -> shards.ShardDir:
    return shards.ShardDir(extract.extract(typed(spec), tmp_path / "shards", progress=False).dpath)


def _run(tmp_path, spec: dict, layer: int, model: sae.SAE, **extra) -> runs.Run:
    """A run around `model`, validated on the spec's shards (extracted), tokens as planning resolves `auto`."""
    sd = _shards(tmp_path, spec)
    run_cfg = {"layer": layer, "train_shards": sd.hash, "val_shards": sd.hash, "tokens": auto_tokens_of(sd.metadata),
               **extra}  # fmt: skip
    run = runs.create_run(tmp_path / "runs", run_cfg, sd.dpath, sd.dpath)
    sae.save_sae(model, run.sae_fpath)
    return run


def _random_sae(d: int, d_sae: int = 64, seed: int = 0) -> sae.SAE:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d, d_sae, generator=g) / d**0.5
    return sae.SAE.from_weights(W, torch.zeros(d_sae), W.T.contiguous(), torch.randn(d, generator=g) * 0.1,
                                arch="topk", k=8, scale=0.5)  # fmt: skip


@pytest.mark.parametrize("tokens", ["no_special", "content"])
@pytest.mark.slow
def test_lm_agrees_with_an_independent_three_pass_computation(tiny_lm_dpath, tmp_path, capsys, tokens):
    """The splice replaces exactly the positions the SAE trained on: every token but the specials ([CLS], [SEP]
    of the BERT tokenizer) for `no_special` (the text default), every token for `content`."""
    import transformers

    spec = {"model": {"name": str(tiny_lm_dpath)}, "layers": [0], "dataset": {"kind": "builtin_text", "n_ex": 6},
            "context_length": 16, "device": "cpu"}  # fmt: skip
    model = _random_sae(32)
    run = _run(tmp_path, spec, 0, model, tokens=tokens)
    # A config with another activation too: evaluate picks the one that plans the run's validation shards.
    config_fpath = _spec_config(tmp_path, spec, other=text_spec("gpt2", layers=[1]))
    argv = ["evaluate", "--run", str(run.root), str(config_fpath), "--n-tokens", "70",
            "--batch-size", "2", "--no-progress", "--device", "cpu"]  # fmt: skip
    assert cli.main(argv) == 0
    out = json.loads(run.evaluation_fpath(run.config()["val_shards"]).read_text())
    got = out["metrics"]
    assert out["config"]["n_ex"] == 5 and out["config"]["tokens"] == tokens  # ceil(70 / 16)

    # Independent: the checkpoint's own LM head model, a forward hook on block 0, torch's own CE and KL.
    plan = extract.plan(typed(spec))
    special = {*plan.packing.prefix, *plan.packing.suffix, *plan.packing.separator}
    ids = torch.from_numpy(extract.tokenization.token_ids(plan.info, None, plan.dataset, plan.packing)[:5]).long()
    keep = torch.from_numpy(np.isin(ids.numpy(), sorted(special)) & (tokens == "no_special"))  # stays clean
    assert np.isin(ids.numpy(), sorted(special)).any()  # the examples hold [CLS]/[SEP]: the two choices differ
    lm = transformers.GPT2LMHeadModel.from_pretrained(tiny_lm_dpath).eval()

    def logits_with(fn):
        def hook(module, args, output):
            h = output[0] if isinstance(output, tuple) else output
            new = torch.where(keep[..., None], h, fn(h.reshape(-1, 32)).reshape(h.shape))
            return (new, *output[1:]) if isinstance(output, tuple) else new

        handle = lm.transformer.h[0].register_forward_hook(hook) if fn else None
        with torch.no_grad():
            logits = lm(input_ids=ids).logits[:, :-1].reshape(-1, lm.config.vocab_size)
        if handle:
            handle.remove()
        return logits

    # Mean ablation: the mean of the vectors the SAE trained on over every validation example (all 6, not only the
    # 5 scored), from the shard files themselves.
    sd = shards.ShardDir(run.link(run.VAL_SHARDS))
    acts_ntd = np.stack([sd.example(ex, 0) for ex in range(sd.n_ex)]).astype(np.float64)
    all_ids = np.asarray(sd.aux("tokens.bin"))
    trained_nt = ~np.isin(all_ids, sorted(special)) if tokens == "no_special" else np.ones(all_ids.shape, bool)
    mean_d = torch.from_numpy(acts_ntd[trained_nt].mean(0)).float()
    logits = {"clean": logits_with(None), "spliced": logits_with(lambda x: model(x)[0]),
              "ablated": logits_with(torch.zeros_like), "mean_ablated": logits_with(lambda x: mean_d.expand_as(x))}
    targets = ids[:, 1:].reshape(-1)
    ce = {m: torch.nn.functional.cross_entropy(lg, targets).item() for m, lg in logits.items()}
    lp_clean = torch.log_softmax(logits["clean"], -1)
    kl = {
        m: torch.nn.functional.kl_div(torch.log_softmax(logits[m], -1), lp_clean, log_target=True,
                                      reduction="batchmean").item()
        for m in ("spliced", "ablated", "mean_ablated")
    }  # fmt: skip
    for m in ("clean", "spliced", "ablated", "mean_ablated"):
        assert got[f"ce_{m}"] == pytest.approx(ce[m], abs=1e-5)
    for m in ("spliced", "ablated", "mean_ablated"):
        assert got[f"kl_{m}"] == pytest.approx(kl[m], abs=1e-5)
    for base, suffix in (("ablated", ""), ("mean_ablated", "_vs_mean")):
        recovered = (ce[base] - ce["spliced"]) / (ce[base] - ce["clean"])  # a random model: small denominators
        assert got[f"ce_loss_recovered{suffix}"] == pytest.approx(recovered, rel=1e-4, abs=1e-5)
        assert got[f"kl_score{suffix}"] == pytest.approx((kl[base] - kl["spliced"]) / kl[base], rel=1e-4, abs=1e-5)
    assert ce["mean_ablated"] != pytest.approx(ce["ablated"], abs=1e-3)  # two different baselines
    assert got["n_scored_tokens"] == 5 * 15 and got["n_scored_spliced"] > 0
    assert f"{trained_nt.sum()} vectors" in out["config"]["mean_ablation"]
    assert ce["spliced"] != pytest.approx(ce["clean"], abs=1e-3)  # the splice changed something


@pytest.mark.parametrize(
    ("spec", "keys"),
    [
        (text_spec("gpt2", layers=[1]), ("ce_loss_recovered", "kl_score")),
        (text_spec("gpt2", layers=[1], compute_dtype="bfloat16"), ("ce_loss_recovered", "kl_score")),
        (text_spec("bert", layers=[1]), ("pooled_cos_recovered", "pooled_rel_err_recovered", "cls_cos_recovered")),
        (vision_spec("vit", layers=[1]), ("pooled_cos_recovered", "pooled_rel_err_recovered", "cls_rel_err_recovered")),
        (vision_spec("dinov2_with_registers", layers=[1]), ("pooled_cos_recovered", "cls_cos_recovered")),
    ],
    ids=["gpt2", "gpt2-bf16", "bert", "vit", "dinov2-registers"],
)
def test_known_answers_identity_and_zero_reconstruction(spec, keys, tmp_path):
    plan = extract.plan(typed(spec))
    sd = _shards(tmp_path, spec)
    view = loaders.LayerView(sd, 1, auto_tokens_of(sd.metadata))  # no_special for text, content for vision
    m = splice.load_model(plan.info, plan.spec.model, plan.spec.compute_dtype, torch.device("cpu"))
    point = splice.Point("residual", 1)
    identity = evaluate.three_passes(m, plan, view, splice.Splice.at(point, lambda x: x), 3, 2, "cpu", progress=False)
    zero = evaluate.three_passes(m, plan, view, splice.Splice.at(point, torch.zeros_like), 3, 2, "cpu", progress=False)
    for key in keys:
        assert identity[key] == pytest.approx(1.0, abs=1e-6), key
        assert zero[key] == pytest.approx(0.0, abs=1e-9), key
    mask_bt = evaluate.splice_mask(view, plan.info, 0, 2)
    ids_nt = np.array(sd.aux("tokens.bin")[:2]) if plan.info.modality == "text" else None
    # The prefix replayed from the clean pass gives exactly what running every block again gives.
    batch = evaluate.example_inputs(plan, sd)
    prefix = splice.Prefix.of(splice.Splice.at(point, torch.zeros_like))
    clean = splice.spliced_forward(m, batch(0, 2), mask_bt, None, prefix)
    assert sorted(prefix.outputs) == [0, 1]
    assert torch.equal(clean, splice.spliced_forward(m, batch(0, 2), mask_bt, None))
    for fn in (torch.zeros_like, lambda x: 2 * x):
        replayed = splice.spliced_forward(m, batch(0, 2), mask_bt, splice.Splice.at(point, fn), prefix)
        assert torch.equal(replayed, splice.spliced_forward(m, batch(0, 2), mask_bt, splice.Splice.at(point, fn)))
    assert "forward" not in m.blocks[0].__dict__  # the blocks are restored
    if ids_nt is not None:  # text: [BOS] body with EOS between documents; the specials (ids 1, 2) stay clean
        assert plan.packing.prefix == (1,) and plan.packing.separator == (2,)
        assert torch.equal(mask_bt, torch.from_numpy(ids_nt[:2] > 2)) and not mask_bt[:, 0].any()
    elif ids_nt is None:  # vision: CLS and registers stay clean, every patch is replaced
        assert mask_bt.sum(1).tolist() == [plan.info.patches_per_ex] * 2 and not mask_bt[:, 0].any()
    if m.causal:
        assert identity["kl_spliced"] == pytest.approx(0.0, abs=1e-7)
        assert identity["ce_spliced"] == pytest.approx(identity["ce_clean"], abs=1e-6)
        assert zero["ce_ablated"] > zero["ce_clean"]
    else:
        assert identity["pooled_cos_spliced"] == pytest.approx(1.0, abs=1e-9)
        assert identity["pooled_rel_err_spliced"] == pytest.approx(0.0, abs=1e-9)
        assert zero["pooled_rel_err_ablated"] > 0


def test_wrong_spec_is_one_line_error(tiny_lm_dpath, tmp_path, capsys):
    spec = text_spec("gpt2", layers=[1])
    run = _run(tmp_path, spec, 1, _random_sae(32))
    other = text_spec("gpt2", layers=[1], context_length=8)
    before = sorted(p.name for p in run.root.rglob("*"))
    assert cli.main(["evaluate", "--run", str(run.root), str(_spec_config(tmp_path, other)), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "validated on shards" in err and "config.json" in err
    assert sorted(p.name for p in run.root.rglob("*")) == before
    config_fpath = _spec_config(tmp_path, other, also=text_spec("gpt2", layers=[1], context_length=12))
    assert cli.main(["evaluate", "--run", str(run.root), str(config_fpath), "--no-progress"]) == 1
    assert "none of its activations (also, val) plans the run's validation shards" in capsys.readouterr().err


@pytest.mark.parametrize("hook", [name for name in hooks.HOOK_POINTS if name != hooks.RESIDUAL])
def test_an_sae_on_another_hook_point_is_spliced_at_it_and_the_evaluation_names_it(tmp_path, hook):
    """`saeflow evaluate` splices an SAE at the hook point its shards hold (tests/test_splice.py checks the splice of
    every hook point of every family against plain transformers): the same numbers as the splice at that point, not
    those of the residual stream, and the JSON names the hook and what each baseline wrote."""
    spec = text_spec("gpt2", layers=[1], hook=hook)
    model = _random_sae(32)
    run = _run(tmp_path, spec, 1, model)
    argv = ["evaluate", "--run", str(run.root), str(_spec_config(tmp_path, spec)), "--no-progress", "--device", "cpu",
            "--batch-size", "4"]  # fmt: skip
    assert cli.main(argv) == 0
    out = json.loads(run.evaluation_fpath(run.config()["val_shards"]).read_text())
    point = {"hook": hook, "layer": 1}
    assert out["config"]["hook"] == hook and out["config"]["splice"] == {"read": point, "write": point}
    assert out["config"]["ablation"] == f"{hook} of block 1 replaced by zeros at the spliced positions"
    assert out["config"]["mean_ablation"].startswith(f"{hook} of block 1 replaced by the mean of the ")
    plan = extract.plan(typed(spec))
    sd = shards.ShardDir(run.link(run.VAL_SHARDS))
    view = loaders.LayerView(sd, 1, "no_special")
    m = splice.load_model(plan.info, plan.spec.model, "float32", torch.device("cpu"))
    mean_d, _ = evaluate.mean_activation(view)
    n_ex = out["config"]["n_ex"]

    def at(name: str) -> dict:
        one = evaluate.sae_splice(model, splice.Point(name, 1))
        return evaluate.three_passes(m, plan, view, one, n_ex, 4, "cpu", progress=False, mean_d=mean_d)

    assert out["metrics"] == at(hook)
    assert out["metrics"]["ce_spliced"] != at("residual")["ce_spliced"]


def test_an_evaluation_that_scores_no_spliced_position_warns_and_reports_nulls(tmp_path, caplog):
    """Context 2 with a BOS under no_special: the one spliced position is the last of each example, which no scored
    next-token prediction sees; the evaluation says so and reports nulls, not a perfect or a 0/0 score."""
    spec = text_spec("gpt2", layers=[1], context_length=2)
    run = _run(tmp_path, spec, 1, _random_sae(32))
    view = loaders.LayerView(shards.ShardDir(run.link(run.VAL_SHARDS)), 1, "no_special")
    keep_nt = view.keep(0, view.sd.n_ex)
    assert keep_nt[:, 1].any() and not keep_nt[:, 0].any()  # [BOS] x: x is spliced, BOS is not
    assert cli.main(["evaluate", "--run", str(run.root), str(_spec_config(tmp_path, spec)), "--no-progress",
                     "--device", "cpu"]) == 0  # fmt: skip
    got = json.loads(run.evaluation_fpath(run.config()["val_shards"]).read_text())["metrics"]
    assert got["n_scored_spliced"] == 0 and got["n_scored_tokens"] == 6
    assert "nothing scored is downstream of a spliced position" in caplog.text
    assert {k for k, v in got.items() if v is not None} == {"ce_clean", "n_scored_tokens", "n_scored_spliced"}
    assert {"ce_loss_recovered", "ce_loss_recovered_vs_mean", "kl_score", "ce_mean_ablated"} <= got.keys()
    # Four examples scored with context 16 see their splice: the count is of scored tokens after a spliced one.
    mask_bt = torch.tensor([[False, True, True, False], [False, False, False, True]])
    assert scoring.n_spliced_scored(mask_bt, causal=True) == 2 and scoring.n_spliced_scored(mask_bt, False) == 2


def _scores(**means: float) -> scoring.Scores:
    scores = scoring.Scores()
    for name, value in means.items():
        scores.add(name, torch.tensor([value], dtype=torch.float64))
    return scores


def test_a_ratio_over_float_noise_is_null_not_minus_zero():
    # The ablation changed nothing: cos_ablated is 1 within an ulp (1 - cos = -2.2e-16), and so is cos_spliced.
    one_up = 1.0 + 2.0**-52
    noise = _scores(pooled_cos_spliced=one_up, pooled_cos_ablated=one_up, pooled_rel_err_spliced=0.0,
                    pooled_rel_err_ablated=1e-12)  # fmt: skip
    got = scoring.summarize(noise, causal=False)
    assert got["pooled_cos_recovered"] is None and got["pooled_rel_err_recovered"] is None
    assert json.loads(json.dumps(got))["pooled_cos_recovered"] is None  # null in the JSON, not -0.0
    lm = scoring.summarize(_scores(ce_clean=3.0, ce_spliced=3.0, ce_ablated=3.0 + 1e-9, kl_spliced=0.0,
                                    kl_ablated=1e-10), causal=True)  # fmt: skip
    assert lm["ce_loss_recovered"] is None and lm["kl_score"] is None
    # A small but real change is a ratio.
    real = scoring.summarize(_scores(ce_clean=3.0, ce_spliced=3.01, ce_ablated=3.1, kl_spliced=0.01,
                                      kl_ablated=0.1), causal=True)  # fmt: skip
    assert real["ce_loss_recovered"] == pytest.approx(0.9) and real["kl_score"] == pytest.approx(0.9)


def _rewrite_in_place(fpath, new_fpath, keep_mtime: bool) -> None:
    """Write `new_fpath`'s bytes over `fpath` in place (same size, same inode), as a fine-tune saved over the
    directory; `keep_mtime` then puts its time stamp back, so its stat is exactly what it was."""
    st, data = fpath.stat(), new_fpath.read_bytes()
    assert len(data) == st.st_size
    with open(fpath, "r+b") as fd:
        fd.write(data)
    assert fpath.stat().st_ino == st.st_ino
    if keep_mtime:
        os.utime(fpath, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["rewritten", "rewritten-stat-kept"])
@pytest.mark.slow
def test_evaluate_refuses_a_model_rewritten_in_place(tiny_lm_dpath, tmp_path, capsys, keep_mtime):
    """Extract, train, then save other weights over the model: evaluate refuses in one line naming the model and the
    shard directory. The new identity sees the rewrite (a new shard hash); when the stat cache cannot (size, mtime
    and inode kept), the clean pass's mismatch with the stored activations does."""
    import transformers

    lm_dpath = tmp_path / "my-lm"
    shutil.copytree(tiny_lm_dpath, lm_dpath)
    weights = lm_dpath / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns - 3600 * 10**9))  # settled
    spec = {"model": {"name": str(lm_dpath)}, "layers": [1], "dataset": {"kind": "builtin_text", "n_ex": 8},
            "context_length": 16, "device": "cpu"}  # fmt: skip
    sd = _shards(tmp_path, spec)
    run = run_from_sae_spec(tmp_path / "runs", sd, layer=1, expansion=2, k=4, aux_k=8, batch_size=32)
    assert run.config()["tokens"] == "no_special"  # the text default
    train.train_runs([run.root], train.TrainSettings(device="cpu"))
    argv = ["evaluate", "--run", str(run.root), str(_spec_config(tmp_path, spec)), "--no-progress", "--device", "cpu"]
    assert cli.main(argv) == 0  # the model extraction ran: its clean pass matches the shards
    assert cli.main([*argv, "--compute-dtype", "bfloat16"]) == 0  # within bfloat16's tolerance
    tuned = transformers.GPT2LMHeadModel.from_pretrained(lm_dpath)
    with torch.no_grad():
        for param in tuned.parameters():
            param.mul_(1.5)
    tuned.save_pretrained(tmp_path / "tuned")
    _rewrite_in_place(weights, tmp_path / "tuned" / "model.safetensors", keep_mtime)
    capsys.readouterr()
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading bar, when it loaded
    assert err.startswith("saeflow evaluate: error: model ") and str(lm_dpath) in err and str(sd.dpath) in err, err
    assert ("does not compute the activations stored" if keep_mtime else "rewritten in place") in err
