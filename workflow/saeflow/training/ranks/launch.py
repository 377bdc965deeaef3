"""Starting the ranks of `saeflow train` (torch.distributed's own launchers, not a home-made one).

    saeflow train --run R --gpus 4                       4 ranks here, through torch.distributed.run's launcher
    saeflow train --run R --gpus 4 --nodes 2             inside a Slurm allocation: srun starts 8 ranks, 4 a node
    torchrun --nproc-per-node 4 -m saeflow train --run-dir R       torchrun starts them (note --run-dir)
    srun --ntasks-per-node 4 python -m saeflow train --run R       srun starts them; rendezvous from Slurm's env

A process that already is a rank (torchrun's or srun's variables: distributed.rendezvous_from_env)
trains;
`--gpus` and `--nodes` only say how many ranks to start. Under torchrun, write `--run-dir R` for `--run R`:
torchrun's parser takes `--run` as an abbreviation of its own `--run-path` ("ambiguous option"), even after
`-m saeflow`. Every other option of `saeflow train` reaches saeflow unchanged (tests/test_distributed.py checks
each one against torchrun's parser).
"""

import argparse
import logging
import os
import pathlib
import signal
import subprocess
import sys
import typing
import uuid

from saeflow import config, preempt
from saeflow.errors import SaeflowError
from saeflow.store import layout

LAUNCH_KEYS = ("gpus", "nodes")  # train settings that say how many ranks to start, not how they train
SHUTDOWN_SEC = 120  # after a stop signal, how long the launcher gives its ranks to save before it kills them


def rule_resources(train_settings: dict) -> dict:
    """The Snakemake resources of a train job with `gpus` ranks on each of `nodes` nodes (no torch: parse time).

    One node: `gpu` (sbatch --gpus=N, with --nodes=1 from N = 2 on) and saeflow starts the ranks itself. Several:
    `gres` gpu:N (per node), `nodes`, and the Slurm executor plugin's multi-task job (`mpi`, with
    --ntasks-per-node=N; with one GPU a node, --ntasks-per-gpu=1 and --ntasks=M, as the plugin wants at least two
    tasks per node for --ntasks-per-node): the job's shell runs outside any srun and saeflow's srun starts the ranks.
    CPUs and memory per GPU come from the cluster profile (cpus_per_gpu, mem_mb_per_cpu).
    """
    gpus, nodes = train_settings["gpus"], train_settings["nodes"]
    if nodes == 1:
        return {"gpu": gpus} if gpus == 1 else {"gpu": gpus, "nodes": 1}
    tasks = {"tasks_per_node": gpus} if gpus > 1 else {"tasks_per_gpu": 1, "tasks": nodes}
    return {"gres": f"gpu:{gpus}", "nodes": nodes, "mpi": "srun", **tasks}


def child_argv(args: argparse.Namespace) -> list[str]:
    """The command line each rank runs (after `python -m saeflow`): the same training, without the launch keys."""
    values = {key: getattr(args, key) for key in config.section_properties("train") if key not in LAUNCH_KEYS}
    runs = [arg for run in args.run for arg in ("--run-dir", str(run))]
    argv = ["train", *runs, *config.section_flags("train", values)]
    if args.max_steps is not None:
        argv += ["--max-steps", str(args.max_steps)]
    return argv + [flag for flag in ("--verbose", "--debug") if getattr(args, flag[2:], False)]


def start_ranks(args: argparse.Namespace) -> int | None:
    """Start the ranks `--gpus`/`--nodes` ask for and wait for them: the exit status. None when this process is to
    train itself (it is a rank already, or one process is asked for)."""
    from saeflow.training.ranks import distributed

    if distributed.rendezvous_from_env() is not None or (args.gpus == 1 and args.nodes == 1):
        return None
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # Slurm's warning goes to every process: the ranks handle it
    before = published(args.run)
    if args.nodes > 1:
        return _srun(args, before)
    return _torchrun(args, before)


def published(run_roots: typing.Iterable[pathlib.Path], before: typing.Collection[str] = ()) -> list[str]:
    """The runs of `run_roots` whose sae.pt exists (that is, trained and published), less those in `before`."""
    done = [str(root) for root in run_roots if layout.RunLayout(pathlib.Path(root)).sae_fpath.exists()]
    return [root for root in done if root not in before]


def _outcome(args: argparse.Namespace, before: list[str]) -> str:
    """What the job left: the runs it published, and where the others resume."""
    from saeflow.store import runs
    from saeflow.training import resume
    from saeflow.training.ranks import distributed

    steps = sorted({info[0] for root in args.run if (info := resume.resume_info(runs.Run(pathlib.Path(root))))})
    at = f"; resume checkpoints at step {', '.join(map(str, steps))}" if steps else ""
    return distributed.publish_note(published(args.run, before)) + at


def srun_argv(args: argparse.Namespace, environ: typing.Mapping[str, str]) -> list[str]:
    """The srun line that starts `--gpus` ranks on each of `--nodes` nodes of this allocation.

    Since Slurm 22.05 srun no longer inherits the job's --cpus-per-task, so a rank could be bound to one core: the
    line passes --cpus-per-task explicitly (the job's own, else its CPUs per GPU, as the OSC profiles ask for
    them, one GPU a rank; else the node's CPUs shared by its ranks). On GPUs, --gpu-bind=per_task:1 gives task i
    of a node the node's i-th GPU of the job (it then sees it as cuda:0); unlike --gpus-per-task it asks for no GPUs
    of its own, so it works with the job's --gres=gpu:N (docs/distributed.md)."""
    cpus = environ.get("SLURM_CPUS_PER_TASK") or environ.get("SLURM_CPUS_PER_GPU")
    if not cpus:
        cpus = max(1, int(environ.get("SLURM_CPUS_ON_NODE") or args.gpus) // args.gpus)
    argv = ["srun", f"--nodes={args.nodes}", f"--ntasks-per-node={args.gpus}", f"--cpus-per-task={cpus}"]
    has_gpus = any(environ.get(key) for key in ("SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS"))
    if has_gpus and args.device != "cpu":
        argv.append("--gpu-bind=per_task:1")
    return [*argv, "--kill-on-bad-exit=1", sys.executable, "-m", "saeflow", *child_argv(args)]


def _srun(args: argparse.Namespace, before: list[str]) -> int:
    if "SLURM_JOB_ID" not in os.environ:
        raise SaeflowError(
            f"--nodes {args.nodes}: ranks on several nodes are started with srun inside a Slurm allocation (sbatch, "
            "salloc, or the workflow's train job); elsewhere start them with torchrun on each node"
        )
    # --cpus-per-task stands for the job's CPUs per GPU: srun would read that variable as its --cpus-per-gpu too.
    env = {key: value for key, value in os.environ.items() if key != "SLURM_CPUS_PER_GPU"}
    try:
        code = subprocess.run(srun_argv(args, os.environ), env=env).returncode
    except FileNotFoundError:
        raise SaeflowError("--nodes: srun is not on PATH (is this a Slurm cluster?)") from None
    if code:
        stop = preempt.received()
        why = f"stopped by {stop}" if stop else f"the ranks stopped with exit status {code}"
        raise SaeflowError(f"srun: {why} (each rank's own line is above); {_outcome(args, before)}")
    return 0


def _torchrun(args: argparse.Namespace, before: list[str]) -> int:
    """`args.gpus` ranks on this node through torch.distributed.run's launcher (a standalone rendezvous).

    Its agent turns SIGTERM, SIGINT, SIGHUP and SIGQUIT into a SignalException after passing the signal on to the
    ranks (their own sessions: a Ctrl-C reaches the launcher alone), which save their resume checkpoints and stop
    (saeflow.preempt); the agent waits SHUTDOWN_SEC for them. The launcher then says so in one line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from saeflow.training.ranks import distributed

    if not getattr(args, "verbose", False):  # torch's agent logs its set-up and a report per failure at INFO/ERROR
        for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // args.gpus)))
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.gpus, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          shutdown_timeout=SHUTDOWN_SEC)  # fmt: skip
    try:
        elastic_launch(launch, sys.executable)("-m", "saeflow", *child_argv(args))
    except SignalException as err:
        raise SaeflowError(f"stopped by {signal.Signals(err.sigval).name} (sent to the launcher, passed on to the "
                           f"ranks); {_outcome(args, before)}; rerun to resume from there") from None  # fmt: skip
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode in (1, distributed.EXIT_PEER_GONE):  # the rank said why, in one line of its own
            return 1
        if failure.exitcode < 0:
            why = f"was killed by {signal.Signals(-failure.exitcode).name}"
        else:
            why = f"exited with status {failure.exitcode}"
        raise SaeflowError(
            f"rank {rank} (pid {failure.pid}) {why}; the other ranks were stopped; {_outcome(args, before)}; rerun "
            "to resume from the last checkpoint"
        ) from None
    return 0
