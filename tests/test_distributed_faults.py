"""Distributed faults and arguments (docs/distributed.md, "Resume, preemption, failure"): each is one line.

  - every bad launch argument (--nproc, --nodes, --max-steps, --runs-per-pass at or below zero, --device cuda:N with
    --gpus > 1) is refused before any rank starts;
  - the fake srun honours --kill-on-bad-exit, and saeflow's srun line gives each rank its CPUs and one GPU;
  - a rank killed while rank 0 publishes: rank 0 says what it published, and a rerun trains nothing again;
  - rank 0 (the store holder under srun) killed: the other rank names it in one line, with no C++ frames;
  - SIGTERM or SIGINT to the launcher: the ranks save, and the launcher says so in saeflow's own line.
"""

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from _ranks import free_port, start_ranks
from builders import planted_data, run_from_sae_spec, write_shards
from hang import HANG_SEC
from saeflow import cli, preempt
from saeflow.store.shards import ShardDir
from saeflow.training import resume
from saeflow.training.ranks import launch
from saeflow.training.ranks.dataparallel import DataParallelTrainer

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
FAKE_SRUN = REPO_ROOT / "tests" / "fake_slurm" / "srun"
POOL = "19200"  # 300 rows of d=16
SPEC = dict(k=2, expansion=4, batch_size=32, n_epochs=1, dead_after_vectors=256, arch="topk")  # 64 steps


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> ShardDir:
    x_nd, _ = planted_data(2048, d_model=16, n_atoms=32, k=2, seed=1)
    return write_shards(tmp_path_factory.mktemp("shards"), x_nd.reshape(-1, 1, 8, 16), layers=(0,), ex_per_shard=50,
                        tag="distributed-faults")  # fmt: skip


def _cli_train(run_roots, *flags: str) -> int:
    return cli.main(["train", *(a for r in run_roots for a in ("--run", str(r))), "--device", "cpu",
                     "--buffer-bytes", POOL, *flags])  # fmt: skip


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT / "workflow"), "OMP_NUM_THREADS": "1"}


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error" in line]


@pytest.mark.parametrize("flags, message", [
    (["--nproc", "0"], "--gpus (--nproc) must be at least 1, got 0"),
    (["--nproc", "-1"], "--gpus (--nproc) must be at least 1, got -1"),
    (["--nodes", "0"], "--nodes must be at least 1, got 0"),
    (["--nproc", "2", "--runs-per-pass", "0"], "--runs-per-pass must be at least 1, got 0"),
    (["--max-steps", "-5"], "--max-steps must be at least 1, got -5"),
    (["--max-steps", "0"], "--max-steps must be at least 1, got 0"),
    (["--checkpoint-every", "0"], "--checkpoint-every must be at least 1, got 0"),
    (["--device", "cuda:1", "--gpus", "2"], "--device cuda:1 with --gpus 2: each rank takes its own GPU"),
])  # fmt: skip
def test_a_bad_launch_argument_is_one_line_before_any_rank_starts(tmp_path, capsys, monkeypatch, flags, message):
    def no_ranks(args):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch, "start_ranks", no_ranks)
    assert cli.main(["train", "--run", str(tmp_path), *flags]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"saeflow train: error: {message}"), lines


def test_the_fake_srun_kills_the_other_tasks_when_one_fails():
    """`--kill-on-bad-exit`: task 1 fails at once while task 0 would sleep as long as the hang guard: srun kills task
    0 and exits with task 1's status (it used to poll task 0 alone, so it waited for it: this run would time out)."""
    script = f'if [ "$SLURM_PROCID" = 1 ]; then exit 3; fi; exec sleep {HANG_SEC:.0f}'
    proc = subprocess.run([str(FAKE_SRUN), "-n", "2", "--kill-on-bad-exit=1", "sh", "-c", script], timeout=HANG_SEC / 2)
    assert proc.returncode == 3


def test_the_srun_line_gives_each_rank_its_cpus_and_one_gpu():
    """Since Slurm 22.05 srun does not inherit the job's --cpus-per-task: saeflow passes it (the job's CPUs per task,
    else per GPU, else the node's CPUs over its ranks), and on GPUs binds task i of a node to the job's i-th GPU."""
    args = argparse.Namespace(run=[pathlib.Path("R")], gpus=4, nodes=2, device="auto", max_steps=None,
                              **{k: v for k, v in launch.config.section_defaults("train").items()
                                 if k not in ("gpus", "nodes", "device")})  # fmt: skip
    cardinal = {"SLURM_CPUS_PER_GPU": "12", "SLURM_CPUS_ON_NODE": "48", "SLURM_GPUS_ON_NODE": "4"}
    argv = launch.srun_argv(args, cardinal)
    assert argv[:6] == ["srun", "--nodes=2", "--ntasks-per-node=4", "--cpus-per-task=12", "--gpu-bind=per_task:1",
                        "--kill-on-bad-exit=1"]  # fmt: skip
    assert launch.srun_argv(args, {"SLURM_CPUS_PER_TASK": "6", **cardinal})[3] == "--cpus-per-task=6"
    cpu_only = launch.srun_argv(args, {"SLURM_CPUS_ON_NODE": "16"})
    assert cpu_only[3] == "--cpus-per-task=4" and not any(a.startswith("--gpu-bind") for a in cpu_only)
    args.device = "cpu"
    assert not any(a.startswith("--gpu-bind") for a in launch.srun_argv(args, cardinal))


def _die_when_publishing(run_roots) -> int:
    """Rank 1 dies as the last step ends, while rank 0 validates and publishes."""
    if os.environ["RANK"] == "1":
        DataParallelTrainer.finish = lambda self, val_dir: os._exit(9)
    return _cli_train(run_roots, "--parallel", "data")


def test_a_rank_killed_while_rank_0_publishes_is_reported_with_what_was_published(tmp_path, shards, capsys):
    """The pass trained to its end; rank 1 dies while rank 0 publishes: rank 0's line names rank 1 and the run it
    published (not "nothing was published"), and a rerun finds the run trained and trains nothing."""
    run = run_from_sae_spec(tmp_path, shards, **SPEC)
    job = start_ranks(2, _die_when_publishing, [run.root])
    assert job.wait(HANG_SEC) == [0, 9] and job.result(0) == 1, job.stderr(0)
    (line,) = _error_lines(job.stderr(0))
    assert line.startswith("saeflow train: error: rank 0: rank 1 is gone (") and "nothing was published" not in line
    assert f"published {run.root} (complete: a rerun skips it)" in line
    sae_bytes = run.sae_fpath.read_bytes()
    assert _cli_train([run.root], "--parallel", "data") == 0
    assert run.sae_fpath.read_bytes() == sae_bytes and capsys.readouterr().out == ""  # no result: nothing trained


DIE_WHEN_PUBLISHING = """
import os, signal
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RUN_ID"):  # rank 1 of the launcher's ranks only
    from saeflow.training.ranks.dataparallel import DataParallelTrainer
    DataParallelTrainer.finish = lambda self, val_dir: os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_the_launcher_reports_what_was_published_when_a_rank_dies_while_rank_0_publishes(tmp_path, shards, capsys):
    """`saeflow train --nproc 2`, rank 1 SIGKILLed as the last step ends (a sitecustomize in the ranks' path): the
    launcher's line names the killed rank and the run rank 0 published; a rerun trains nothing."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(DIE_WHEN_PUBLISHING)
    run = run_from_sae_spec(tmp_path / "runs", shards, **SPEC)
    env = {**_env(), "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO_ROOT / 'workflow'}"}
    proc = subprocess.run([sys.executable, "-m", "saeflow", "train", "--run", str(run.root), "--device", "cpu",
                           "--nproc", "2", "--parallel", "data", "--buffer-bytes", POOL], env=env,
                          capture_output=True, text=True, timeout=HANG_SEC)  # fmt: skip
    lines = _error_lines(proc.stderr)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "rank 1 (pid " in lines[-1] and "was killed by SIGKILL" in lines[-1], lines
    assert f"published {run.root} (complete: a rerun skips it)" in lines[-1], lines
    assert not any("nothing was published" in line for line in lines), lines
    sae_bytes = run.sae_fpath.read_bytes()
    assert _cli_train([run.root], "--parallel", "data") == 0
    assert run.sae_fpath.read_bytes() == sae_bytes and capsys.readouterr().out == ""


def _signalled_twice_then_interrupted() -> str | None:
    """In a rank's signal handling: SIGTERM twice (Slurm's, then the one its launcher passes on), then SIGINT."""
    with preempt.handling(), preempt.as_rank():
        for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT):
            os.kill(os.getpid(), sig)
            time.sleep(0.05)
        return preempt.received()


def test_a_rank_survives_a_repeated_stop_signal_and_takes_sigint_as_one():
    """A rank records the first stop signal and survives the repeats and a SIGINT, so it can save; one process keeps
    the old rule (a second signal terminates: a user's second Ctrl-C or kill means it)."""
    job = start_ranks(1, _signalled_twice_then_interrupted)
    assert job.wait(HANG_SEC) == [0] and job.result(0) == "SIGTERM", job.stderr(0)[-2000:]


def _children(pid: int) -> list[int]:
    tasks = pathlib.Path(f"/proc/{pid}/task").iterdir()
    return [int(child) for task in tasks for child in (task / "children").read_text().split()]


def _task_pid(srun_pid: int, procid: int) -> int:
    for child in _children(srun_pid):
        if f"SLURM_PROCID={procid}".encode() in pathlib.Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
            return child
    raise AssertionError(f"no task {procid} under srun {srun_pid}")


@pytest.mark.slow
def test_rank_0s_death_under_srun_is_named_in_one_line(tmp_path, shards):
    """`srun -n 2 python -m saeflow train` (the fake srun, without --kill-on-bad-exit: the other task lives on);
    rank 0, which holds the rendezvous store, is SIGKILLed mid-training: rank 1 stops with one line naming rank 0,
    no C++ frames, no traceback."""
    run = run_from_sae_spec(tmp_path, shards, **{**SPEC, "n_epochs": 40})
    env = {**_env(), "SLURM_JOB_ID": "1", "MASTER_PORT": str(free_port())}
    proc = subprocess.Popen([str(FAKE_SRUN), "-n", "2", sys.executable, "-m", "saeflow", "train", "--run",
                             str(run.root), "--device", "cpu", "--parallel", "data", "--buffer-bytes", POOL,
                             "--checkpoint-every", "20"], env=env, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + HANG_SEC
    while resume.resume_info(run) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(_task_pid(proc.pid, 0), signal.SIGKILL)
    _, err = proc.communicate(timeout=HANG_SEC)
    assert proc.returncode != 0
    assert "frame #" not in err and "Traceback" not in err, err[-3000:]
    (line,) = _error_lines(err)  # rank 0's progress bar may end without a newline where rank 1's line starts
    assert "saeflow train: error: rank 1: rank 0 is gone (the rendezvous store it held is unreachable)" in line, line
    assert "nothing was published" in line


def _launch(run, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "saeflow", "train", "--run", str(run.root), "--device", "cpu",
                             "--nproc", "2", "--buffer-bytes", POOL, "--checkpoint-every", "20", *flags],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


@pytest.mark.slow
def test_sigterm_and_sigint_to_the_launcher_save_and_stop_in_saeflows_own_line(tmp_path, shards):
    """`saeflow train --nproc 2` gets SIGTERM (a job's end), then, resumed, SIGINT (Ctrl-C): each time the ranks save
    resume checkpoints at one step and say so, and the launcher's line is saeflow's (no SignalException); the third
    run resumes from the second's checkpoint and finishes."""
    run = run_from_sae_spec(tmp_path, shards, **{**SPEC, "n_epochs": 40})
    last_step = 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        proc = _launch(run, "--parallel", "data")
        deadline = time.monotonic() + HANG_SEC
        while (resume.resume_info(run) or (0,))[0] <= last_step and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=HANG_SEC)
        assert proc.returncode == 1 and "SignalException" not in err and "Traceback" not in err, err[-3000:]
        lines = _error_lines(err)
        step = resume.resume_info(run)[0]
        assert step > last_step and len(lines) == 3, err[-3000:]
        for rank in (0, 1):
            assert f"saeflow train: error: rank {rank}: stopped by {sig.name} on rank " in err
            assert f"resume checkpoints saved at step {step} of 2560" in err
        assert lines[-1].startswith(f"saeflow train: error: stopped by {sig.name} (sent to the launcher, passed on")
        assert f"nothing was published; resume checkpoints at step {step}; rerun to resume" in lines[-1]
        last_step = step
    assert _cli_train([run.root], "--parallel", "data", "--max-steps", "1") == 0
    assert resume.resume_info(run)[0] == last_step + 1
