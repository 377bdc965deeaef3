"""Training: planted-dictionary recovery, sweep planning, exact resume after SIGKILL, shared passes, errors."""

import dataclasses
import json
import multiprocessing
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from builders import planted_data, run_from_sae_spec, write_shards
from hang import HANG_SEC
from saeflow import cli, config
from saeflow.errors import SaeflowError
from saeflow.store import shards
from saeflow.store.layout import RunLayout, ShardLayout
from saeflow.training import archs, objectives, rates, sweeps, train
from saeflow.training.sae import SAE, load_sae
from saeflow.training.specs import SAEConfig


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    x_nd, atoms_ad = planted_data(8192, d_model=64, n_atoms=64, k=3)
    sd = write_shards(tmp_path_factory.mktemp("shards"), x_nd.reshape(-1, 1, 16, 64), layers=(0,), tag="planted")
    return sd, atoms_ad


# The planted test's spec of each architecture (k = the planted 3 active atoms where the architecture reads a k:
# JumpReLU's target L0). The test iterates the registry: a new architecture fails here until it has a spec and
# recovers the dictionary.
PLANTED_SPECS = {"topk": {"k": 3}, "batchtopk": {"k": 3}, "relu": {"l1_coeff": 2.0}, "jumprelu": {"k": 3},
                 "gated": {"k": 3}, "mp": {"k": 3}}


@pytest.mark.parametrize(
    "arch, spec",
    [
        *((name, PLANTED_SPECS.get(name)) for name in sorted(archs.REGISTRY)),
        ("batchtopk", {"k": 3, "matryoshka": [0.25]}),
    ],
)
def test_known_answer_planted_dictionary(tmp_path, planted, arch, spec):
    """Every architecture recovers a planted dictionary at its default learning rate in a few hundred steps.

    (At the old fixed lr 4e-4, and for ReLU with unit decoder rows, none of them did: see bench_planted.py.)
    """
    assert spec is not None, f"{arch}: give it a spec in PLANTED_SPECS"
    sd, atoms_ad = planted
    run = run_from_sae_spec(
        tmp_path, sd, arch=arch, expansion=2, batch_size=128, n_epochs=6, dead_after_vectors=8192, **spec
    )
    (result,) = train.train_runs([run.root], train.TrainSettings(device="cpu"))
    sae = load_sae(run.sae_fpath)
    cos_a = (atoms_ad @ sae.W_dec.detach().numpy().T).max(1)
    assert (cos_a > 0.9).mean() >= 0.9, f"{arch}: recovered {(cos_a > 0.9).mean():.0%} of planted directions"
    assert result["nmse"] < 0.2 and result["split"] == "train"  # no val: measured on the training shards
    if arch == "topk":
        assert result["l0"] == 3.0
    if arch == "batchtopk":  # the inference threshold keeps about k latents per vector
        assert 2.0 <= result["l0"] <= 4.5, result["l0"]
    lines = [json.loads(line) for line in run.metrics_log_fpath.read_text().splitlines()]
    assert lines[-1]["final"] and lines[0]["step"] == train.LOG_EVERY
    assert not run.resume_fpath.exists()
    # Done runs are skipped, nothing is rewritten.
    mtime = run.sae_fpath.stat().st_mtime_ns
    assert train.train_runs([run.root]) == [] and run.sae_fpath.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("ghost", [False, True], ids=["relu", "softplus"])
@pytest.mark.parametrize("dead_frac", [0.25, 1.0])
def test_aux_k_loss_and_its_gradients_match_the_plain_definition(ghost, dead_frac):
    """AuxK picks among the dead latents' columns and decodes them with one dense product (objectives.aux_k_loss);
    loss and gradients equal the plain definition: mask the live latents, top-aux_k, activate, decode them all."""
    torch.manual_seed(0)
    sae = SAE(SAEConfig(d_model=16, d_sae=64, arch="topk", k=4))
    with torch.no_grad():
        for param in sae.parameters():
            param.normal_()
    x_bd, resid_bd = torch.randn(32, 16), torch.randn(32, 16)
    dead_s = torch.zeros(64, dtype=torch.bool)
    dead_s[:: round(1 / dead_frac)] = True
    act = torch.nn.functional.softplus if ghost else torch.relu

    def plain():
        pre_bs = sae.pre_acts_normed(x_bd)
        vals_bk, idx_bk = pre_bs.masked_fill(~dead_s, -float("inf")).topk(8, dim=-1)
        f_bs = torch.zeros_like(pre_bs).scatter(1, idx_bk, act(vals_bk))
        return (f_bs @ sae.W_dec - resid_bd).square().sum(-1).mean() / resid_bd.square().sum(-1).mean()

    losses, grads = [], []
    def ours():
        pre_bs = sae.pre_acts_normed(x_bd)
        dead_z, pick_bk = objectives.pick_dead(pre_bs, dead_s, 8)
        return objectives.aux_k_loss(sae, pre_bs.gather(1, dead_z[pick_bk]), dead_z, pick_bk, resid_bd, ghost)

    for loss_fn in (plain, ours):
        sae.zero_grad()
        losses.append(loss_fn())
        losses[-1].backward()
        grads.append([param.grad.clone() for param in (sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec)])
    assert losses[0].item() == pytest.approx(losses[1].item(), rel=1e-5)
    for plain_grad, grad in zip(*grads):
        assert torch.allclose(plain_grad, grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("aux_alpha, revived", [(0.0, False), (1 / 32, True)], ids=["no-handling", "ghost-auxk"])
def test_dead_relu_latents_come_back(tmp_path, planted, monkeypatch, aux_alpha, revived):
    """Half the latents of a ReLU SAE start dead (encoder bias -4: negative pre-activations on every input, where
    ReLU passes no gradient). Without dead-latent handling they stay dead; with it (AuxK through softplus once
    they have been silent for the dead window) they fire again by the end. At the every-architecture rate
    (`rates.auto_lr`, ReLU's own before saeflow-train-4): at ReLU's default 2.5x, 28 of the 64 fire at the end (15 after
    4 epochs), as the faster rate shuts rarely firing latents again (docs/training.md, "Learning rate")."""
    init = train.Trainer.init_from_data

    def init_half_dead(self, x_nd):
        init(self, x_nd)
        with torch.no_grad():
            self.sae.b_enc[::2] = -4.0

    monkeypatch.setattr(train.Trainer, "init_from_data", init_half_dead)
    sd, _ = planted
    run = run_from_sae_spec(tmp_path, sd, arch="relu", expansion=2, batch_size=128, n_epochs=2,
                            dead_after_vectors=2048, aux_alpha=aux_alpha, lr=rates.auto_lr(128))  # fmt: skip
    train.train_runs([run.root], train.TrainSettings(device="cpu"))
    sae = load_sae(run.sae_fpath)
    x_nd = torch.from_numpy(sd.acts(0).reshape(-1, 64).copy())
    with torch.no_grad():
        fired_s = (sae(x_nd)[1] > 0).any(0)
    n_revived = int(fired_s[::2].sum())
    assert (n_revived >= 0.5 * fired_s[::2].numel()) if revived else n_revived == 0, n_revived


AUTO = {"x": "content", "y": "content"}  # what `tokens: auto` means for the hypothetical activations x and y


def _cfg(**saes):
    """The typed SAE specs of a config holding `saes` (validated, so with the schema's defaults)."""
    cfg = config.validate({"activations": {}, "saes": saes})
    return {name: sweeps.SAESpec.from_dict(name, obj) for name, obj in cfg["saes"].items()}


def test_plan_runs_sweep_is_cartesian_and_content_addressed():
    cfg = _cfg(a={"train": "x", "val": "y", "layer": 2, "k": [8, 16], "seed": [0, 1, 2], "matryoshka": [[0.25], [0.5]]})
    plans = sweeps.plan_runs(cfg, {"x": "h" * 64, "y": "v" * 64}, AUTO)
    assert len(plans) == 12 and [p.index for p in plans] == list(range(12))
    # Key order of the spec, last key varies fastest.
    assert [(c["k"], c["seed"], c["matryoshka"]) for c in (p.train_config.to_dict() for p in plans[:3])] == [
        (8, 0, [0.25]),
        (8, 0, [0.5]),
        (8, 1, [0.25]),
    ]
    assert len({p.run_id for p in plans}) == 12
    assert plans[0].train_config.train_shards == "h" * 64 and plans[0].train_config.val_shards == "v" * 64
    assert plans[0].train_activation == "x" and plans[0].val_activation == "y"
    again = sweeps.plan_runs(
        _cfg(a={"train": "x", "val": "y", "layer": 2, "k": [8, 16], "seed": [0, 1, 2], "matryoshka": [[0.25], [0.5]]}),
        {"x": "h" * 64, "y": "v" * 64},
        AUTO,
    )
    assert [p.run_id for p in again] == [p.run_id for p in plans]
    # A flat matryoshka list is one value, not a sweep; another data hash is another run.
    (one,) = sweeps.plan_runs(_cfg(a={"train": "x", "layer": 0, "matryoshka": [0.25, 0.5]}), {"x": "h" * 64}, AUTO)
    assert one.train_config.to_dict()["matryoshka"] == [0.25, 0.5] and one.val_activation == "x"
    (other,) = sweeps.plan_runs(_cfg(a={"train": "x", "layer": 0, "matryoshka": [0.25, 0.5]}), {"x": "g" * 64}, AUTO)
    assert other.run_id != one.run_id
    with pytest.raises(SaeflowError, match="saes.a: activation 'nope' is not defined"):
        sweeps.plan_runs(_cfg(a={"train": "nope", "layer": 0}), {"x": "h" * 64}, AUTO)
    with pytest.raises(SaeflowError, match="saes.a.arch"):
        _cfg(a={"train": "x", "layer": 0, "arch": "nope"})


def test_sweep_planning_does_not_import_torch():
    """Snakemake plans the runs at parse time, in every job: importing torch there would cost seconds each."""
    package_root = str(pathlib.Path(sweeps.__file__).parents[1])  # the child imports the saeflow this test does
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    code = "import saeflow.training.sweeps, sys; assert 'torch' not in sys.modules, 'sweeps imports torch'"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=HANG_SEC)


@pytest.fixture
def small_run(tmp_path):
    x_nd, _ = planted_data(4096, d_model=16, n_atoms=32, k=2, seed=1)
    sd = write_shards(tmp_path / "shards", x_nd.reshape(-1, 1, 8, 16), layers=(0,), ex_per_shard=100, tag="small")
    spec = dict(
        arch="batchtopk", k=2, expansion=4, batch_size=32, n_epochs=3, matryoshka=[0.25], dead_after_vectors=512
    )
    return sd, spec


def _state(run):
    return load_sae(run.sae_fpath).state_dict()


def _train_quietly(run_root):
    sys.stderr = open(os.devnull, "w")
    train.train_runs([run_root], train.TrainSettings(device="cpu", checkpoint_every=20))


@pytest.mark.slow
def test_resume_after_sigkill_gives_identical_weights(tmp_path, small_run):
    sd, spec = small_run
    killed = run_from_sae_spec(tmp_path / "killed", sd, **spec)
    # A forked child (no interpreter start-up to wait for) trains until its first resume checkpoint, then dies.
    proc = multiprocessing.get_context("fork").Process(target=_train_quietly, args=(killed.root,))
    proc.start()
    resume_fpath = killed.resume_fpath
    deadline = time.monotonic() + HANG_SEC
    while not resume_fpath.exists() and proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert proc.exitcode == -signal.SIGKILL, "training ended before it could be killed"
    assert resume_fpath.exists() and not killed.sae_fpath.exists()
    step_at_kill = torch.load(resume_fpath, weights_only=True)["step"]
    assert 0 < step_at_kill < 384
    with open(killed.metrics_log_fpath, "a") as fd:  # as if the kill tore a line
        fd.write('{"step": 99999, "lo')
    (killed.checkpoint_dpath / ".resume.pt.tmp-12345").write_bytes(b"half")
    # Rerun through the CLI, as the workflow does.
    assert cli.main(["train", "--run", str(killed.root), "--device", "cpu", "--checkpoint-every", "20"]) == 0

    clean = run_from_sae_spec(tmp_path / "clean", sd, **spec)
    assert clean.root.name == killed.root.name  # same config, same run id
    train.train_runs([clean.root], train.TrainSettings(device="cpu", checkpoint_every=10**6))
    for name, tensor in _state(clean).items():
        assert torch.equal(tensor, _state(killed)[name]), name
    metrics_of = lambda run: run.metrics_log_fpath.read_text()  # noqa: E731
    assert metrics_of(clean) == metrics_of(killed)
    assert sorted(killed.checkpoint_dpath.iterdir()) == sorted(
        [killed.config_fpath, killed.final_metrics_fpath, killed.metrics_log_fpath, killed.provenance_fpath,
         killed.sae_fpath]
    )  # fmt: skip
    prov = json.loads(killed.provenance_fpath.read_text())
    assert len(prov["platforms"]) == 1 and not prov["mixed_platforms"]  # both attempts ran here


def test_sweep_trains_in_one_pass_like_separately(tmp_path, small_run):
    sd, spec = small_run
    spec = {**spec, "n_epochs": 1}
    together = [run_from_sae_spec(tmp_path / "together", sd, **{**spec, "seed": s}) for s in (0, 1)]
    results = train.train_runs([r.root for r in together], train.TrainSettings(device="cpu"))
    assert {r["run"] for r in results} == {str(r.root) for r in together}
    alone = run_from_sae_spec(tmp_path / "alone", sd, **{**spec, "seed": 1})
    train.train_runs([alone.root], train.TrainSettings(device="cpu"))
    for name, tensor in _state(alone).items():
        assert torch.equal(tensor, _state(together[1])[name]), name
    assert not torch.equal(_state(together[0])["W_dec"], _state(together[1])["W_dec"])


def test_max_steps_then_resume(tmp_path, small_run):
    sd, spec = small_run
    run = run_from_sae_spec(tmp_path, sd, **{**spec, "n_epochs": 1})
    assert train.train_runs([run.root], train.TrainSettings(device="cpu", max_steps=50)) == []
    assert torch.load(run.resume_fpath, weights_only=True)["step"] == 50
    (result,) = train.train_runs([run.root], train.TrainSettings(device="cpu"))
    assert result["step"] == 128 and load_sae(run.sae_fpath).threshold > 0
    assert result["l0"] == pytest.approx(2, abs=0.5)  # BatchTopK's inference threshold keeps ~k latents per vector


def test_a_second_trainer_says_at_once_that_it_waits_and_who_holds_the_run(tmp_path, small_run, caplog):
    """Issue 25: a second `saeflow train` of a run being trained printed nothing for minutes, then "already trained".
    It says at once that it waits for the run's lock and who holds it (pid, host, since when: the holder's record in
    the lock file), then trains once the holder lets go."""
    import socket
    import threading

    from saeflow.store import atomic

    sd, spec = small_run
    run = run_from_sae_spec(tmp_path / "runs", sd, **spec)
    caplog.set_level("INFO", logger="saeflow.store.atomic")
    with atomic.exclusive_lock(run.lock_fpath):  # another trainer (this process: flock locks per open file)
        trainer = threading.Thread(target=train.train_runs, args=([run.root], train.TrainSettings(device="cpu")))
        trainer.start()
        deadline = time.monotonic() + HANG_SEC
        while not any("waiting for the lock" in r.getMessage() for r in caplog.records):
            assert trainer.is_alive() and time.monotonic() < deadline, "the second trainer never said it waits"
            time.sleep(0.05)
        assert not run.sae_fpath.exists()
    trainer.join(timeout=HANG_SEC)
    (waiting,) = [r.getMessage() for r in caplog.records if "waiting for the lock" in r.getMessage()]
    assert waiting.startswith(f"waiting for the lock {run.lock_fpath} (held by pid {os.getpid()} on "
                              f"{socket.gethostname()} since 20")  # fmt: skip
    assert waiting.endswith("): another process works on the same output")
    assert run.sae_fpath.exists() and run.lock_fpath.read_bytes() == b""  # no stale holder left behind


def test_errors_name_the_problem(tmp_path, small_run):
    sd, spec = small_run
    run = run_from_sae_spec(tmp_path, sd, **spec)
    with pytest.raises(SaeflowError, match="does not exist"):
        train.train_runs([tmp_path / "nowhere"])
    with pytest.raises(SaeflowError, match="CUDA is not available"):
        (
            train.train_runs([run.root], train.TrainSettings(device="cuda:0"))
            if not torch.cuda.is_available()
            else (_ for _ in ()).throw(SaeflowError("CUDA is not available (skipped)"))
        )
    # A purged shard directory: the error names the missing files; nothing is written.
    os.chmod(sd.dpath, 0o755)
    (sd.dpath / "acts000003.bin").unlink()
    with pytest.raises(SaeflowError, match="acts000003.bin: missing"):
        train.train_runs([run.root], train.TrainSettings(device="cpu"))
    assert not run.sae_fpath.exists() and not run.metrics_log_fpath.exists()


def test_the_final_metrics_say_which_shards_they_were_measured_on(tmp_path):
    """Issue 40: metrics.json said `split: val` for metrics of the training shards (a run without `val`)."""
    x_nd, _ = planted_data(1024, d_model=16, n_atoms=16, k=2)
    acts = x_nd.reshape(-1, 1, 8, 16)
    train_sd = write_shards(tmp_path / "train", acts[:64], layers=(0,), tag="train")
    val_sd = write_shards(tmp_path / "val", acts[64:], layers=(0,), tag="val")
    spec = dict(arch="topk", k=2, expansion=2, batch_size=64)
    on_train = run_from_sae_spec(tmp_path / "runs", train_sd, **spec)
    on_val = run_from_sae_spec(tmp_path / "runs", train_sd, val_sd, **spec)
    train.train_runs([on_train.root, on_val.root], train.TrainSettings(device="cpu"))
    final = {run: json.loads(run.final_metrics_fpath.read_text()) for run in (on_train, on_val)}
    assert (final[on_train]["split"], final[on_train]["shards"]) == ("train", train_sd.hash)
    assert (final[on_val]["split"], final[on_val]["shards"]) == ("val", val_sd.hash)


def test_lr_schedule_warms_up_then_decays():
    lrs = [rates.lr_at(s, 100, 1.0, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] < 0.01


VIT_SWEEP_CONFIG = """
activations:
  vit:
    model: {random: {arch: vit, config: {hidden_size: 16, num_hidden_layers: 2, num_attention_heads: 2,
            intermediate_size: 32, image_size: 16, patch_size: 8}, seed: 0}}
    layers: [1]
    dataset: {kind: generated_images, n_ex: 8, seed: 0, size: 16}
saes:
  sweep: {train: vit, layer: 1, k: [4, 8]}
"""


def test_cli_create_run(tmp_path, capsys):
    cfg_fpath = tmp_path / "config.yaml"
    cfg_fpath.write_text(VIT_SWEEP_CONFIG)
    args = [
        "create-run",
        str(cfg_fpath),
        "--index",
        "1",
        "--shards-root",
        str(tmp_path / "s"),
        "--runs-root",
        str(tmp_path / "r"),
    ]
    assert cli.main(args) == 0
    run = RunLayout.at(tmp_path / "r", capsys.readouterr().out.strip().rsplit("/", 1)[-1])
    run_dpath = run.root
    train_config = json.loads(run.config_fpath.read_text())
    assert train_config["k"] == 8 and run_dpath.name == train.runs.run_id(train_config)
    assert os.readlink(run.link(run.TRAIN_SHARDS)) == str(
        ShardLayout.at(tmp_path / "s", train_config["train_shards"]).dpath.resolve()
    )
    assert cli.main(args) == 0 and capsys.readouterr().out.strip().endswith(run_dpath.name)  # idempotent
    assert cli.main([*args[:3], "2", *args[4:]]) == 1
    assert "--index 2 is out of range: saes.sweep expands into 2 points" in capsys.readouterr().err


def test_cli_create_run_takes_its_roots_from_the_config(tmp_path, monkeypatch, capsys):
    """Issue 25: `saeflow create-run CONFIG` asked for --shards-root/--runs-root even when the config sets them;
    without them it creates the run where the workflow plans it, linked to the config's shards_root."""
    from saeflow.planning import WorkflowPlan

    monkeypatch.chdir(tmp_path)
    cfg_fpath = tmp_path / "config.yaml"
    cfg_fpath.write_text("shards_root: my/shards\nruns_root: my/runs\n" + VIT_SWEEP_CONFIG)
    assert cli.main(["create-run", str(cfg_fpath), "--index", "1"]) == 0, capsys.readouterr().err
    plan = WorkflowPlan.from_config(config.load(cfg_fpath))
    (run_id,) = [run_id for run_id, run_plan in plan.runs.items() if run_plan.index == 1]
    run = plan.run(run_id)
    assert capsys.readouterr().out.strip() == str(run.root) == f"my/runs/{run_id}" and run.config_fpath.is_file()
    assert run.link(run.TRAIN_SHARDS).resolve() == plan.shard(plan.shard_hash["vit"]).dpath.resolve()
    assert plan.shard(plan.shard_hash["vit"]).dpath == pathlib.Path("my/shards", plan.shard_hash["vit"])


def test_dead_latent_window_means_something_for_short_and_long_runs():
    """Default (null): a tenth of the run, at most 10M vectors; an explicit dead_after_vectors is taken in steps."""
    (plan,) = sweeps.plan_runs(_cfg(a={"train": "x", "layer": 0, "batch_size": 1000}), {"x": "h" * 64}, AUTO)
    cfg = plan.train_config
    assert cfg.dead_after_vectors is None and cfg.n_val_vectors == 262144  # the schema's bounded defaults
    assert objectives.dead_after_steps(cfg, n_steps=500) == 50  # 50k vectors: AuxK can switch on in a short run
    assert objectives.dead_after_steps(cfg, n_steps=10**6) == 10_000  # 10M vectors of 1000
    explicit = dataclasses.replace(cfg, dead_after_vectors=2500)
    assert objectives.dead_after_steps(explicit, n_steps=500) == 3


def test_config_trains_on_a_converted_shard_directory(tmp_path, capsys):
    """An activation that names an existing directory (path or hash), made by `saeflow convert`: no model, no data."""
    fixture = pathlib.Path(__file__).parent / "fixtures" / "interop" / "numpy1_protocol2"
    shards_root, runs_root = tmp_path / "shards", tmp_path / "runs"
    assert cli.main(["convert", str(fixture), "--to", "saev", str(shards_root)]) == 0
    converted = pathlib.Path(capsys.readouterr().out.strip().splitlines()[-1])
    sae_spec = {"train": "conv", "val": "conv-by-hash", "layer": 0, "tokens": "all", "arch": "topk", "expansion": 1,
                "k": 2, "batch_size": 8}  # fmt: skip
    cfg = {"shards_root": str(shards_root), "runs_root": str(runs_root),
           "activations": {"conv": {"shards": str(converted)}, "conv-by-hash": {"shards": converted.name}},
           "saes": {"s": sae_spec}}  # fmt: skip
    cfg_fpath = tmp_path / "config.yaml"
    cfg_fpath.write_text(json.dumps(cfg))
    argv = ["create-run", str(cfg_fpath), "--shards-root", str(shards_root), "--runs-root", str(runs_root)]
    assert cli.main(argv) == 0
    run_dpath = pathlib.Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert cli.main(["train", "--run", str(run_dpath), "--device", "cpu"]) == 0
    config_obj = json.loads((run_dpath / "checkpoint" / "config.json").read_text())
    assert config_obj["train_shards"] == config_obj["val_shards"] == converted.name
    assert load_sae(run_dpath / "checkpoint" / "sae.pt").d_model == shards.ShardDir(converted).metadata.d_model
    # A directory outside shards_root, a missing hash, or a model beside `shards`: one line naming the key.
    outside = tmp_path / "elsewhere" / converted.name
    shutil.copytree(converted, outside)
    capsys.readouterr()
    for bad, problem in [({"shards": str(outside)}, "not in shards_root"), ({"shards": "0" * 64}, "no directory"),
                         ({"shards": converted.name, "model": {"name": "x"}}, "activations.conv")]:  # fmt: skip
        cfg_fpath.write_text(json.dumps({**cfg, "activations": {**cfg["activations"], "conv": bad}}))
        assert cli.main(argv) != 0
        err = capsys.readouterr().err
        assert "activations.conv" in err and problem in err and "Traceback" not in err, err
