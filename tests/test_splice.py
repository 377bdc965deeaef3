"""The splice at every hook point of every family, and of the real all-MiniLM-L6-v2 checkpoint (analysis/splice.py,
docs/inference.md "Splice evaluation"): known
answers (an exact reconstruction recovers everything, zeros or the mean recover nothing), and evaluate's numbers
against an independent computation: plain transformers, a forward hook written here on the submodule the docs name,
torch's own cross-entropy, KL and cosine; every hook point the family has, `resid_mid` too. The same for a
transcoder-like splice that reads the MLP's input (or resid_mid) and writes its output: the block's own MLP recovers
everything, and a linear map fitted here agrees with the plain model."""

import dataclasses

import numpy as np
import pytest
import torch
import transformers

from builders import MINILM, typed
from saeflow.analysis import evaluate, splice
from saeflow.errors import SaeflowError
from saeflow.extraction import adapters, extract
from saeflow.store import shards
from saeflow.training import loaders
from saeflow.training.sweeps import auto_tokens_of
from test_hooks import CONFIGS, DOC_INPUTS, DOC_PATHS, TEXT, family_points, plain_model, spec_of

CAUSAL = ("gpt2", "llama", "qwen2", "qwen3", "mistral")
LAYER = 1  # of 3 blocks: block 2 runs after every splice
# evaluate against the plain model, by causal: CE and KL per token from float32 log-probabilities (measured: at most
# 4e-8 apart; the passes of these tiny random models differ by 2e-7 and more), the embeddings' cosine and relative
# error (measured: 2e-16 apart, the same float32 outputs; passes differ by 3e-10 and more).
TOL = {True: 1e-7, False: 1e-12}
# A splice that writes resid_mid writes the attention output that makes it (replacement - block input, which the block
# adds back), so the spliced stream is the replacement to float32 rounding, not bit for bit as at a module's output;
# plain transformers here compute the block's output as the replacement plus its MLP's output. Measured apart: CE and
# KL at most 6.3e-8 (within TOL), the embeddings' cosine and relative error at most 2.7e-8.
ROUNDED_TOL = 1e-7


def tolerance(write: str, causal: bool) -> float:
    return max(ROUNDED_TOL, TOL[causal]) if write == "resid_mid" else TOL[causal]


def mlp(arch: str, block, x_nd: torch.Tensor) -> torch.Tensor:
    """What a family's MLP computes from `mlp_in` to `mlp_out` (docs/extraction.md's modules): a perfect transcoder.
    `forward`, not a call: the splice's own hook sits on the module that writes `mlp_out`."""
    if arch.startswith("dinov2"):
        return block.layer_scale2.forward(block.mlp(x_nd))
    if arch in ("bert", "roberta"):
        return block.output.dense.forward(block.intermediate(x_nd))
    return block.mlp.forward(x_nd)


REAL = {"minilm": "bert"}  # a real checkpoint (all-MiniLM-L6-v2: real weights, d 384, its own tokenizer) -> family


def family_spec(name: str, hook: str):
    if name in REAL:
        return typed({"model": {"name": MINILM}, "layers": [0, LAYER], "dataset": {"kind": "builtin_text", "n_ex": 6},
                      "context_length": 16, "batch_size": 4, "device": "cpu", "hook": hook})  # fmt: skip
    return typed(spec_of(name, hook=hook))


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    """One family's model (a random one, or the real MiniLM), every hook point it has of blocks 0 and 1 extracted in
    one pass, and the plain model."""
    name = request.param
    arch = REAL.get(name, name)
    points = family_points(arch)
    specs_ = [family_spec(name, hook) for hook in points]
    results = extract.extract_pass(specs_, tmp_path_factory.mktemp(name), progress=False)
    plan = extract.plan(specs_[0])
    sds = {hook: shards.ShardDir(r.dpath) for hook, r in zip(points, results)}
    m = splice.load_model(plan.info, plan.spec.model, "float32", torch.device("cpu"))
    base = transformers.AutoModel.from_pretrained(MINILM).eval() if name in REAL else plain_model(arch)
    return arch, plan, sds, m, Plain(arch, plan, sds["mlp_in"], base)


class Plain:
    """The same model built by plain transformers (`base`; saeflow seeds a random model's base, then its LM head, with
    the spec's seed), run on the shards' inputs with hooks written here."""

    def __init__(self, arch: str, plan: extract.Plan, sd: shards.ShardDir, base):
        self.model = base
        if arch in CAUSAL:
            torch.manual_seed(0)
            self.model = transformers.AutoModelForCausalLM.from_config(base.config).eval()
            self.model.base_model.load_state_dict(base.state_dict())
        self.block = adapters.find_blocks(self.model.base_model if arch in CAUSAL else self.model)[LAYER]
        self.paths, self.inputs, self.arch = {"residual": "", **DOC_PATHS[arch]}, DOC_INPUTS.get(arch, {}), arch
        r = 0
        if arch in TEXT:
            self.ids = torch.from_numpy(np.array(sd.aux("tokens.bin"), dtype=np.int64))
            special = [*plan.packing.prefix, *plan.packing.suffix, *plan.packing.separator]
            self.mask = ~torch.from_numpy(np.isin(self.ids.numpy(), special))  # no_special: the specials stay clean
        else:
            self.pixels = torch.from_numpy(np.stack([plan.dataset.example(i, plan.preprocess)[0]
                                                     for i in range(sd.n_ex)]))  # fmt: skip
            r = CONFIGS[arch].get("num_register_tokens", 0) if arch == "dinov2_with_registers" else 0
            self.mask = torch.ones(sd.n_ex, sd.metadata.tokens_per_ex + r, dtype=torch.bool)  # content: every patch
            self.mask[:, : 1 + r if plan.info.cls_token else 0] = False  # not CLS, not the registers
        self.stored_mask = self.mask[:, [0, *range(1 + r, self.mask.shape[1])]] if r else self.mask  # as stored

    def output(self, read: str | None = None, write: str | None = None, fn=None) -> torch.Tensor:
        """Logits or final hidden states with the tensor of `write` (a hook point of block LAYER) replaced at the
        mask by fn(the tensor of `read`); no hook when `write` is None. A point the docs give as a module's output
        is read and replaced by a forward hook on it; `resid_mid`, the input of the norm before the MLP, by a
        forward pre-hook on that norm, and the block's output is then the replacement plus the MLP's output (the
        block adds its MLP's output to resid_mid)."""
        got, handles = {}, []

        def read_hook(module, args, out):
            got["x"] = (out[0] if isinstance(out, tuple) else out)[self.mask]

        def write_hook(module, args, out):
            h = (out[0] if isinstance(out, tuple) else out).clone()
            h[self.mask] = fn(got.pop("x"))
            return (h, *out[1:]) if isinstance(out, tuple) else h

        def read_input(module, args):
            got["x"] = args[0][self.mask]

        def write_input(module, args):
            new = args[0].clone()
            new[self.mask] = fn(got.pop("x"))
            got["resid_mid"] = new
            return (new, *args[1:])

        def keep_mlp_out(module, args, out):
            got["mlp_out"] = out

        def block_output(module, args, out):
            return got.pop("resid_mid") + got.pop("mlp_out")

        if write is not None:
            for point, on_output, on_input in ((read, read_hook, read_input), (write, write_hook, write_input)):
                if point in self.inputs:
                    handles.append(self.block.get_submodule(self.inputs[point]).register_forward_pre_hook(on_input))
                else:
                    handles.append(self.block.get_submodule(self.paths[point]).register_forward_hook(on_output))
            if write in self.inputs:
                handles.append(self.block.get_submodule(self.paths["mlp_out"]).register_forward_hook(keep_mlp_out))
                handles.append(self.block.register_forward_hook(block_output))
        with torch.no_grad():
            if self.arch in TEXT:
                out = self.model(input_ids=self.ids, attention_mask=torch.ones_like(self.ids), use_cache=False)
            else:
                out = self.model(pixel_values=self.pixels)
        for handle in handles:
            handle.remove()
        return out.logits if self.arch in CAUSAL else out.last_hidden_state

    def metrics(self, outs: dict, has_cls: bool) -> dict:
        """CE and KL(clean || pass) per next-token prediction, or the embeddings' cosine and relative error."""
        got = {}
        if self.arch in CAUSAL:
            V = outs["clean"].shape[-1]
            logits = {mode: out[:, :-1].reshape(-1, V).double() for mode, out in outs.items()}
            targets = self.ids[:, 1:].reshape(-1)
            lp_clean = torch.log_softmax(logits["clean"], -1)
            for mode, lg in logits.items():
                got[f"ce_{mode}"] = torch.nn.functional.cross_entropy(lg, targets).item()
                if mode != "clean":
                    got[f"kl_{mode}"] = torch.nn.functional.kl_div(
                        torch.log_softmax(lg, -1), lp_clean, log_target=True, reduction="batchmean"
                    ).item()
            return got
        views = {"pooled": lambda h: h.mean(1), **({"cls": lambda h: h[:, 0]} if has_cls else {})}
        for which, view in views.items():
            clean = view(outs["clean"]).double()
            for mode in (mode for mode in outs if mode != "clean"):
                e = view(outs[mode]).double()
                got[f"{which}_cos_{mode}"] = torch.nn.functional.cosine_similarity(e, clean, dim=-1).mean().item()
                got[f"{which}_rel_err_{mode}"] = ((e - clean).norm(dim=-1) / clean.norm(dim=-1)).mean().item()
        return got


def stored(sd: shards.ShardDir) -> torch.Tensor:
    return torch.from_numpy(np.stack([sd.example(i, LAYER) for i in range(sd.n_ex)])).float()


def evaluated(family, read: str, write: str, fn, mean_d=None) -> dict:
    """evaluate's metrics of the splice over every validation example, in batches of 4 (prefix replayed)."""
    arch, plan, sds, m, _ = family
    view = loaders.LayerView(sds[write], LAYER, auto_tokens_of(sds[write].metadata))
    one = splice.Splice(splice.Point(read, LAYER), splice.Point(write, LAYER), fn)
    seen = {}
    metrics = evaluate.three_passes(m, plan, view, one, view.sd.n_ex, 4, "cpu", progress=False,
                                    check=lambda lo, acts: seen.update(acts), mean_d=mean_d)  # fmt: skip
    for point, acts_btd in seen.items():  # the clean tensors the splice reads and writes are the stored ones
        evaluate.check_stored(sds[point.hook], plan.info, point, "float32", 0, acts_btd)
    return metrics


def recovered(metrics: dict, causal: bool) -> tuple[str, ...]:
    return ("ce_loss_recovered", "kl_score") if causal else ("pooled_cos_recovered", "pooled_rel_err_recovered")


ARCHS = [*sorted(CONFIGS), *REAL]


@pytest.mark.parametrize("family", ARCHS, indirect=True)
def test_an_sae_splice_at_each_hook_point_agrees_with_plain_transformers(family):
    """Per hook point: the identity recovers 1 (KL 0, cosine 1), zeros and the mean recover 0 (the spliced pass is the
    ablated one), and a random linear map gives evaluate's CE, KL and cosine of all passes to 1e-5 of plain
    transformers with a hook written here."""
    arch, plan, sds, m, plain = family
    causal = arch in CAUSAL
    assert m.causal == causal
    has_cls = plan.info.cls_token or arch in ("bert", "roberta")
    g = torch.Generator().manual_seed(1)
    d = plan.info.d_model
    W = torch.eye(d) + torch.randn(d, d, generator=g) / d**0.5
    clean = plain.output()
    for point, sd in sds.items():  # every hook point of the family
        mean_d = stored(sd)[plain.stored_mask].double().mean(0).float()
        identity = evaluated(family, point, point, lambda x: x, mean_d)
        zero = evaluated(family, point, point, torch.zeros_like, mean_d)
        mean = evaluated(family, point, point, lambda x, mean_d=mean_d: mean_d.expand_as(x), mean_d)
        for key in recovered(identity, causal):
            assert identity[key] == pytest.approx(1.0, abs=1e-6), (point, key)
            assert identity[key + "_vs_mean"] == pytest.approx(1.0, abs=1e-6), (point, key)
            assert zero[key] == pytest.approx(0.0, abs=1e-6), (point, key)
            assert mean[key + "_vs_mean"] == pytest.approx(0.0, abs=1e-6), (point, key)
        if causal:
            assert identity["kl_spliced"] == pytest.approx(0.0, abs=1e-7) and zero["kl_ablated"] > 0, point
        else:
            assert identity["pooled_cos_spliced"] == pytest.approx(1.0, abs=1e-7) and zero["pooled_rel_err_ablated"] > 0

        got = evaluated(family, point, point, lambda x: x @ W, mean_d)
        outs = {"clean": clean, "spliced": plain.output(point, point, lambda x: x @ W),
                "ablated": plain.output(point, point, torch.zeros_like),
                "mean_ablated": plain.output(point, point, lambda x, mean_d=mean_d: mean_d.expand_as(x))}  # fmt: skip
        want = plain.metrics(outs, has_cls)
        assert set(want) <= set(got), point
        for key, value in want.items():
            assert got[key] == pytest.approx(value, abs=tolerance(point, causal)), (point, key)
        assert want["kl_spliced" if causal else "pooled_rel_err_spliced"] > 1e-6, point  # it changed what is scored


@pytest.mark.parametrize("family", ARCHS, indirect=True)
def test_a_splice_that_reads_the_mlp_input_and_writes_its_output_is_a_transcoder_seam(family):
    """Read mlp_in (and, in a pre-norm block, resid_mid: what cross-layer transcoders read), write mlp_out of one
    block: the block's own MLP (after its norm, from resid_mid) recovers everything; a linear map fitted here by least
    squares on the stored pairs agrees with plain transformers hooked here (ablations at the target)."""
    arch, plan, sds, m, plain = family
    causal = arch in CAUSAL
    block = m.blocks[LAYER]
    norm = block.get_submodule(DOC_PATHS[arch]["mlp_in"])
    own = {"mlp_in": lambda x: mlp(arch, block, x), "resid_mid": lambda x: mlp(arch, block, norm(x))}
    for read in filter(sds.__contains__, own):
        exact = evaluated(family, read, "mlp_out", own[read])
        for key in recovered(exact, causal):
            assert exact[key] == pytest.approx(1.0, abs=1e-5), (read, key)

        x_nd, y_nd = stored(sds[read])[plain.stored_mask], stored(sds["mlp_out"])[plain.stored_mask]
        X = torch.cat([x_nd, torch.ones(len(x_nd), 1)], 1).double()
        W = torch.linalg.lstsq(X, y_nd.double()).solution.float()  # affine map, fitted on the stored pairs

        def predict(x: torch.Tensor, W=W) -> torch.Tensor:
            return x @ W[:-1] + W[-1]

        mean_d = y_nd.double().mean(0).float()  # the target's mean
        got = evaluated(family, read, "mlp_out", predict, mean_d)
        mean_of = lambda x, mean_d=mean_d: mean_d.expand_as(x)  # noqa: E731
        outs = {"clean": plain.output(), "spliced": plain.output(read, "mlp_out", predict),
                "ablated": plain.output("mlp_out", "mlp_out", torch.zeros_like),
                "mean_ablated": plain.output("mlp_out", "mlp_out", mean_of)}  # fmt: skip
        want = plain.metrics(outs, plan.info.cls_token or arch in ("bert", "roberta"))
        for key, value in want.items():
            assert got[key] == pytest.approx(value, abs=TOL[causal]), (read, key)
        assert want["kl_spliced" if causal else "pooled_rel_err_spliced"] > 3 * TOL[causal]  # not the clean pass


@pytest.mark.parametrize("family", ["gpt2"], indirect=True)
def test_a_splice_must_read_before_it_writes(family):
    _, plan, sds, m, _ = family
    with pytest.raises(SaeflowError, match=r"cannot read mlp_in of block 2 to write mlp_out of block 1: block 1 runs"):
        splice.Splice(splice.Point("mlp_in", 2), splice.Point("mlp_out", 1), torch.zeros_like)
    backwards = splice.Splice(splice.Point("mlp_out", LAYER), splice.Point("mlp_in", LAYER), torch.zeros_like)
    view = loaders.LayerView(sds["mlp_in"], LAYER, "no_special")
    with pytest.raises(SaeflowError) as err:
        evaluate.three_passes(m, plan, view, backwards, 2, 2, "cpu", progress=False)
    assert str(err.value) == (
        "a splice cannot read mlp_out of block 1 to write mlp_in of block 1: the model computes mlp_in of block 1 first"
    )
    assert not any(mod._forward_hooks for mod in m.model.modules())  # every hook is removed


@pytest.mark.parametrize("family", ["gpt2", "bert", "minilm"], indirect=True)
def test_evaluate_puts_a_trained_skip_transcoder_in_place_of_its_mlp_as_plain_transformers_does(family, tmp_path):
    """`saeflow evaluate` on a transcoder run (mlp_in -> mlp_out, skip path, trained here): its prediction replaces the
    MLP's output, its ablations are of the target (zeros, the target shards' mean); CE, KL or cosine of every pass equal
    plain transformers with the trained transcoder hooked here, and the evaluation names what it read and replaced."""
    import json

    from builders import run_from_sae_spec
    from saeflow.training import sae, train

    arch, plan, sds, m, plain = family
    run = run_from_sae_spec(tmp_path / "runs", sds["mlp_in"], target_sd=sds["mlp_out"], layer=LAYER, arch="topk", k=4,
                            expansion=2, batch_size=32, n_epochs=2, skip=True)  # fmt: skip
    train.train_runs([run.root], train.TrainSettings(device="cpu"))
    tc = sae.load_sae(run.sae_fpath)
    assert tc.cfg.transcoder and tc.cfg.skip

    mlp_in_spec = extract.plan(dataclasses.replace(plan.spec, hook="mlp_in")).spec
    cfg = evaluate.EvaluateConfig(run=run.root, spec=mlp_in_spec, progress=False, batch_size=4)
    result = json.loads(evaluate.run_evaluation(cfg).read_text())
    assert result["config"]["splice"] == {"read": {"hook": "mlp_in", "layer": LAYER},
                                          "write": {"hook": "mlp_out", "layer": LAYER}}  # fmt: skip
    assert result["config"]["hook"] == "mlp_out" and sds["mlp_out"].hash in result["config"]["mean_ablation"]

    def predict(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return tc(x)[0]

    mean_d = stored(sds["mlp_out"])[plain.stored_mask].double().mean(0).float()
    outs = {"clean": plain.output(), "spliced": plain.output("mlp_in", "mlp_out", predict),
            "ablated": plain.output("mlp_out", "mlp_out", torch.zeros_like),
            "mean_ablated": plain.output("mlp_out", "mlp_out", lambda x: mean_d.expand_as(x))}  # fmt: skip
    causal = arch in CAUSAL
    want = plain.metrics(outs, plan.info.cls_token or arch in ("bert", "roberta"))
    got = result["metrics"]
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=TOL[causal]), key
    assert want["kl_spliced" if causal else "pooled_rel_err_spliced"] > 1e-5  # the transcoder is not the MLP
