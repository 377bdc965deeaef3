"""Slurm's warning signal (USR1) or SIGTERM: training saves its resume checkpoint and extraction keeps its complete
shards, the command stops with one line, and the retry resumes to the same result as an uninterrupted run."""

import os
import signal

import torch
import yaml

from builders import file_bytes, planted_data, run_from_sae_spec, vision_spec, write_shards
from saeflow import cli
from saeflow.extraction import adapters, extract
from saeflow.extraction.specs import ActivationSpec
from saeflow.training import train
from saeflow.training.sae import load_sae


def _signal_self_at(monkeypatch, cls, name, call_no, signum):
    """Patch `cls.name` so that its `call_no`-th call first sends `signum` to this process (a real signal)."""
    real, calls = getattr(cls, name), []

    def patched(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == call_no:
            os.kill(os.getpid(), signum)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, patched)
    return lambda: monkeypatch.setattr(cls, name, real)


def test_training_stopped_by_usr1_resumes_to_identical_weights(tmp_path, monkeypatch, capsys):
    x_nd, _ = planted_data(1024, d_model=16, n_atoms=32, k=2, seed=1)
    sd = write_shards(tmp_path / "shards", x_nd.reshape(-1, 1, 8, 16), layers=(0,), ex_per_shard=64, tag="p")
    spec = dict(arch="topk", k=2, expansion=4, batch_size=32, n_epochs=1)
    whole = run_from_sae_spec(tmp_path / "whole", sd, **spec)
    train.train_runs([whole.root], train.TrainSettings(device="cpu"))
    run = run_from_sae_spec(tmp_path / "stopped", sd, **spec)

    restore = _signal_self_at(monkeypatch, train.Trainer, "train_step", 11, signal.SIGUSR1)
    assert cli.main(["train", "--run", str(run.root), "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("saeflow train: error: stopped by SIGUSR1: resume checkpoints saved at step 11 of 32")
    assert not run.sae_fpath.exists() and torch.load(run.resume_fpath, weights_only=True)["step"] == 11
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # handlers are put back after the command

    restore()
    assert cli.main(["train", "--run", str(run.root), "--device", "cpu"]) == 0  # the retry
    a, b = load_sae(whole.sae_fpath).state_dict(), load_sae(run.sae_fpath).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_extraction_stopped_by_sigterm_keeps_its_shards_and_resumes(tmp_path, monkeypatch, capsys):
    # 3 examples per shard, 2 batches each: batch 4 ends shard 1 (one layer: the CLI's directories are per layer)
    spec = vision_spec(batch_size=2, layers=[-1], patches_per_shard=17 * 3)
    clean = extract.extract(ActivationSpec.from_dict(spec), tmp_path / "clean", progress=False)
    config_fpath = tmp_path / "config.yaml"
    config_fpath.write_text(yaml.safe_dump({"shards_root": str(tmp_path / "root"), "activations": {"a": spec}}))

    restore = _signal_self_at(monkeypatch, adapters.Adapter, "run_points", 4, signal.SIGTERM)
    assert cli.main(["extract", str(config_fpath), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("saeflow extract: error: stopped by SIGTERM: ") and "keeps its complete shards" in err
    assert not (tmp_path / "root" / clean.dpath.name).exists()

    restore()
    assert cli.main(["extract", str(config_fpath), "--no-progress"]) == 0
    assert "resumed from example 6" in capsys.readouterr().err  # the batch in flight was finished, then it stopped
    assert file_bytes(tmp_path / "root" / clean.dpath.name) == file_bytes(clean.dpath)
