"""Hook points (extraction/hooks.py, docs/extraction.md "Hook points"): every family's hook points equal a forward hook
on the submodule the docs name in plain transformers, bit for bit on CPU; several come from one forward pass that
stops after the deepest block; the hook is hashed only when it is not the residual stream; bad hooks are one-line
errors at plan time (or at load, for a block that lacks its module)."""

import copy
import json

import numpy as np
import pytest
import torch
import transformers

from builders import ARCH_CONFIGS, MINILM, TINY_TEXT, file_bytes, text_spec, typed, vision_spec
from saeflow import config
from saeflow.cli import main
from saeflow.errors import SaeflowError
from saeflow.extraction import adapters, extract, hooks
from saeflow.planning import WorkflowPlan, evaluations, extraction_passes, pending_passes
from saeflow.store import shards
from saeflow.store.shards.validate import validate
from workflow_helpers import tree_state

DECODER = dict(TINY_TEXT, num_key_value_heads=1, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    **ARCH_CONFIGS,
    "qwen2": DECODER,
    "qwen3": dict(DECODER, head_dim=16),
    "mistral": DECODER,
    "roberta": dict(TINY_TEXT, max_position_embeddings=64, pad_token_id=1),
}
TEXT = ("gpt2", "llama", "qwen2", "qwen3", "mistral", "bert", "roberta")
# The submodule of a block each hook point records, as docs/extraction.md names it (transformers 5); "" is the block.
DECODER_PATHS = {"attn_out": "self_attn", "mlp_out": "mlp", "mlp_in": "post_attention_layernorm"}
CLIP_PATHS = {"attn_out": "self_attn", "mlp_out": "mlp", "mlp_in": "layer_norm2"}
DINO_PATHS = {"attn_out": "layer_scale1", "mlp_out": "layer_scale2", "mlp_in": "norm2"}
BERT_PATHS = {"attn_out": "attention.output.dense", "mlp_out": "output.dense", "mlp_in": "attention.output.LayerNorm"}
DOC_PATHS = {
    "vit": {"attn_out": "attention", "mlp_out": "mlp", "mlp_in": "layernorm_after"},
    "clip_vision_model": CLIP_PATHS,
    "siglip_vision_model": CLIP_PATHS,
    "dinov2": DINO_PATHS,
    "dinov2_with_registers": DINO_PATHS,
    "gpt2": {"attn_out": "attn", "mlp_out": "mlp", "mlp_in": "ln_2"},
    **dict.fromkeys(("llama", "qwen2", "qwen3", "mistral"), DECODER_PATHS),
    "bert": BERT_PATHS,
    "roberta": BERT_PATHS,
}
# resid_mid, the stream between a pre-norm block's sublayers, is the INPUT of the norm before its MLP (a forward
# pre-hook on it here); post-norm BERT and RoBERTa have none of their own (their stream after attention is mlp_in).
DOC_INPUTS = {arch: {"resid_mid": paths["mlp_in"]} for arch, paths in DOC_PATHS.items()
              if arch not in ("bert", "roberta")}  # fmt: skip


def family_points(arch: str) -> list[str]:
    """The hook points the docs give this family, in the registry's order; the registry must give it the same."""
    documented = {hooks.RESIDUAL, *DOC_PATHS[arch], *DOC_INPUTS.get(arch, {})}
    registered = [name for name, point in hooks.HOOK_POINTS.items() if point.candidates(arch)]
    assert set(registered) == documented, arch
    return registered


def spec_of(arch: str, **overrides) -> dict:
    """3 blocks, layers 0 and 1: block 2 must never run."""
    model = {"random": {"arch": arch, "config": CONFIGS[arch], "seed": 0}}
    build = text_spec if arch in TEXT else vision_spec
    return build("gpt2" if arch in TEXT else "vit", model=model, layers=[0, 1], **overrides)


def counting_loads(monkeypatch) -> list:
    """Make adapters.load count each block's forward calls: [(adapter, calls per block)] of every load."""
    loads, load = [], adapters.load

    def counted(*args, **kwargs):
        adapter = load(*args, **kwargs)
        calls = [0] * len(adapter.blocks)
        for i, block in enumerate(adapter.blocks):
            block.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
        loads.append((adapter, calls))
        return adapter

    monkeypatch.setattr(adapters, "load", counted)
    return loads


def plain_model(arch: str):
    """The same random model, built by plain transformers (extraction seeds torch the same way)."""
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(transformers.AutoConfig.for_model(arch, **CONFIGS[arch])).eval()


def hooked_reference(model, arch: str, plan_: extract.Plan, sd: shards.ShardDir) -> dict:
    """{(hook point, layer): (n, T, D)}: forward hooks on the documented submodules of plain transformers' `model`,
    run on the extraction's inputs in its batches (whole model, no early exit)."""
    blocks = adapters.find_blocks(model)
    recorded: dict = {}

    def record(key):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            recorded.setdefault(key, []).append(out.detach())

        return hook

    def record_input(key):
        return lambda module, args: recorded.setdefault(key, []).append(args[0].detach())

    paths = {hooks.RESIDUAL: "", **DOC_PATHS[arch]}
    for layer in sd.metadata.layers:
        for name, path in paths.items():
            blocks[layer].get_submodule(path).register_forward_hook(record((name, layer)))
        for name, path in DOC_INPUTS.get(arch, {}).items():
            blocks[layer].get_submodule(path).register_forward_pre_hook(record_input((name, layer)))
    md = sd.metadata
    with torch.inference_mode():
        for lo, hi in extract.batches(md.n_ex, md.ex_per_shard, plan_.spec.batch_size, 0):
            if arch in TEXT:
                ids = torch.from_numpy(np.array(sd.aux("tokens.bin")[lo:hi], dtype=np.int64))
                model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
            else:
                x = np.stack([plan_.dataset.example(i, plan_.preprocess)[0] for i in range(lo, hi)])
                model(pixel_values=torch.from_numpy(x))
    out = {key: torch.cat(parts) for key, parts in recorded.items()}
    if arch == "dinov2_with_registers":  # CLS, registers, patches: the registers are not stored
        r = CONFIGS[arch]["num_register_tokens"]
        out = {key: torch.cat([acts[:, :1], acts[:, 1 + r :]], 1) for key, acts in out.items()}
    return out


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_each_hook_point_equals_a_forward_hook_on_its_submodule(arch, shards_root, monkeypatch):
    loads = counting_loads(monkeypatch)
    specs_ = [typed(spec_of(arch, hook=name)) for name in family_points(arch)]  # every point the family has
    results = extract.extract_pass(specs_, shards_root, progress=False)
    assert len({r.dpath for r in results}) == len(specs_) and not any(r.reused for r in results)
    (adapter, calls), = loads  # one model, one forward pass per batch for all hook points, none after block 1
    md = shards.ShardDir(results[0].dpath).metadata
    n_batches = len(extract.batches(md.n_ex, md.ex_per_shard, specs_[0].batch_size, 0))
    assert calls == [n_batches, n_batches, 0]
    reference = hooked_reference(plain_model(arch), arch, extract.plan(specs_[0]), shards.ShardDir(results[0].dpath))
    assert_hooks_equal(specs_, results, reference)


def assert_hooks_equal(specs_, results, reference) -> None:
    for spec, result in zip(specs_, results):
        sd = shards.ShardDir(result.dpath)
        assert sd.metadata.data.get("hook") == (None if spec.hook == hooks.RESIDUAL else spec.hook)
        for layer in sd.metadata.layers:
            stored_ntd = torch.from_numpy(np.stack([sd.example(i, layer) for i in range(sd.n_ex)]))
            ref_ntd = reference[spec.hook, layer].float()
            assert stored_ntd.shape == ref_ntd.shape and torch.equal(stored_ntd, ref_ntd), (spec.hook, layer)


def test_the_real_minilm_checkpoint_at_every_hook_point_equals_forward_hooks_on_its_submodules(shards_root):
    """Real weights at their real width (all-MiniLM-L6-v2: post-norm BERT, d 384, 6 blocks; its WordPiece tokenizer),
    not a random toy: one pass, every hook point of blocks 2 and 5, bit for bit plain transformers' submodules."""
    spec = {"model": {"name": MINILM}, "layers": [2, -1], "dataset": {"kind": "builtin_text", "n_ex": 3},
            "context_length": 24, "batch_size": 2, "device": "cpu"}  # fmt: skip
    specs_ = [typed({**spec, "hook": name}) for name in family_points("bert")]
    results = extract.extract_pass(specs_, shards_root, progress=False)
    sd = shards.ShardDir(results[0].dpath)
    assert sd.metadata.d_model == 384 and sd.metadata.layers == (2, 5)
    model = transformers.AutoModel.from_pretrained(MINILM).eval()
    assert_hooks_equal(specs_, results, hooked_reference(model, "bert", extract.plan(specs_[0]), sd))


def test_the_hook_is_hashed_only_when_it_is_not_the_residual_stream():
    bare = text_spec()
    md = extract.plan_activation(typed(bare))
    assert extract.plan_activation(typed({**bare, "hook": "residual"})).hash == md.hash and "hook" not in md.data
    other = {name: extract.plan_activation(typed({**bare, "hook": name})) for name in hooks.HOOK_POINTS
             if name != hooks.RESIDUAL}  # fmt: skip
    assert len({m.hash for m in other.values()} | {md.hash}) == len(hooks.HOOK_POINTS)
    for name, hooked in other.items():
        data = dict(hooked.data)
        assert data.pop("hook") == name and data == md.data  # nothing else changes
        assert hooked.to_dict().keys() == md.to_dict().keys()  # protocol 2.0's keys: the hook lives in `data`


def test_a_pass_reuses_a_published_directory_and_computes_what_one_spec_alone_would(shards_root, tmp_path, capsys):
    residual, mlp_out = typed(vision_spec()), typed(vision_spec(hook="mlp_out"))
    published = [extract.extract(unit, shards_root, progress=False).dpath for unit in extract.plan_units(residual)]
    before = [tree_state(dpath) for dpath in published]
    cfg = {"shards_root": str(shards_root), "activations": {"res": vision_spec(), "mlp": vision_spec(hook="mlp_out")},
           "saes": {}}  # fmt: skip
    (tmp_path / "c.yaml").write_text(json.dumps(cfg))
    assert main(["extract", str(tmp_path / "c.yaml"), "--no-progress"]) == 0  # both entries, every layer: one pass
    out, err = capsys.readouterr()
    mlp_units = extract.plan_units(mlp_out)  # a directory per layer (issue 40)
    assert len(mlp_units) == 2
    mlp_dpaths = [str(shards_root / extract.plan_activation(unit).hash) for unit in mlp_units]
    assert out.split() == [*map(str, published), *mlp_dpaths]
    assert f"activation res: {published[0]} already exists and is valid; nothing to do" in err
    assert [tree_state(dpath) for dpath in published] == before  # reused, never rewritten
    for unit in mlp_units:  # each layer's directory from the pass is what its spec of one layer extracts alone
        alone = extract.extract(unit, tmp_path / "alone", progress=False).dpath
        assert file_bytes(shards_root / alone.name) == file_bytes(alone)


def test_a_split_pass_writes_a_part_of_each_directory_per_job_and_seals_what_one_job_would(shards_root, tmp_path,
                                                                                           monkeypatch):
    specs_ = [typed(vision_spec(hook=point, parts=2, layers=[0, 1])) for point in ("mlp_in", "mlp_out")]
    loads = counting_loads(monkeypatch)
    for part in ((0, 2), (1, 2)):
        results = extract.extract_pass(specs_, shards_root, progress=False, part=part)
        assert [r.dpath.name for r in results] == [f"part-{part[0]}-of-2"] * 2
    assert [calls for _, calls in loads] == [[2, 2, 0]] * 2  # shards of 3, 3 | 3, 1 examples: a batch each
    for spec in specs_:
        sealed = extract.seal(spec, shards_root, 2).dpath
        assert file_bytes(sealed) == file_bytes(extract.extract(spec, tmp_path / "one-job", progress=False).dpath)


def test_a_non_residual_directory_is_a_valid_protocol_2_0_directory(shards_root, capsys):
    dpath = extract.extract(typed(text_spec(hook="mlp_in")), shards_root, progress=False).dpath
    assert validate(dpath, deep=True).warnings == [] and main(["validate", str(dpath), "--deep"]) == 0
    metadata = json.loads((dpath / "metadata.json").read_text())
    assert shards.Metadata.from_dict(metadata).hash == dpath.name and metadata["data"]["hook"] == "mlp_in"
    sd = shards.ShardDir(dpath)
    assert sd.example(0, 0).shape == (16, 32)
    capsys.readouterr()
    assert main(["info", str(dpath)]) == 0 and "  layers       [0, 2] (mlp_in)" in capsys.readouterr().out


def one_line(err: Exception) -> str:
    text = str(err)
    assert "\n" not in text, text
    return text


def test_bad_hooks_are_one_line_errors_at_plan_time(monkeypatch, tmp_path, capsys):
    fpath = tmp_path / "bad.yaml"
    fpath.write_text(json.dumps({"activations": {"a": text_spec(hook="mlp")}, "saes": {}}))
    assert main(["plan", str(fpath)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"saeflow plan: error: config file {fpath}: config does not match the schema: activations.a.hook: 'mlp' is "
        "not one of 'residual', 'attn_out', 'mlp_out', 'mlp_in', 'resid_mid'; did you mean 'mlp_in'?"
    )
    # A family that lacks a hook point: post-norm BERT has no resid_mid of its own (the registry says so)
    bert = typed(text_spec(hook="resid_mid", model={"random": {"arch": "bert", "config": CONFIGS["bert"], "seed": 0}}))
    with pytest.raises(SaeflowError) as err:
        extract.plan_activation(bert)
    assert one_line(err.value) == ("hook: bert (bert) has no resid_mid (the residual stream between the attention and "
                                   "MLP sublayers); it has: residual, attn_out, mlp_out, mlp_in")  # fmt: skip
    monkeypatch.setitem(hooks.HOOK_POINTS["attn_out"].paths, "gpt2", ())
    spec = typed(text_spec(hook="attn_out"))
    with pytest.raises(SaeflowError) as err:
        extract.plan_activation(spec)
    assert one_line(err.value) == (
        "hook: gpt2 (gpt2) has no attn_out (the attention sublayer's output); it has: residual, mlp_out, mlp_in, "
        "resid_mid"
    )
    cfg = config.validate({"shards_root": "s", "runs_root": "r", "activations": {"a": text_spec(hook="attn_out")},
                           "saes": {}})  # fmt: skip
    with pytest.raises(SaeflowError, match=r"^activations\.a: hook: gpt2 \(gpt2\) has no attn_out"):
        WorkflowPlan.from_config(cfg)


def test_a_block_without_the_submodule_is_refused_before_the_first_batch(monkeypatch, shards_root):
    monkeypatch.setitem(hooks.HOOK_POINTS["mlp_in"].paths, "gpt2", ("post_mlp_norm",))
    run_points = adapters.Adapter.run_points
    monkeypatch.setattr(adapters.Adapter, "run_points", lambda *a: pytest.fail("a batch ran"))
    spec = typed(text_spec(hook="mlp_in"))
    with pytest.raises(SaeflowError) as err:
        extract.extract(spec, shards_root, progress=False)
    assert one_line(err.value) == (
        "hook mlp_in: gpt2 block GPT2Block has no submodule post_mlp_norm (the MLP's input after its norm)"
    )
    assert not (shards_root / extract.plan_activation(spec).hash).exists()
    monkeypatch.setattr(adapters.Adapter, "run_points", run_points)
    assert extract.extract(typed(text_spec()), shards_root, progress=False).n_ex  # the residual stream needs none
    monkeypatch.setitem(hooks.HOOK_POINTS["mlp_in"].paths, "gpt2", ("mlp",))
    with pytest.raises(SaeflowError) as err:
        adapters.load(spec.model).point_taps("mlp_in")
    assert one_line(err.value) == "hook mlp_in: gpt2 block GPT2Block: mlp of block 0 is a GPT2MLP, not a norm"


def test_one_pass_takes_only_specs_that_differ_in_their_hook_and_layers(shards_root):
    with pytest.raises(SaeflowError) as err:
        extract.extract_pass([typed(text_spec()), typed(text_spec(hook="mlp_out", context_length=8))], shards_root)
    assert "differ in context_length: extract each on its own (--activation NAME)" in one_line(err.value)
    with pytest.raises(SaeflowError) as err:  # two layers and one: shards of other sizes
        extract.extract_pass([typed(text_spec()), typed(text_spec(hook="mlp_out", layers=[0]))], shards_root)
    assert "one extraction pass writes directories of one shard size" in one_line(err.value)


def test_the_plan_groups_hook_points_into_passes_and_leaves_published_directories_out(tmp_path, capsys):
    entry = text_spec
    activations = {"res": entry(), "mlp": entry(hook="mlp_out"), "in": entry(hook="mlp_in"),
                   "other": entry(layers=[1], hook="mlp_out"), "split": entry(layers=[1], hook="attn_out", parts=2),
                   "split_in": entry(layers=[1], hook="mlp_in", parts=2)}  # fmt: skip
    saes = {"on_res": {"train": "res", "layer": 0, "k": 4}, "on_mlp": {"train": "mlp", "layer": 0, "k": 4}}
    raw = {"shards_root": str(tmp_path / "s"), "runs_root": str(tmp_path / "r"), "saes": saes,
           "activations": activations}  # fmt: skip
    plan = WorkflowPlan.from_config(config.validate(copy.deepcopy(raw)))
    h, last = plan.layer_hash, plan.activation_metadata["res"].layers[-1]
    assert last == 2 and list(h["res"]) == [0, 2]  # a directory per layer
    passes = extraction_passes(plan)
    (key,) = [k for k, hashes in passes.items() if h["res"][0] in hashes]
    hashes = passes[key]
    # every layer of every hook point of the same inputs (another spec's other layer too): one pass; another
    # `parts`: its own
    assert hashes == tuple(sorted([*(h[name][layer] for name in ("res", "mlp", "in") for layer in (0, 2)),
                                   h["other"][1]]))  # fmt: skip
    assert sorted(passes.values()) == sorted([hashes, tuple(sorted((h["split"][1], h["split_in"][1])))])
    config_fpath = plan.cli_config("passes", key)
    assert set(plan.cli_configs()[config_fpath]["activations"]) == {"res", "mlp", "in", "other"}
    assert pending_passes(plan) == passes
    plan.shard(h["res"][0]).shards_fpath.parent.mkdir(parents=True)
    plan.shard(h["res"][0]).shards_fpath.write_text("[]")  # published (pending_passes only stats)
    assert pending_passes(plan)[key] == tuple(sorted(set(hashes) - {h["res"][0]}))
    fpath = tmp_path / "c.yaml"
    fpath.write_text(json.dumps(raw))
    assert main(["plan", str(fpath)]) == 0
    out = capsys.readouterr().out
    assert f"extraction pass {key[:16]}: res, mlp, in, other, 7 directories (one forward pass, a directory each)" in out
    assert f"activation res layer 2: {h['res'][2]}" in out and f"activation split: {h['split'][1]}" in out
    # evaluate splices at every hook point: the run on mlp_out is evaluated too, on its own shards
    assert sorted((plan.runs[run_id].sae_name, h) for run_id, h in evaluations(plan)) == sorted(
        [("on_res", h["res"][0]), ("on_mlp", h["mlp"][0])])
    assert len(plan.dumps()) == 2


@pytest.mark.slow
def test_the_gpt2_hooks_example_plans_one_pass_and_snakemake_plans_it(tmp_path, monkeypatch):
    """config/examples/gpt2-hooks.yaml as shipped, with a 12-block random GPT-2 as `gpt2` in a Hugging Face cache
    (no download) and a small corpus for its dataset: one extraction pass of both hook points at three layers, three
    runs, and `snakemake -n` plans one extract_pass job with its six directories as its outputs, and an evaluate job
    per run (at its hook point)."""
    import subprocess
    import sys

    from workflow_helpers import REPO_ROOT, SNAKEMAKE_TEST_ARGS, env, local_gpt2_example

    fpaths, cfg = local_gpt2_example(tmp_path, "gpt2-hooks.yaml", monkeypatch)
    plan = WorkflowPlan.from_config(config.validate(copy.deepcopy(cfg)))
    ((key, hashes),) = extraction_passes(plan).items()
    directories = {h for layer_hash in plan.layer_hash.values() for h in layer_hash.values()}
    assert set(hashes) == directories and len(hashes) == 6 and len(plan.runs) == 3  # two hook points, three layers
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO_ROOT / "Snakefile"), "--directory",
                           str(tmp_path), "--configfile", *map(str, fpaths), *SNAKEMAKE_TEST_ARGS, "-n"], env=env(),
                          capture_output=True, text=True, cwd=REPO_ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rule = f"extract_pass_{key[:16]}"
    assert proc.stdout.count(f"rule {rule}:") == 1 and "rule extract:" not in proc.stdout
    assert all(f"{h}/shards.json" in proc.stdout for h in hashes)
    # every mlp_out run is evaluated, spliced at the MLP output it was trained on
    assert proc.stdout.count("rule evaluate:") == len(plan.runs) == len(evaluations(plan))
    for run_id, shard_hash in evaluations(plan):
        assert hooks.stored(plan.metadata[shard_hash].data) == "mlp_out"
        assert f"{run_id}/evaluation/{shard_hash}.json" in proc.stdout
