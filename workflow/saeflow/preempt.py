"""Stopping cleanly before a job's time limit: Slurm's warning signal (USR1, asked for with `--signal=USR1@180`)
or the SIGTERM it sends at the limit, shortly before SIGKILL.

    with preempt.handling():            # saeflow train / saeflow extract
        ... if preempt.received(): save the resume point, raise preempt.stopped(...)

While `handling()` is active the first USR1 or TERM only sets a flag; the work loop checks it between steps (or
batches), saves its resume point and stops with a one-line error, so the job fails and its retry (Snakemake
`retries`) resumes instead of starting over. A second signal acts as usual (terminates).
"""

import contextlib
import signal
import typing

from saeflow.errors import SaeflowError

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
RANK_SIGNALS = (*SIGNALS, signal.SIGINT)  # a rank's launcher passes its own SIGINT (Ctrl-C) on to it (as_rank)
_received: list[str] = []
_as_rank: list[bool] = []


def _handle(signum, frame):
    _received.append(signal.Signals(signum).name)
    if _as_rank:  # a rank: the same stop may come twice (from Slurm, then passed on by its launcher)
        return
    for sig in SIGNALS:  # the next one is not ours to soften
        signal.signal(sig, signal.SIG_DFL)


@contextlib.contextmanager
def as_rank() -> typing.Iterator[None]:
    """Inside `handling()`, for a rank of a launched job: SIGINT stops it as SIGTERM does (the launcher passes its
    Ctrl-C on to its ranks, which run in sessions of their own), and a repeated signal changes nothing: Slurm signals
    every process of a step, and the launcher then passes the same signal on, which must not kill a rank before it
    has saved (the launcher, or Slurm, kills a rank that does not stop in time)."""
    try:
        previous = signal.signal(signal.SIGINT, _handle)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    _as_rank.append(True)
    try:
        yield
    finally:
        _as_rank.clear()
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def handling() -> typing.Iterator[None]:
    """Turn USR1/TERM into a flag for the duration (main thread only; elsewhere a no-op)."""
    _received.clear()
    try:
        previous = {sig: signal.signal(sig, _handle) for sig in SIGNALS}
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _received.clear()


def received() -> str | None:
    """The name of the stop signal received (SIGUSR1, SIGTERM), else None."""
    return _received[0] if _received else None


def stopped(what: str) -> SaeflowError:
    """The error that ends a command stopped by a signal, after it saved its resume point."""
    return SaeflowError(f"stopped by {received()}: {what}; rerun to resume from there")
