"""Transcoders and skip transcoders (issue 35): an SAE spec with `target` predicts one activation from another.

The plan: the target's shard hash enters the run config only when set, a target that is not the same examples and
tokens and a `skip` on a plain SAE are refused in one line before any job, and the parallel modes a transcoder does
not train in too. The data: the shuffled loader serves (input, target) pairs that stay paired through shuffles,
epochs and a resumed start, in exactly the order (so the mixing) the input alone gets. The model: every registered
architecture computes a transcoder (d_in -> d_out, separate normalization, optional W_skip), its sae.pt loads, and
an SAE's sae.pt is written as before. Training: every architecture learns a planted output dictionary as a
transcoder; a skip transcoder learns the linear part in W_skip.
"""

import copy

import numpy as np
import pytest
import torch

from builders import MODE_FREE, planted_pairs, run_from_sae_spec, write_shards
from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.planning import WorkflowPlan, evaluations
from saeflow.store import runs
from saeflow.training import archs, objectives, train
from saeflow.training.loaders import OrderedLoader, PairedOrderedLoader, ShuffledLoader
from saeflow.training.sae import FORMAT_VERSION, SAE, TRANSCODER_VERSION, load_sae, save_sae
from saeflow.training.specs import SAEConfig, TrainConfig
from test_identity import RANDOM_GPT2, RANDOM_VIT, ROOTS

TRANSCODERS = archs.names(transcoder=True)  # the architectures that claim a transcoder (`Arch.transcodes`)
KINDS = {"sae": {}, "transcoder": {}, "skip": {"skip": True}}  # a transcoder's target is 12 wide, its input 16


# ---------------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------------

def _case(**sae) -> dict:
    """A plan-only config: a random ViT's MLP input and output (one forward pass), its residual stream, a text model."""
    return {**ROOTS, "activations": {"in": {**RANDOM_VIT, "hook": "mlp_in"}, "out": {**RANDOM_VIT, "hook": "mlp_out"},
                                     "res": RANDOM_VIT, "text": RANDOM_GPT2},
            "saes": {"tc": {"train": "in", "target": "out", "layer": 1, "expansion": 2, "k": 4, **sae},
                     "plain": {"train": "res", "layer": 1, "expansion": 2, "k": 4}}}  # fmt: skip


def _plan(cfg: dict) -> WorkflowPlan:
    return WorkflowPlan.from_config(config.validate(copy.deepcopy(cfg)))


def test_a_transcoder_plans_with_its_targets_shard_hash_in_its_run_config_and_only_there():
    plan = _plan(_case(skip=[False, True]))
    by_name = {}
    for run_id, run_plan in plan.runs.items():
        by_name.setdefault(run_plan.sae_name, []).append((run_id, run_plan))
    (plain_id, plain), = by_name["plain"]
    assert {"target", "val_target", "skip"}.isdisjoint(plain.train_config.to_dict())  # an SAE's config as before
    explicit = _plan({**_case(), "saes": {"plain": {"train": "res", "layer": 1, "expansion": 2, "k": 4,
                                                    "target": None, "skip": False}}})  # fmt: skip
    assert list(explicit.runs) == [plain_id]
    (_, off), (_, on) = by_name["tc"]
    assert off.train_config.to_dict()["target"] == plan.shard_hash["out"] == off.train_config.val_target
    assert "skip" not in off.train_config.to_dict() and on.train_config.to_dict()["skip"] is True
    assert off.read_activations == ("in", "in", "out", "out") and off.varying == {"skip": False}
    # the run's per-job config holds its target activation; evaluate splices every run, transcoders in place of
    # what they predict
    assert set(plan.cli_configs()[plan.cli_config("runs", on.run_id)]["activations"]) == {"in", "out"}
    assert sorted(plan.runs[r].sae_name for r, _ in evaluations(plan)) == ["plain", "tc", "tc"]
    # another target is another run; the same target in another spec is the same run
    other = _plan({**_case(), "saes": {"tc": {"train": "in", "target": "res", "layer": 1, "expansion": 2, "k": 4}}})
    assert set(other.runs).isdisjoint(plan.runs)


def test_a_target_of_more_layers_pairs_its_layers_directory():
    """Issue 40: a directory per layer, so a target spec that lists more layers than the input still pairs: the run
    reads its layer's directory of each (layout 1 refused it, the directories' layers differing)."""
    cfg = _case(target="other")
    cfg["activations"]["other"] = {**RANDOM_VIT, "hook": "mlp_out", "layers": [0, 1]}
    plan = _plan(cfg)
    (run,) = [r for r in plan.runs.values() if r.sae_name == "tc"]
    assert run.train_config.target == plan.layer_hash["other"][1] == plan.layer_hash["out"][1]


@pytest.mark.parametrize(("sae", "activations", "message"), [
    ({"target": None, "skip": True}, {},
     "saes.tc: skip: the linear skip path is a transcoder's (set target: <activation>); a plain SAE reconstructs its "
     "own input"),
    ({"target": None, "skip": [False, True]}, {}, "saes.tc: skip: the linear skip path is a transcoder's"),
    ({"target": "nope"}, {}, "saes.tc.target: activation 'nope' is not defined"),
    ({"val": "res"}, {}, "saes.tc: val_target: the transcoder validates on 'res'; name the activation it predicts"),
    ({"target": None, "val_target": "out"}, {}, "saes.tc: val_target: a plain SAE has no target"),
    ({"target": "text"}, {}, "saes.tc.target: activation 'text' is not the same examples and tokens as 'in'"),
    ({"target": "other"}, {"other": {**RANDOM_VIT, "hook": "mlp_out", "dataset": {**RANDOM_VIT["dataset"], "seed": 1}}},
     "saes.tc.target: activation 'other' is not the same examples and tokens as 'in' (their shard metadata differ "
     "in data beyond the hook)"),
    ({"target": "other"}, {"other": {**RANDOM_VIT, "hook": "mlp_out", "layers": [0]}},
     "saes.tc.layer: layer 1 is not extracted by the target activation 'other' (activations.other.layers resolve "
     "to [0])"),
])  # fmt: skip
def test_a_bad_transcoder_is_refused_at_plan_time_in_one_line(sae, activations, message):
    cfg = _case(**sae)
    cfg["activations"].update(activations)
    with pytest.raises(SaeflowError) as err:
        _plan(cfg)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize(("name", "mode"), [(name, mode) for name in TRANSCODERS for mode in archs.MODES])
def test_a_mode_a_transcoder_does_not_train_in_is_refused_at_plan_time_in_one_line(name, mode):
    """The registry says in which parallel modes each architecture trains as a transcoder; the plan refuses the
    others before any job (one process trains every transcoding architecture as a transcoder)."""
    arch = archs.get(name)
    cfg = {**_case(arch=name, **MODE_FREE), "train": {"parallel": mode, "gpus": 2}}
    modes = archs.trains_in(arch, transcoder=True)
    assert "sweep" in modes and "data" in modes or "data" not in arch.modes
    if mode in modes:
        _plan(cfg)
        return
    with pytest.raises(SaeflowError) as err:
        _plan(cfg)
    assert str(err.value) == (f"saes.tc.arch: {name} transcoders do not train with parallel: {mode} (they train "
                              f"with {', '.join(modes)})")  # fmt: skip
    _plan({**cfg, "train": {"parallel": mode, "gpus": 1}})


@pytest.mark.parametrize("name", sorted(archs.REGISTRY))
def test_a_transcoder_of_an_architecture_without_one_is_refused_at_plan_time_in_one_line(name, monkeypatch):
    """`Arch.transcodes` says whether an architecture has a transcoder (matching pursuit's encoder is its decoder's
    transpose: it has none); the plan refuses a transcoder of one without, naming the ones that have it, and plans
    its SAE. Each architecture plans as it declares, then as one that declares none."""
    refusal = (f"saes.tc.arch: {name} has no transcoder (set target: null, or an architecture that transcodes: "
               f"{', '.join(n for n in archs.names(transcoder=True) if n != name)})")  # fmt: skip
    for transcodes in (archs.get(name).transcodes, False):
        monkeypatch.setattr(archs.get(name), "transcodes", transcodes)
        if transcodes:
            _plan(_case(arch=name))
            continue
        with pytest.raises(SaeflowError) as err:
            _plan(_case(arch=name))
        assert str(err.value) == refusal
        _plan({**_case(arch=name), "saes": {"plain": {**_case()["saes"]["plain"], "arch": name}}})


# ---------------------------------------------------------------------------------------------------------------
# The data: pairs
# ---------------------------------------------------------------------------------------------------------------


def _pair_dirs(root, layers=(0,), cls_token=True, ex_per_shard=7, n_ex=40, d_in=8, d_out=6):
    """An input directory and its target: the target's rows are a known function of the input's (2 x[:6] + 1), so
    any row of a batch says whether it is paired with its own input."""
    T = 5
    x_nltd = np.random.default_rng(0).standard_normal((n_ex, len(layers), T, d_in)).astype(np.float32)
    x_nltd += np.arange(n_ex, dtype=np.float32)[:, None, None, None]  # every row distinct
    y_nltd = 2 * x_nltd[..., :d_out] + 1
    kw = dict(layers=layers, cls_token=cls_token, ex_per_shard=ex_per_shard, tag="pairs")
    return (write_shards(root / "s", x_nltd, **kw),
            write_shards(root / "s", y_nltd, data={"hook": "mlp_out"}, **kw))  # fmt: skip


def _paired(x_bd, y_bd) -> bool:
    return torch.equal(2 * x_bd[:, : y_bd.shape[1]] + 1, y_bd)


@pytest.mark.parametrize("layers", [(0,), (0, 1)], ids=["contiguous", "strided"])
def test_pairs_stay_paired_across_shuffles_epochs_and_resume_and_mix_as_the_input_alone(tmp_path, layers):
    """Paired batches hold the input rows the plain loader gives with a pool of as many rows, in the same order (so
    the same mixing, tests/test_loaders.py), every target row beside its own input, every vector once per epoch; a
    resumed start serves the same batches."""
    x_sd, y_sd = _pair_dirs(tmp_path, layers)
    n_pool, batch_size = 48, 16
    plain = ShuffledLoader(x_sd, 0, batch_size, seed=3, buffer_bytes=n_pool * 8 * 4)
    paired = ShuffledLoader(x_sd, 0, batch_size, seed=3, buffer_bytes=n_pool * (8 + 6) * 4, target_dir=y_sd)
    assert paired.n_pool == plain.n_pool == n_pool
    for epoch in (0, 1):
        seen = []
        batches = list(paired.iter_batches(epoch))
        assert len(batches) == len(plain)
        for (x_bd, y_bd), x_plain in zip(batches, plain.iter_batches(epoch), strict=True):
            assert torch.equal(x_bd, x_plain) and _paired(x_bd, y_bd)
            seen.append(x_bd)
        assert sorted(torch.cat(seen)[:, 0].tolist()) == sorted(torch.cat(list(OrderedLoader(x_sd, 0, 64)))[:, 0]
                                                                .tolist())  # fmt: skip
        resumed = list(paired.iter_batches(epoch, 3))
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(resumed, batches[3:], strict=True))
    assert not torch.equal(batches[0][0], list(paired.iter_batches(0))[0][0])  # the epochs differ
    paired.close()
    plain.close()


def test_the_ordered_pass_pairs_rows_and_misaligned_directories_are_refused_in_one_line(tmp_path):
    x_sd, y_sd = _pair_dirs(tmp_path)
    loader = PairedOrderedLoader(x_sd, y_sd, 0, 16, tokens="content")
    pairs = list(loader)
    assert sum(x.shape[0] for x, _ in pairs) == loader.n_vectors == 40 * 4 and all(_paired(x, y) for x, y in pairs)
    loader.close()
    other_x, other_y = _pair_dirs(tmp_path / "other", ex_per_shard=9)
    for target in (other_y, _pair_dirs(tmp_path / "fewer", n_ex=39)[1]):
        with pytest.raises(SaeflowError) as err:
            ShuffledLoader(x_sd, 0, 16, seed=0, target_dir=target)
        assert "a transcoder's target must hold the same examples, tokens and shards" in str(err.value)
        assert "\n" not in str(err.value)
        with pytest.raises(SaeflowError, match="same examples, tokens and shards"):
            PairedOrderedLoader(x_sd, target, 0, 16)


# ---------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------


def _train_config(name: str, transcoder: bool = False, **extra) -> TrainConfig:
    """A run config (a transcoder's: with target shard hashes, as plan_runs writes them)."""
    spec = config.validate({"activations": {}, "saes": {"s": {"train": "t", "layer": 0, "arch": name, **extra}}})
    obj = {k: v for k, v in spec["saes"]["s"].items() if k not in ("train", "val", "target", "val_target")}
    obj = {**obj, "trainer": "saeflow-train-3", "train_shards": "a" * 64, "val_shards": "a" * 64, "tokens": "all"}
    if transcoder:
        obj.update(target="b" * 64, val_target="b" * 64)
    return TrainConfig.from_dict(obj, name)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", TRANSCODERS)
def test_every_architecture_computes_a_transcoder_and_its_loss_reaches_every_parameter(name, kind):
    """Every registered architecture as an SAE, a transcoder (16 -> 12) and a skip transcoder: the declared loss
    terms, every parameter (W_skip too) gets a gradient, the codes are non-negative, the prediction is the documented
    formula, and sae.pt gives back the same function."""
    torch.manual_seed(0)
    cfg = _train_config(name, bool(KINDS[kind]), k=4, aux_k=8, l1_coeff=1.0, **KINDS[kind])
    d_out = 12 if KINDS[kind] else 16
    sae = SAE(cfg.sae_config(16, d_out)).train()
    assert sae.W_dec.shape == (sae.d_sae, d_out) and sae.b_dec.shape == (d_out,)
    with torch.no_grad():
        sae.W_dec.normal_()
        sae.normalize_decoder()
        sae.W_enc.normal_(0, 0.3)
        sae.b_enc.normal_(0, 0.1)
        if sae.cfg.skip:
            sae.W_skip.normal_(0, 0.1)
        if sae.cfg.transcoder:
            sae.target_scale.fill_(0.5)
        sae.scale.fill_(2.0)
    dead = objectives.DeadLatents(sae.d_sae, 1, torch.device("cpu"))
    dead.since_fired_s.fill_(5)  # every latent dead: AuxK runs
    x_bd, y_bd = torch.randn(32, 16), (torch.randn(32, d_out) if sae.cfg.transcoder else None)
    loss = objectives.Objective(cfg, 100)(sae, x_bd, 10, dead, y_bd)
    assert tuple(loss.terms) == archs.get(name).logged_terms(cfg) and torch.isfinite(loss.total)
    loss.total.backward()
    for pname, param in sae.named_parameters():
        assert param.grad is not None and bool(param.grad.abs().sum() > 0), f"{name}: no gradient reaches {pname}"
    sae.eval()
    y_hat_bd, f_bs = sae(x_bd)
    assert bool((f_bs >= 0).all())
    with torch.no_grad():
        want = f_bs @ sae.W_dec + sae.b_dec
        if sae.cfg.skip:
            want = want + (x_bd * sae.scale) @ sae.W_skip
        torch.testing.assert_close(y_hat_bd, want / sae.out_scale)


def test_sae_pt_keeps_an_saes_format_and_a_transcoder_says_it_is_one(tmp_path):
    """An SAE's sae.pt is written as every earlier saeflow wrote it (version 1, no transcoder keys, so an older saeflow
    still reads it); a transcoder's is version 2 and loads back the same function."""
    for cfg, version in ((SAEConfig(d_model=8, d_sae=16, arch="topk", k=2), FORMAT_VERSION),
                         (SAEConfig(d_model=8, d_sae=16, arch="relu", k=2, d_out=6, skip=True), TRANSCODER_VERSION)):
        sae = SAE(cfg)
        torch.manual_seed(1)
        with torch.no_grad():
            for p in sae.parameters():
                p.normal_()
        save_sae(sae, tmp_path / "sae.pt")
        obj = torch.load(tmp_path / "sae.pt", weights_only=True)
        assert obj["version"] == version
        if version == FORMAT_VERSION:
            assert set(obj["config"]) == {"d_model", "d_sae", "arch", "k", "matryoshka"}
            assert set(obj["state_dict"]) == {"W_enc", "b_enc", "W_dec", "b_dec", "scale", "threshold"}
        back = load_sae(tmp_path / "sae.pt")
        x_bd = torch.randn(4, 8)
        assert back.cfg == cfg and torch.equal(back(x_bd)[0], sae.eval()(x_bd)[0])
        (tmp_path / "sae.pt").unlink()
    with pytest.raises(SaeflowError, match="^skip: the linear skip path is a transcoder's"):
        SAEConfig(d_model=8, d_sae=16, arch="topk", k=2, skip=True)


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------


PLANTED_SPECS = {"topk": {"k": 3}, "batchtopk": {"k": 3}, "relu": {"l1_coeff": 2.0}, "jumprelu": {"k": 3},
                 "gated": {"k": 3}}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    x_nd, y_nd, _, atoms_out_ad = planted_pairs(8192, d_in=48, d_out=40, n_atoms=48, k=3, noise=0.01)
    root = tmp_path_factory.mktemp("shards")
    x_sd = write_shards(root, x_nd.reshape(-1, 1, 16, 48), layers=(0,), ex_per_shard=64, tag="tc")
    y_sd = write_shards(root, y_nd.reshape(-1, 1, 16, 40), layers=(0,), ex_per_shard=64, tag="tc",
                        data={"hook": "mlp_out"})  # fmt: skip
    return x_sd, y_sd, atoms_out_ad


@pytest.mark.parametrize("name", TRANSCODERS)
def test_every_architecture_learns_a_planted_output_dictionary_as_a_transcoder(tmp_path, planted, name):
    """Targets that are the same sparse codes on other atoms (plus noise): each architecture at its defaults
    recovers the output atoms, and its validation metrics are of the target (NMSE, L0, dead latents)."""
    assert name in PLANTED_SPECS, f"{name}: give it a spec in PLANTED_SPECS"
    x_sd, y_sd, atoms_out_ad = planted
    run = run_from_sae_spec(tmp_path, x_sd, target_sd=y_sd, arch=name, expansion=2, batch_size=128, n_epochs=6,
                            dead_after_vectors=8192, **PLANTED_SPECS[name])  # fmt: skip
    (result,) = train.train_runs([run.root], train.TrainSettings(device="cpu"))
    sae = load_sae(run.sae_fpath)
    rows_sd = torch.nn.functional.normalize(sae.W_dec.detach(), dim=-1).numpy()  # a transcoder's rows train freely
    cos_a = (atoms_out_ad @ rows_sd.T).max(1)
    assert (cos_a > 0.9).mean() >= 0.9, f"{name}: recovered {(cos_a > 0.9).mean():.0%} of the planted output atoms"
    assert result["nmse"] < 0.2 and {"l0", "n_dead", "nmse"} <= set(result)
    assert sae.cfg.d_out == 40 and sae.d_model == 48
    assert sorted(p.name for p in run.links_dpath.iterdir()) == ["target-shards", "train-shards", "val-shards",
                                                                 "val-target-shards"]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Training in every mode, resume, the CLI
# ---------------------------------------------------------------------------------------------------------------

POOL = "19200"  # a shuffle pool of a few hundred pairs: the pool is refilled many times in a run


def _small_pairs(root):
    x_nd, y_nd, _, _ = planted_pairs(1024, d_in=16, d_out=12, n_atoms=32, k=2, seed=2, noise=0.01)
    x_sd = write_shards(root, x_nd.reshape(-1, 1, 8, 16), layers=(0,), ex_per_shard=16, tag="modes")
    y_sd = write_shards(root, y_nd.reshape(-1, 1, 8, 12), layers=(0,), ex_per_shard=16, tag="modes",
                        data={"hook": "mlp_out"})  # fmt: skip
    return x_sd, y_sd


def _one_step_gradients(name: str) -> dict:
    """On each rank: one step's gradients of every parameter of a skip transcoder, data-parallel (this rank's slice,
    all-reduced) and on one process (the whole batch), from the same weights, batch and dead latents."""
    import copy as copy_mod

    from saeflow.training.ranks import distributed
    from saeflow.training.ranks.dataparallel import data_parallel_loss, rank_slice

    comm = distributed.init("cpu")
    cfg = _train_config(name, True, k=4, aux_k=8, expansion=4, skip=True)
    torch.manual_seed(0)
    sae = SAE(cfg.sae_config(16, 12)).train()
    with torch.no_grad():
        sae.W_dec.normal_()
        sae.normalize_decoder()
        sae.W_enc.normal_(0, 0.3)
        sae.b_enc.normal_(0, 0.1)
        sae.W_skip.normal_(0, 0.1)
        sae.arch.init_parameters(sae, cfg)
    gen = torch.Generator().manual_seed(1)
    x_bd, y_bd = torch.randn(32, 16, generator=gen) * 2, torch.randn(32, 12, generator=gen)
    dead = objectives.DeadLatents(sae.d_sae, 2, torch.device("cpu"))
    dead.since_fired_s[::3] = 5  # a third of the latents dead: AuxK runs
    whole = copy_mod.deepcopy(sae)
    objectives.Objective(cfg, 100)(whole, x_bd, 90, dead, y_bd).total.backward()  # past the TopK warm-up
    part = rank_slice(32, comm)
    data_parallel_loss(objectives.Objective(cfg, 100), sae, x_bd[part], 32, 90, dead, comm, y_bd[part]).total.backward()
    worst = {}
    for (pname, param), want in zip(sae.named_parameters(), whole.parameters(), strict=True):
        got = comm.all_reduce(param.grad)
        worst[pname] = float((got - want.grad).abs().max() / want.grad.abs().max().clamp_min(1e-12))
    comm.close()
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("name", archs.names(mode="data", transcoder=True))
def test_one_data_parallel_step_of_a_skip_transcoder_has_the_one_process_gradients(name):
    from _ranks import run_ranks

    for worst in run_ranks(2, _one_step_gradients, name):
        assert set(worst) >= {"W_skip", "W_dec", "W_enc"} and max(worst.values()) < 1e-5, worst


def _train(run_roots, mode: str, **kw):
    from saeflow.training import entry

    return entry.train_runs(run_roots, entry.TrainSettings(device="cpu", parallel=mode, buffer_bytes=POOL, **kw))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sweep", "data"])
def test_a_skip_transcoder_on_two_ranks_matches_one_process(tmp_path, mode):
    """The ranks read pairs through the distributed loader (each holds part of the pool; data: each rank receives its
    slice of inputs and targets): a skip transcoder ends where one process ends (sweep: the same bytes)."""
    from _ranks import run_ranks

    x_sd, y_sd = _small_pairs(tmp_path / "s")
    spec = dict(arch="topk", k=2, expansion=2, batch_size=64, n_epochs=2, skip=True, matryoshka=[0.25])
    split = run_from_sae_spec(tmp_path / "split", x_sd, target_sd=y_sd, **spec)
    alone = run_from_sae_spec(tmp_path / "alone", x_sd, target_sd=y_sd, **spec)
    results = run_ranks(2, _train, [split.root], mode)
    (want,) = _train([alone.root], "sweep")
    (result,) = results[0]
    if mode == "sweep":
        assert split.sae_fpath.read_bytes() == alone.sae_fpath.read_bytes()
    a, b = load_sae(split.sae_fpath).state_dict(), load_sae(alone.sae_fpath).state_dict()
    for key in b:
        assert float((a[key] - b[key]).abs().max()) <= 1e-3 * max(float(b[key].abs().max()), 1e-6), key
    assert result["nmse"] == pytest.approx(want["nmse"], rel=1e-3) and result["n_vectors"] == want["n_vectors"]


def _init_differences(name: str, skip: bool) -> list[str]:
    """On each rank: the parameters and buffers in which a latent shard's start (`ShardedTrainer.init_from_data`)
    differs from its latents' part of one process's start (`Trainer.init_from_data`) from the same sample."""
    import types

    from saeflow.training.ranks import distributed
    from saeflow.training.ranks.sharded import ShardedTrainer

    comm = distributed.init("cpu")
    cfg = _train_config(name, True, k=4, expansion=4, skip=skip)
    run, cpu = types.SimpleNamespace(root="tc"), torch.device("cpu")
    gen = torch.Generator().manual_seed(3)
    x_nd, y_nd = torch.randn(256, 16, generator=gen) * 3, torch.randn(256, 12, generator=gen) + 1
    whole, shard = train.Trainer(run, cfg, 16, 100, cpu, 12), ShardedTrainer(comm, run, cfg, 16, 100, cpu, 12)
    whole.init_from_data(x_nd, y_nd)
    shard.init_from_data(x_nd, y_nd)
    lo, hi = shard.latents
    axes = {**whole.sae.latent_axes(), "scale": None, "target_scale": None, "threshold": None}
    differ = []
    for key, axis in axes.items():
        want = getattr(whole.sae, key)
        if not torch.equal(getattr(shard.sae, key), want if axis is None else want.narrow(axis, lo, hi - lo)):
            differ.append(key)
    comm.close()
    return differ


@pytest.mark.slow
@pytest.mark.parametrize("name", archs.names(mode="latents", transcoder=True))
def test_a_latent_shard_of_a_transcoder_starts_as_its_latents_of_one_process(name):
    """Each rank's encoder columns are its rows of one process's draw (made after the decoder's, which the shard
    draws and drops), its biases centre the pre-activations the same way, and the scales, b_dec and W_skip are one
    process's: bitwise."""
    from _ranks import run_ranks

    assert run_ranks(2, _init_differences, name, True) == [[], []]


LATENT_SPECS = {"topk": {"k": 2, "matryoshka": [0.25]}, "batchtopk": {"k": 2}, "relu": {"l1_coeff": 2.0},
                "jumprelu": MODE_FREE, "gated": MODE_FREE}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "skip"), [*((name, True) for name in archs.names(mode="latents", transcoder=True)),
                                           ("topk", False)])  # fmt: skip
def test_a_transcoder_on_two_ranks_in_latents_mode_matches_one_process(tmp_path, arch, skip):
    """Latent sharding: each rank holds half the latents (encoder columns reading the input, decoder rows writing the
    target; W_skip and target_scale whole on both) and the ranks' partial decodes are summed. The published sae.pt is
    a transcoder (the skip path too) and ends where one process ends: every weight within 1e-3 of its largest
    magnitude, the validation NMSE of the target within 1e-3 relative."""
    from _ranks import run_ranks

    assert arch in LATENT_SPECS, f"{arch}: give it a spec in LATENT_SPECS"
    x_sd, y_sd = _small_pairs(tmp_path / "s")
    spec = dict(arch=arch, expansion=2, batch_size=64, n_epochs=2, skip=skip, **LATENT_SPECS[arch])
    split = run_from_sae_spec(tmp_path / "split", x_sd, target_sd=y_sd, **spec)
    alone = run_from_sae_spec(tmp_path / "alone", x_sd, target_sd=y_sd, **spec)
    results = run_ranks(2, _train, [split.root], "latents")
    (want,) = _train([alone.root], "sweep")
    (result,), rest = results
    assert rest == []
    sae = load_sae(split.sae_fpath)
    assert sae.cfg.transcoder and sae.cfg.skip == skip and (sae.d_model, sae.d_out) == (16, 12)
    a, b = sae.state_dict(), load_sae(alone.sae_fpath).state_dict()
    assert a.keys() == b.keys() and ("W_skip" in a) == skip and "target_scale" in a
    worst = {key: float((a[key] - b[key]).abs().max()) / max(float(b[key].abs().max()), 1e-6) for key in b}
    assert max(worst.values()) <= 1e-3, worst
    assert result["nmse"] == pytest.approx(want["nmse"], rel=1e-3) and result["n_vectors"] == want["n_vectors"]
    assert result["nmse"] < 1.0  # of the target: better than its mean


@pytest.mark.slow
def test_a_latent_sharded_skip_transcoder_resumes_to_the_bytes_of_an_uninterrupted_run(tmp_path):
    """Stopped after 13 of 32 steps on 2 ranks (one file per rank and a manifest; each rank's holds the whole W_skip,
    b_dec and their Adam moments, bitwise the same on both ranks: no rank's update of them differs), then resumed on
    2 ranks: the same sae.pt bytes as the 2-rank run never stopped."""
    import json

    from _ranks import run_ranks

    x_sd, y_sd = _small_pairs(tmp_path / "s")
    spec = dict(arch="batchtopk", k=2, expansion=2, batch_size=64, n_epochs=2, skip=True)
    clean = run_from_sae_spec(tmp_path / "clean", x_sd, target_sd=y_sd, **spec)
    stopped = run_from_sae_spec(tmp_path / "stopped", x_sd, target_sd=y_sd, **spec)
    run_ranks(2, _train, [clean.root], "latents")
    assert run_ranks(2, _train, [stopped.root], "latents", max_steps=13, checkpoint_every=5) == [[], []]
    manifest = json.loads(stopped.resume_manifest_fpath.read_text())
    assert manifest["step"] == 13 and not stopped.sae_fpath.exists()
    parts = [torch.load(stopped.resume_shards_dpath / shard["fname"], weights_only=True)
             for shard in manifest["shards"]]  # fmt: skip
    axes = load_sae(clean.sae_fpath).latent_axes()
    assert list(axes)[-1] == "W_skip" and float(parts[0]["sae"]["W_skip"].abs().max()) > 0
    for name, axis in axes.items():
        if axis is None:
            moments = [part["opt"]["state"][list(axes).index(name)] for part in parts]
            assert torch.equal(parts[0]["sae"][name], parts[1]["sae"][name]), name
            assert all(torch.equal(moments[0][key], moments[1][key]) for key in moments[0]), name
    run_ranks(2, _train, [stopped.root], "latents")
    assert stopped.sae_fpath.read_bytes() == clean.sae_fpath.read_bytes()


def test_a_transcoder_resumes_to_the_weights_of_an_uninterrupted_run(tmp_path):
    """Stopped with a resume checkpoint after some steps (mid-epoch), then resumed: the pairs come back in the same
    order, so the weights are those of a run never stopped."""
    x_sd, y_sd = _small_pairs(tmp_path / "s")
    spec = dict(arch="batchtopk", k=2, expansion=2, batch_size=64, n_epochs=2, skip=True)
    stopped = run_from_sae_spec(tmp_path / "stopped", x_sd, target_sd=y_sd, **spec)
    alone = run_from_sae_spec(tmp_path / "alone", x_sd, target_sd=y_sd, **spec)
    settings = dict(device="cpu", buffer_bytes=POOL, checkpoint_every=5)
    assert train.train_runs([stopped.root], train.TrainSettings(max_steps=13, **settings)) == []
    assert stopped.resume_fpath.exists()
    train.train_runs([stopped.root], train.TrainSettings(**settings))
    train.train_runs([alone.root], train.TrainSettings(**settings))
    assert stopped.sae_fpath.read_bytes() == alone.sae_fpath.read_bytes()


def test_a_transcoder_trains_and_runs_inference_from_the_cli(tmp_path):
    """`saeflow train`, `inference`, `visuals` and `summary` on a transcoder run: the dump's metrics are of its target
    (its NMSE against the validation target, d_out wide); the SAELens export (no TopK transcoders) and the sparsify one
    (d_out != d_model) refuse it, each in one line (`evaluate`: test_splice)."""
    import json

    from saeflow import cli

    x_sd, y_sd = _small_pairs(tmp_path / "s")
    run = run_from_sae_spec(tmp_path / "runs", x_sd, target_sd=y_sd, arch="topk", k=2, expansion=2, batch_size=64,
                            n_epochs=10)  # fmt: skip
    assert cli.main(["train", "--run", str(run.root), "--device", "cpu"]) == 0
    trained = json.loads(run.final_metrics_fpath.read_text())
    assert cli.main(["inference", "--run", str(run.root), "--shards", str(x_sd.dpath), "--top-k", "2"]) == 0
    dump = run.dump(x_sd.hash)
    metrics = json.loads(dump.metrics_fpath.read_text())
    dump_config = json.loads(dump.config_fpath.read_text())
    assert dump_config["target_hash"] == y_sd.hash and dump_config["d_out"] == 12
    assert metrics["nmse"] == pytest.approx(trained["nmse"], rel=1e-4) and metrics["nmse"] < 0.5
    with pytest.raises(SaeflowError, match="predicts its targets of its train and validation shards only"):
        from saeflow.analysis import inference

        inference.target_of(runs.open_run(run.root), y_sd)
    assert cli.main(["visuals", "--run", str(run.root), "--shards-hash", x_sd.hash]) == 0
    assert dump.index_fpath.exists()
    assert cli.main(["summary", f"--run={run.root}", "--out", str(tmp_path / "summary")]) == 0
    assert str(trained["nmse"])[:6] in (tmp_path / "summary" / "summary.csv").read_text()
    from saeflow.interop.checkpoints import sae_checkpoints

    with pytest.raises(SaeflowError, match="^SAELens has no architecture that computes a topk transcoder .*: export "
                                           "it with --format sparsify$"):  # fmt: skip
        sae_checkpoints.export_sae(load_sae(run.sae_fpath), "saelens", tmp_path / "out")
    with pytest.raises(SaeflowError, match="^sparsify's transcoders predict a target as wide as their input; this one "
                                           "maps d_model=16 to d_out=12$"):  # fmt: skip
        sae_checkpoints.export_sae(load_sae(run.sae_fpath), "sparsify", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_gpt2_transcoders_example_plans_and_snakemake_plans_it(tmp_path, capsys, monkeypatch):
    """config/examples/gpt2-transcoders.yaml as shipped, with a 12-block random GPT-2 as `gpt2` in a Hugging Face
    cache (no download) and a small corpus: one extraction pass of both hook points at 3 layers, 3 MLP-output SAEs
    and 6 transcoders (3 layers, plain and skip), `saeflow plan` and `snakemake -n` plan it: each transcoder's run
    waits for its layer's directory of both."""
    import json
    import subprocess
    import sys

    from saeflow.cli import main
    from saeflow.planning import extraction_passes
    from workflow_helpers import REPO_ROOT, SNAKEMAKE_TEST_ARGS, env, local_gpt2_example

    fpaths, cfg = local_gpt2_example(tmp_path, "gpt2-transcoders.yaml", monkeypatch)
    plan = _plan(cfg)
    ((key, hashes),) = extraction_passes(plan).items()
    directories = {h for layer_hash in plan.layer_hash.values() for h in layer_hash.values()}
    assert set(hashes) == directories and len(hashes) == 6  # two hook points, three layers: one pass
    kinds = sorted((p.sae_name, p.train_config.layer, p.train_config.skip) for p in plan.runs.values())
    assert kinds == sorted([*(("mlp-out", layer, False) for layer in (4, 6, 8)),
                            *(("transcoder", layer, skip) for layer in (4, 6, 8) for skip in (False, True))])
    assert sorted(run_id for run_id, _ in evaluations(plan)) == sorted(plan.runs)  # transcoders spliced too
    assert main(["plan", *map(str, fpaths)]) == 0
    assert "transcoder[layer=4,skip=true]" in capsys.readouterr().out
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO_ROOT / "Snakefile"), "--directory",
                           str(tmp_path), "--configfile", *map(str, fpaths), *SNAKEMAKE_TEST_ARGS, "-n"], env=env(),
                          capture_output=True, text=True, cwd=REPO_ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(f"rule extract_pass_{key[:16]}:") == 1
    # one training job per layer for the SAEs, and one per layer for both transcoders (the same pairs: one pass)
    assert proc.stdout.count("rule train:") == 6 and proc.stdout.count("rule evaluate:") == 9
    assert sorted(len(set(members)) for members in plan.train_passes.values()) == [1] * 3 + [2] * 6
    tc_ids = [r for r, p in plan.runs.items() if p.sae_name == "transcoder"]
    for block in proc.stdout.split("\n\n"):
        tc = [r for r in tc_ids if r in block]
        if ("rule create_run:" in block or "rule evaluate:" in block) and tc:
            layer = plan.runs[tc[0]].train_config.layer
            layer_dirs = [plan.layer_hash[name][layer] for name in ("gpt2-mlp-in", "gpt2-mlp-out")]
            assert all(f"{h}/shards.json" in block for h in layer_dirs), block
    layer = plan.runs[tc_ids[0]].train_config.layer
    assert json.loads(json.dumps(plan.runs[tc_ids[0]].train_config.to_dict()))["target"] == plan.layer_hash[
        "gpt2-mlp-out"][layer]


def test_a_skip_transcoders_memory_estimate_counts_its_skip_path():
    """`auto` mode and the shuffle pool are sized by memory.state_bytes: W_skip (d_in x d_out, the target taken as
    wide as the input) is 16 bytes a parameter of training state beside the SAE's."""
    from saeflow.training import memory

    plain, skip = _train_config("topk", True), _train_config("topk", True, skip=True)
    assert memory.sae_params(skip, 64) - memory.sae_params(plain, 64) == 64 * 64
    assert memory.state_bytes(skip, 64) - memory.state_bytes(plain, 64) == 16 * 64 * 64
