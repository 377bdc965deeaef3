"""`saeflow train`'s entry: a process that a launcher made one rank of several (saeflow.training.distributed) trains
with the others (saeflow.training.parallel, in the `parallel` mode); any other process trains alone
(saeflow.training.train). It sits above both, so the one-process loop never imports the ranks' code."""

import os
import typing

from saeflow.training import distributed, tracking, train
from saeflow.training import parallel as ranks

TRAIN_DEFAULTS = train.TRAIN_DEFAULTS


def train_runs(
    run_paths: typing.Sequence[str | os.PathLike],
    device: str = TRAIN_DEFAULTS["device"],
    checkpoint_every: int = TRAIN_DEFAULTS["checkpoint_every"],
    max_steps: int | None = None,
    local_copy: str = "",
    runs_per_pass: int = TRAIN_DEFAULTS["runs_per_pass"],
    tracking_settings: tracking.Settings | None = None,
    parallel: str = TRAIN_DEFAULTS["parallel"],
    buffer_bytes: str | int = TRAIN_DEFAULTS["buffer_bytes"],
) -> list[dict]:
    """train.train_runs in one process; on the ranks of a launched job parallel.train_runs, whose results are rank
    0's (an empty list elsewhere). `parallel`: how the ranks share a pass (sweep, data, latents or auto)."""
    if distributed.rendezvous_from_env() is None:
        return train.train_runs(run_paths, device, checkpoint_every, max_steps, local_copy, runs_per_pass,
                                tracking_settings, buffer_bytes)  # fmt: skip
    settings = dict(checkpoint_every=checkpoint_every, max_steps=max_steps, local_copy=local_copy,
                    runs_per_pass=runs_per_pass, tracking_settings=tracking_settings, parallel=parallel,
                    buffer_bytes=buffer_bytes)  # fmt: skip
    return ranks.train_runs(ranks.join(device), run_paths, settings)
