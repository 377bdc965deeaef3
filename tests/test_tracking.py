"""Optional tracking (saeflow.training.tracking): TensorBoard event files and an offline W&B run hold the metrics.jsonl
records; a run killed after a logged step and resumed from an earlier one logs no step twice; a missing package
is one line."""

import json
import pathlib
import struct
import subprocess
import sys

import pytest

from builders import planted_data, run_from_sae_spec, write_shards
from hang import HANG_SEC
from saeflow import cli

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")

SPEC = dict(arch="topk", k=2, expansion=2, batch_size=32, n_epochs=1)  # 32 steps: metrics at 10, 20, 30, 32


@pytest.fixture
def shard_dir(tmp_path):
    x_nd, _ = planted_data(1024, d_model=16, n_atoms=16, k=2, seed=3)
    return write_shards(tmp_path / "shards", x_nd.reshape(-1, 1, 8, 16), layers=(0,), ex_per_shard=64, tag="t")


def _argv(run, tracking_dpath, *extra) -> list[str]:
    return ["train", "--run", str(run.root), "--device", "cpu", "--tracking-dir", str(tracking_dpath), *extra]


def _train(run, tracking_dpath, *extra) -> int:
    """One training attempt in its own process, as each job of the workflow is: W&B's service is per process, and
    starting one run id three times in one process races its teardown against the next start."""
    cmd = [sys.executable, "-m", "saeflow", *_argv(run, tracking_dpath, *extra)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_SEC)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.returncode


def _logged(run) -> dict[int, float]:
    """metrics.jsonl's loss per logged step (one line per step: the log is cut back to the resume point)."""
    lines = [json.loads(line) for line in run.metrics_log_fpath.read_text().splitlines()]
    steps = [line["step"] for line in lines if not line.get("final")]
    assert len(steps) == len(set(steps))
    return {line["step"]: line["loss"] for line in lines if not line.get("final")}


def _train_killed_and_resumed(run, tracking_dpath, *backend, before_resume=lambda: None):
    """Train with a kill after step 25 whose last resume point was step 10 (a logged step), then to the end: steps
    10 and 20 reach the trackers before the kill, 20, 30 and 32 after it."""
    track = ["--tracking", *backend]
    assert _train(run, tracking_dpath, *track, "--max-steps", "10") == 0  # resume point at step 10
    kept = run.resume_fpath.read_bytes()
    assert _train(run, tracking_dpath, *track, "--max-steps", "15") == 0  # logs step 20, stops at 25
    run.resume_fpath.write_bytes(kept)  # as if SIGKILLed at step 25 with its last checkpoint at step 10
    before_resume()
    assert _train(run, tracking_dpath, *track) == 0
    assert sorted(_logged(run)) == [10, 20, 30, 32]


@pytest.mark.slow
def test_tensorboard_holds_the_metrics_and_a_killed_run_logs_each_step_once(tmp_path, shard_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = run_from_sae_spec(tmp_path / "runs", shard_dir, **SPEC)
    _train_killed_and_resumed(run, tmp_path / "tb", "tensorboard")
    events = EventAccumulator(str(tmp_path / "tb" / run.root.name / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [10, 20, 30, 32]  # step 10 (the resume point) kept, step 20 once
    assert [e.value for e in loss] == pytest.approx([_logged(run)[e.step] for e in loss], rel=1e-6)
    (val_nmse,) = events.Scalars("val/nmse")
    final = json.loads(run.final_metrics_fpath.read_text())
    assert val_nmse.step == 32 and val_nmse.value == pytest.approx(final["nmse"], rel=1e-6)


def _wandb_records(fpath: pathlib.Path):
    """The protobuf records of a .wandb file: a 7-byte W&B header, then LevelDB-log records (32 KiB blocks, each
    chunk headed by checksum, length and type: 1 full, 2 first, 3 middle, 4 last)."""
    data = fpath.read_bytes()
    assert data[:4] == b":W&B", fpath
    pos, block_bytes, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block_bytes - pos % block_bytes < 7:  # a block's tail too short for a header is padding
            pos += block_bytes - pos % block_bytes
            continue
        _, n_bytes, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + n_bytes], pos + 7 + n_bytes
        if kind == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            yield buf


@pytest.mark.slow
def test_offline_wandb_runs_hold_the_metrics_and_a_killed_run_logs_each_step_once(tmp_path, shard_dir, monkeypatch):
    from wandb.proto import wandb_internal_pb2

    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline by default (saeflow's choice), then by WANDB_MODE
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = run_from_sae_spec(tmp_path / "runs", shard_dir, **SPEC)
    offline = lambda: monkeypatch.setenv("WANDB_MODE", "offline")  # noqa: E731
    _train_killed_and_resumed(run, tmp_path / "wb", "wandb", "--wandb-project", "planted", before_resume=offline)
    # An offline run cannot resume: one offline run directory per start, all with the run's W&B id.
    log_fpaths = sorted((tmp_path / "wb" / "wandb").glob(f"offline-run-*-{run.root.name[:32]}*/run-*.wandb"))
    assert len(log_fpaths) == 3
    steps, history, summary = [], {}, {}
    for log_fpath in log_fpaths:
        for data in _wandb_records(log_fpath):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.project == "planted"
            items = record.history.item if kind == "history" else record.summary.update if kind == "summary" else []
            values = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}
            if kind == "history" and "train/loss" in values:
                steps.append(values["_step"])
                history[values["_step"]] = values["train/loss"]
            elif kind == "summary":
                summary.update(values)
    assert sorted(steps) == [10, 20, 30, 32]  # step 20, logged before the kill and again after it, once
    assert history == pytest.approx(_logged(run), rel=1e-6)
    assert summary["val/nmse"] == pytest.approx(json.loads(run.final_metrics_fpath.read_text())["nmse"], rel=1e-6)


def test_a_missing_tracking_package_is_one_line(tmp_path, shard_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    run = run_from_sae_spec(tmp_path / "runs", shard_dir, **SPEC)
    assert cli.main(_argv(run, tmp_path / "wb", "--tracking", "wandb")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "saeflow train: error: train.tracking: wandb is not installed; pip install 'saeflow[tracking]'"
    assert not run.sae_fpath.exists()
