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
_received: list[str] = []


def _handle(signum, frame):
    _received.append(signal.Signals(signum).name)
    for sig in SIGNALS:  # the next one is not ours to soften
        signal.signal(sig, signal.SIG_DFL)


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
