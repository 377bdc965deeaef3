"""Ranks for tests and benchmarks: forked copies of this process, each made one rank of a gloo job.

A fork starts in milliseconds (no interpreter, no torch import), so a test can afford several small multi-rank jobs.
Each child gets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and one torch thread, runs
`target(*args)`, and leaves its return value (pickled) and its stderr in files the parent reads back.

    results = run_ranks(2, fn, a, b)              # [fn's result on rank 0, on rank 1]
    job = start_ranks(2, fn, a); ...; job.kill(1); job.wait()
"""

import dataclasses
import multiprocessing
import os
import pathlib
import pickle
import signal
import socket
import sys
import tempfile
import time

import torch

from hang import HANG_SEC


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, out_dpath: pathlib.Path, target, args, kwargs) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    err_fd = os.open(out_dpath / f"stderr{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err_fd, 2)
    sys.stderr = open(2, "w", closefd=False)
    torch.set_num_threads(1)
    code = 0
    try:
        (out_dpath / f"result{rank}").write_bytes(pickle.dumps(target(*args, **kwargs)))
    except BaseException:  # noqa: BLE001 -- the parent reads the traceback
        import traceback

        traceback.print_exc()
        code = 99
    sys.stderr.flush()
    os._exit(code)


@dataclasses.dataclass
class Job:
    procs: list
    out_dpath: pathlib.Path

    def pid(self, rank: int) -> int:
        return self.procs[rank].pid

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        os.kill(self.procs[rank].pid, sig)

    def wait(self, timeout: float = HANG_SEC) -> list[int]:
        """The ranks' exit codes (-signal when killed); ranks still running at the timeout are killed (None)."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        codes = []
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
                codes.append(None)
            else:
                codes.append(proc.exitcode)
        return codes

    def stderr(self, rank: int) -> str:
        fpath = self.out_dpath / f"stderr{rank}"
        return fpath.read_text() if fpath.exists() else ""

    def result(self, rank: int):
        return pickle.loads((self.out_dpath / f"result{rank}").read_bytes())


def start_ranks(world_size: int, target, *args, **kwargs) -> Job:
    out_dpath = pathlib.Path(tempfile.mkdtemp(prefix="saeflow-ranks-"))
    ctx, port = multiprocessing.get_context("fork"), free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, out_dpath, target, args, kwargs))
             for r in range(world_size)]  # fmt: skip
    for proc in procs:
        proc.start()
    return Job(procs, out_dpath)


def run_ranks(world_size: int, target, *args, timeout: float = HANG_SEC, **kwargs) -> list:
    """`target(*args, **kwargs)` on `world_size` ranks; their results in rank order (a failed rank raises)."""
    job = start_ranks(world_size, target, *args, **kwargs)
    codes = job.wait(timeout)
    if any(code != 0 for code in codes):
        raise AssertionError(f"ranks exited {codes}:\n" + "\n".join(job.stderr(r)[-3000:] for r in range(world_size)))
    return [job.result(r) for r in range(world_size)]
