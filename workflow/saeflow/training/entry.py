"""`saeflow train`'s entry: a process that a launcher made one rank of several (saeflow.training.distributed) trains
with the others (saeflow.training.parallel, in the `parallel` mode); any other process trains alone
(saeflow.training.train). It sits above both, so the one-process loop never imports the ranks' code."""

import os
import typing

from saeflow.training import distributed, train
from saeflow.training import parallel as ranks
from saeflow.training.train import DEFAULT_SETTINGS, TrainSettings


def train_runs(run_paths: typing.Sequence[str | os.PathLike], settings: TrainSettings = DEFAULT_SETTINGS) -> list[dict]:
    """train.train_runs in one process; on the ranks of a launched job parallel.train_runs, whose results are rank
    0's (an empty list elsewhere)."""
    if distributed.rendezvous_from_env() is None:
        return train.train_runs(run_paths, settings)
    return ranks.train_runs(ranks.join(settings.device), run_paths, settings)
