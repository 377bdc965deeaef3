"""`saeflow train`'s entry: a process that a launcher made one rank of several (saeflow.training.ranks.distributed)
trains with the others (saeflow.training.ranks.parallel, in the `parallel` mode); any other process trains alone
(saeflow.training.train). It sits above both, so the one-process loop never imports the ranks' loop."""

import os
import typing

from saeflow.training import train
from saeflow.training.ranks import distributed, parallel
from saeflow.training.train import DEFAULT_SETTINGS, TrainSettings


def train_runs(run_paths: typing.Sequence[str | os.PathLike], settings: TrainSettings = DEFAULT_SETTINGS) -> list[dict]:
    """train.train_runs in one process; on the ranks of a launched job parallel.train_runs, whose results are rank
    0's (an empty list elsewhere)."""
    if distributed.rendezvous_from_env() is None:
        return train.train_runs(run_paths, settings)
    return parallel.train_runs(parallel.join(settings.device), run_paths, settings)
